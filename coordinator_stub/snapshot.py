"""Versioned snapshots of a replica's state in a directory on disk.

Contract:
- `SnapshotDir(path).save(state, meta)` writes one file atomically (a temporary file,
  fsync, rename: a crash never leaves a half-written snapshot under a snapshot's name)
  and keeps the newest `keep` files. `meta` must hold `seq` (the last log record the
  state includes) and whatever `load_newest` is asked to `expect`.
- `load_newest(expect)` returns `(state, meta)` of the newest snapshot that is sound and
  matches `expect` (a dict of meta fields, e.g. chunk size and stream), or None. Every
  snapshot it passes over is logged with the reason: `SnapshotRefused` says which.
  `read(path, expect)` reads one file or raises `SnapshotRefused`.
- Refused: a file that is not a snapshot, is truncated or fails its checksum (corrupt);
  one written in a newer format than this code reads; one whose layout fingerprint
  differs (written by a build whose state classes have other fields); one whose meta
  does not match `expect` (another chunk size, another stream).

File format (FORMAT 1): the line ``BLENDSNAP 1``, one line of JSON meta (including
`payload_bytes`, `sha256` of the payload and `layout`), then the payload: the state
pickled (protocol 5). The state objects own how they pickle (`__getstate__`/
`__setstate__` where a lock or a per-process hash must not travel).

Trust: a pickle can run code when loaded. The snapshot directory must be as trusted as
the coordinator's own code (local disk, or a share only replicas write to); it is
never read from the network.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FORMAT = 1
_MAGIC = b"BLENDSNAP"
_SUFFIX = ".blendsnap"


class SnapshotRefused(Exception):
    """A snapshot this coordinator will not load. The message says why and what happens."""


def layout_of(*objects: object) -> str:
    """Fingerprint of the state classes' fields: the names of every attribute of each
    object, with its class name. A build that adds or removes a field writes snapshots
    another build refuses (it then rebuilds from the log) instead of misreading them."""
    digest = hashlib.sha256()
    for obj in objects:
        names = sorted(vars(obj)) if hasattr(obj, "__dict__") else sorted(obj.__slots__)
        digest.update(f"{type(obj).__qualname__}:{','.join(names)};".encode())
    return digest.hexdigest()[:16]


class SnapshotDir:
    def __init__(self, path: str | os.PathLike, keep: int = 3) -> None:
        self.path = Path(path)
        self.keep = keep
        self.path.mkdir(parents=True, exist_ok=True)

    def save(self, state: Any, meta: dict) -> Path:
        payload = pickle.dumps(state, protocol=5)
        header = dict(meta, format=FORMAT, payload_bytes=len(payload),
                      sha256=hashlib.sha256(payload).hexdigest())
        name = f"snapshot-{int(meta['seq']):020d}-{meta.get('replica', 'replica')}{_SUFFIX}"
        fd, tmp = tempfile.mkstemp(prefix=".writing-", dir=self.path)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(_MAGIC + b" %d\n" % FORMAT)
                out.write(json.dumps(header, sort_keys=True).encode() + b"\n")
                out.write(payload)
                out.flush()
                os.fsync(out.fileno())
            final = self.path / name
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._prune()
        return final

    def files(self) -> list[Path]:
        """Snapshot files, newest (highest log position) first."""
        return sorted(self.path.glob(f"snapshot-*{_SUFFIX}"), reverse=True)

    def _prune(self) -> None:
        for old in self.files()[self.keep:]:
            old.unlink(missing_ok=True)  # another replica sharing the directory may race

    def load_newest(self, expect: dict) -> tuple[Any, dict] | None:
        for path in self.files():
            try:
                return read(path, expect)
            except SnapshotRefused as exc:
                log.error("%s", exc)
            except FileNotFoundError:  # pruned by a replica sharing the directory
                continue
        return None


def read(path: Path, expect: dict) -> tuple[Any, dict]:
    with open(path, "rb") as src:
        first = src.readline(64)
        parts = first.split()
        if len(parts) != 2 or parts[0] != _MAGIC or not parts[1].isdigit():
            raise SnapshotRefused(f"snapshot {path} refused: not a snapshot file (corrupt); "
                                  "the replica rebuilds without it")
        version = int(parts[1])
        if version > FORMAT:
            raise SnapshotRefused(
                f"snapshot {path} refused: written in format {version}, newer than this "
                f"coordinator reads ({FORMAT}); upgrade it, or it rebuilds without it")
        try:
            meta = json.loads(src.readline(1 << 16))
            payload = src.read()
        except ValueError as exc:
            raise SnapshotRefused(f"snapshot {path} refused: unreadable header (corrupt: "
                                  f"{exc})") from None
        if (not isinstance(meta, dict) or len(payload) != meta.get("payload_bytes")
                or hashlib.sha256(payload).hexdigest() != meta.get("sha256")):
            raise SnapshotRefused(f"snapshot {path} refused: truncated or checksum mismatch "
                                  "(corrupt); the replica rebuilds without it")
    for field, wanted in expect.items():
        if meta.get(field) != wanted:
            raise SnapshotRefused(
                f"snapshot {path} refused: its {field} is {meta.get(field)!r}, this "
                f"coordinator needs {wanted!r}; the replica rebuilds without it")
    try:
        state = pickle.loads(payload)
    except Exception as exc:  # checksum was right: written by an incompatible build
        raise SnapshotRefused(f"snapshot {path} refused: cannot be loaded by this build "
                              f"({exc!r})") from None
    return state, meta


__all__ = ["FORMAT", "SnapshotDir", "SnapshotRefused", "layout_of", "read"]
