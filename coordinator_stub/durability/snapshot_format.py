"""Versioned snapshots of a replica's state: the file format, and a directory of them
(docs/DESIGN.md, "Coordinator replicas").

Contract:
- `SnapshotDir(path, keep).save(state, meta)` writes one file atomically (a temporary
  file, fsync, rename: a crash never leaves a half-written snapshot under a snapshot's
  name) and keeps the newest `keep` files. `meta` must hold `seq` (the last log record
  the state includes) and whatever a reader is asked to `expect`.
- `load_newest(expect)` returns `(state, meta)` of the newest snapshot that is sound and
  matches `expect` (a dict of meta fields, e.g. chunk size and stream), or None. Every
  snapshot it passes over is logged with the reason: `SnapshotRefused` says which.
  `read(path, expect)` reads one file or raises `SnapshotRefused`; `write(path, ...)`
  writes one (`coordinator_stub.durability.snapshot_stores` moves such files to and from a NATS
  object store, byte for byte).
- Partial files (`.writing-*`, `.fetching-*`) are locked (flock) by their writer while
  open; `SnapshotDir(...)` removes, at start, every one no live process holds (a writer
  killed mid-write leaves one). A shared directory on a file system without flock
  across hosts may lose a peer's write in progress: that snapshot fails, is logged, and
  the next interval writes another.
- Refused: a file that is not a snapshot, is truncated or fails its checksum (corrupt),
  or whose header does not describe the payload it holds (part sizes that are not
  non-negative integers adding up to the bytes after the header: corrupt, checked before
  anything is allocated);
  one written in another format than this code reads (a newer one, or an older one this
  build no longer reads); one whose layout fingerprint differs (written by a build whose
  state classes have other fields); one whose meta does not match `expect` (another
  chunk size, another stream).

File format (FORMAT 3): the line ``BLENDSNAP 3``, one line of JSON header (the meta, plus
`pickle_bytes`, `buffers`: the length of each raw buffer, and `blake3` of everything that
follows the header), then the state pickled (protocol 5) with its large arrays taken out
of band, then those arrays' bytes, one after the other. Why: an array is written from its
own memory and read into memory of its own (`readinto`), never copied through the pickle
stream, so a snapshot of a million chunks (a GB of tokens) loads at disk speed; what
stays in the pickle is the per-chunk Python records. The state objects own how they
pickle (`__getstate__`/`__setstate__` where a lock or a numba object must not travel).

Trust: a pickle can run code when loaded. The snapshot directory (and bucket) must be as
trusted as the coordinator's own code: only replicas write to it. The checksum is
verified before anything is unpickled.
"""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

import blake3
import numpy as np

log = logging.getLogger(__name__)

FORMAT = 3
_MAGIC = b"BLENDSNAP"
SUFFIX = ".blendsnap"
#: Bytes hashed and written per call: large enough to be fast, small enough that the
#: GIL is released and taken back often (the apply thread writes while lookups run).
_PIECE = 8 << 20


class SnapshotRefused(Exception):
    """A snapshot this coordinator will not load. The message says why and what happens."""


def layout_of(*objects: object) -> str:
    """Fingerprint of the state classes' fields: the names of every attribute of each
    object, with its class name. A build that adds or removes a field writes snapshots
    another build refuses (it then rebuilds from the log) instead of misreading them."""
    digest = blake3.blake3()
    for obj in objects:
        names = sorted(vars(obj)) if hasattr(obj, "__dict__") else sorted(obj.__slots__)
        digest.update(f"{type(obj).__qualname__}:{','.join(names)};".encode())
    return digest.hexdigest()[:16]


def snapshot_name(seq: int, replica: str) -> str:
    """File (and object) name: sorting names sorts snapshots by log position."""
    return f"snapshot-{int(seq):020d}-{replica}{SUFFIX}"


def seq_of(name: str) -> int | None:
    """The log position in a snapshot's name, or None for a name that is not one."""
    parts = name.split("-", 2)
    if len(parts) < 3 or parts[0] != "snapshot" or not parts[1].isdigit() \
            or not name.endswith(SUFFIX):
        return None
    return int(parts[1])


def _pieces(buffer: memoryview):
    for start in range(0, len(buffer), _PIECE):
        yield buffer[start:start + _PIECE]


def write(out: BinaryIO, state: Any, meta: dict) -> int:
    """Write `state` and `meta` as one snapshot to `out`; returns the bytes written."""
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(state, protocol=5, buffer_callback=buffers.append)
    raws = [memoryview(payload)] + [buffer.raw() for buffer in buffers]
    digest = blake3.blake3()
    for raw in raws:
        for piece in _pieces(raw):
            digest.update(piece)
    header = dict(meta, format=FORMAT, pickle_bytes=len(payload),
                  buffers=[raw.nbytes for raw in raws[1:]], blake3=digest.hexdigest())
    head = _MAGIC + b" %d\n" % FORMAT + json.dumps(header, sort_keys=True).encode() + b"\n"
    out.write(head)
    for raw in raws:
        for piece in _pieces(raw):
            out.write(piece)
    return len(head) + sum(raw.nbytes for raw in raws)


def read(path: str | os.PathLike, expect: dict, source: str = "") -> tuple[Any, dict]:
    """`(state, meta)` of one snapshot file, or `SnapshotRefused` saying why not (naming
    the snapshot as `source`, or by its path)."""
    where = source or str(path)
    with open(path, "rb", buffering=0) as src:
        meta = _header(where, src)
        sizes = _payload_sizes(meta, os.fstat(src.fileno()).st_size - src.tell())
        if sizes is None or not isinstance(meta.get("blake3"), str):
            # Outside the checksum: a size that is negative, not an integer, or not what the
            # file holds would fail (or allocate petabytes) before the checksum could say so.
            raise SnapshotRefused(f"snapshot {where} refused: its header does not describe "
                                  "the payload the file holds (corrupt); the replica "
                                  "rebuilds without it")
        wanted_digest = meta["blake3"]
        for field, wanted in expect.items():  # before reading GBs it would not use
            if meta.get(field) != wanted:
                raise SnapshotRefused(
                    f"snapshot {where} refused: its {field} is {meta.get(field)!r}, this "
                    f"coordinator needs {wanted!r}; the replica rebuilds without it")
        digest = blake3.blake3()
        raws = []
        for size in sizes:
            raw = np.empty(size, dtype=np.uint8)  # not zero-filled: every byte is read
            if not _fill(src, memoryview(raw), digest):
                raise SnapshotRefused(f"snapshot {where} refused: truncated (corrupt); the "
                                      "replica rebuilds without it")
            raws.append(raw)
        if src.read(1) or digest.hexdigest() != wanted_digest:
            raise SnapshotRefused(f"snapshot {where} refused: checksum mismatch (corrupt); "
                                  "the replica rebuilds without it")
    # Millions of records are created at once and all of them live on: collections while
    # loading would only walk them again and again (2-3x the load time).
    collecting = gc.isenabled()
    gc.disable()
    try:
        state = pickle.loads(raws[0], buffers=raws[1:])
    except Exception as exc:  # checksum was right: written by an incompatible build
        raise SnapshotRefused(f"snapshot {where} refused: cannot be loaded by this build "
                              f"({exc!r})") from None
    finally:
        if collecting:
            gc.enable()
    return state, meta


def _payload_sizes(meta: dict, file_bytes: int) -> list[int] | None:
    """The payload's part sizes the header names, when they are sane: non-negative
    integers adding up to what follows the header in the file (`file_bytes`); else None."""
    sizes = [meta.get("pickle_bytes")]
    buffers = meta.get("buffers")
    if not isinstance(buffers, list):
        return None
    sizes.extend(buffers)
    if not all(type(size) is int and size >= 0 for size in sizes) or sizes[0] == 0:
        return None
    return sizes if sum(sizes) == file_bytes else None


def _header(where: str, src: BinaryIO) -> dict:
    first = _line(src, 64)
    parts = first.split()
    if len(parts) != 2 or parts[0] != _MAGIC or not parts[1].isdigit():
        raise SnapshotRefused(f"snapshot {where} refused: not a snapshot file (corrupt); "
                              "the replica rebuilds without it")
    version = int(parts[1])
    if version > FORMAT:
        raise SnapshotRefused(
            f"snapshot {where} refused: written in format {version}, newer than this "
            f"coordinator reads ({FORMAT}); upgrade it, or it rebuilds without it")
    if version < FORMAT:
        raise SnapshotRefused(
            f"snapshot {where} refused: written in format {version}, older than this "
            f"coordinator reads ({FORMAT}); the replica rebuilds without it")
    try:
        meta = json.loads(_line(src, 1 << 20))
    except ValueError as exc:
        raise SnapshotRefused(f"snapshot {where} refused: unreadable header (corrupt: "
                              f"{exc})") from None
    if not isinstance(meta, dict):
        raise SnapshotRefused(f"snapshot {where} refused: unreadable header (corrupt); the "
                              "replica rebuilds without it")
    return meta


def _line(src: BinaryIO, limit: int) -> bytes:
    """One line from an unbuffered file, read a byte at a time (the header is short)."""
    line = bytearray()
    while len(line) < limit:
        byte = src.read(1)
        if not byte:
            break
        line += byte
        if byte == b"\n":
            break
    return bytes(line)


def _fill(src: BinaryIO, into: memoryview, digest) -> bool:
    """Read exactly `len(into)` bytes into `into`, hashing them; False if the file ends."""
    done = 0
    while done < len(into):
        count = src.readinto(into[done:done + _PIECE])
        if not count:
            return False
        digest.update(into[done:done + count])
        done += count
    return True


class SnapshotDir:
    def __init__(self, path: str | os.PathLike, keep: int = 3) -> None:
        self.path = Path(path)
        self.keep = keep
        self.path.mkdir(parents=True, exist_ok=True)
        self.remove_leftovers()

    def partial(self, prefix: str = ".writing-") -> tuple[int, Path]:
        """A new partial file `(fd, path)`, locked (flock) while its writer has it open:
        `remove_leftovers` tells a live writer's file from one a crash left behind."""
        fd, tmp = tempfile.mkstemp(prefix=prefix, dir=self.path)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd, Path(tmp)

    def remove_leftovers(self) -> list[Path]:
        """Remove partial files (`.writing-*`, `.fetching-*`) no live process holds: what a
        writer killed mid-write left. A file a live writer (this or another process, on
        this host) has open is locked, and kept. Returns the files removed."""
        removed = []
        for leftover in [*self.path.glob(".writing-*"), *self.path.glob(".fetching-*")]:
            try:
                fd = os.open(leftover, os.O_RDONLY)
            except OSError:  # gone meanwhile (renamed into place, or removed by a peer)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # locked: being written right now
                os.close(fd)
                continue
            try:
                leftover.unlink(missing_ok=True)
                removed.append(leftover)
            finally:
                os.close(fd)
        if removed:
            log.info("removed %d partial snapshot file(s) left by an interrupted write: %s",
                     len(removed), ", ".join(path.name for path in removed))
        return removed

    def save(self, state: Any, meta: dict) -> Path:
        final = self.path / snapshot_name(meta["seq"], meta.get("replica", "replica"))
        fd, tmp = self.partial()
        try:
            with os.fdopen(fd, "wb") as out:
                write(out, state, meta)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.prune()
        return final

    def files(self) -> list[Path]:
        """Snapshot files, newest (highest log position) first."""
        return sorted(self.path.glob(f"snapshot-*{SUFFIX}"), reverse=True)

    def prune(self) -> None:
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


__all__ = ["FORMAT", "SUFFIX", "SnapshotDir", "SnapshotRefused", "layout_of", "read",
           "seq_of", "snapshot_name", "write"]
