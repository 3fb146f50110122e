"""Where a replica keeps its snapshots: a local directory, a JetStream object store, or both
(docs/DESIGN.md, "Coordinator replicas").

Contract:
- `Snapshots(directory, bucket, keep)`: `directory` a `SnapshotDir` path (or "": none),
  `bucket` a `SnapshotBucket` (or None). At least one of them.
- `write(state, meta)` (blocking; the replica calls it on its apply thread, between
  records) writes one snapshot file (`coordinator_stub.durability.snapshot_format`'s format): into the
  directory, or without one into a private scratch directory. `await publish(path)` then
  uploads it to the bucket (ingest goes on meanwhile; the file does not change), and
  drops the scratch file. Both keep the newest `keep` snapshots.
- `await load_newest(expect, run)` returns `(state, meta)` of the newest sound snapshot
  matching `expect` found in either place, or None. Newest is the highest log position;
  a snapshot in both places is read from the directory. One from the bucket is
  downloaded first (into the directory, where it then stays like one written here; or
  into the scratch directory), then read exactly as a file is: the same checksum,
  format and `expect` rules, and every refusal is logged with its reason, naming the
  object (`nats://BUCKET/NAME`). A snapshot removed meanwhile (a peer pruned it) is
  skipped. NATS failing to list or deliver (a cluster busy replicating GBs) is retried
  for up to a minute, then that snapshot (or the bucket) is passed over, logged.
  `run(fn, *args)` runs blocking reads off the event loop.
- Pruning purges a deleted object's tombstone too, so the bucket lists only what it
  holds, however many snapshots were ever taken.
- The bucket is shared by the replicas of one stream (`<stream>-snapshots`): a replica on
  another machine, or a fresh one with an empty disk, starts from a peer's snapshot and
  replays only the records after it; a replica that fell behind the stream's retention
  uses a peer's snapshot that covers the gap.

`SnapshotBucket` keeps them in a nats-py object store: objects are named like the files
(`snapshot-<seq>-<replica>.blendsnap`), uploaded from the file with `put` (1 MiB chunks),
downloaded straight to a file (`fetch`), checking NATS's own size and SHA-256 of the
object as well (a mismatch is refused as corrupt) before the file's own checksum.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.object_store import (
    OBJ_ALL_META_PRE_TEMPLATE,
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_META_PRE_TEMPLATE,
    OBJ_STREAM_TEMPLATE,
)

from coordinator_stub.durability.snapshot_format import SnapshotDir, SnapshotRefused, read, seq_of

log = logging.getLogger(__name__)

#: Object chunks (each one acknowledged before the next is sent by nats-py's `put`; 1 MiB
#: uploaded fastest on loopback with 3 copies: 72 MiB/s, vs 40 with 4 MiB).
_CHUNK_BYTES = 1 << 20
#: Chunks asked for per fetch when downloading.
_FETCH_CHUNKS = 16
#: How long listing or downloading is retried before going on without the bucket (a
#: full replay of the stream costs far more: ~50 s per million chunks).
_PATIENCE_S = 60.0


class SnapshotBucket:
    def __init__(self, js, name: str, keep: int, max_payload: int) -> None:
        self.js = js  # a JetStream context with a long timeout (chunks are MBs)
        self.name = name
        self.keep = keep
        self.chunk_bytes = max(64 << 10, min(_CHUNK_BYTES, max_payload - 4096))
        self.store = None  # nats.js.object_store.ObjectStore, once opened

    @classmethod
    async def open(cls, js, name: str, replicas: int, keep: int,
                   max_payload: int) -> "SnapshotBucket":
        """The bucket, created if missing (file storage, `replicas` copies)."""
        bucket = cls(js, name, keep, max_payload)
        try:
            bucket.store = await js.object_store(name)
        except BucketNotFoundError:
            try:
                bucket.store = await js.create_object_store(name, config=api.ObjectStoreConfig(
                    description="coordinator replica snapshots",
                    storage=api.StorageType.FILE, replicas=replicas))
            except NatsError:  # a peer created it first
                bucket.store = await js.object_store(name)
        return bucket

    def label(self, name: str) -> str:
        return f"nats://{self.name}/{name}"

    async def names(self) -> list[str]:
        """Snapshot objects, newest first. Listed from the bucket stream's meta subjects
        (one request to its leader; nats-py's `list` watches them through a push
        consumer instead), each confirmed live with `get_info`."""
        info = await self.js.stream_info(
            OBJ_STREAM_TEMPLATE.format(bucket=self.name),
            subjects_filter=OBJ_ALL_META_PRE_TEMPLATE.format(bucket=self.name))
        names = []
        for subject in info.state.subjects or {}:
            encoded = subject.rsplit(".", 1)[-1]
            try:
                name = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
            except (ValueError, UnicodeDecodeError):
                continue
            if seq_of(name) is None:
                continue
            try:
                await self.store.get_info(name)
            except NotFoundError:  # deleted (a tombstone not purged yet)
                continue
            names.append(name)
        return sorted(names, reverse=True)

    async def put(self, path: Path) -> None:
        meta = api.ObjectMeta(name=path.name, options=api.ObjectMetaOptions(
            max_chunk_size=self.chunk_bytes))
        with open(path, "rb") as src:
            await self.store.put(path.name, src, meta=meta)
        await self.prune()

    async def prune(self) -> None:
        for name in (await self.names())[self.keep:]:
            try:
                await self.store.delete(name)
            except NotFoundError:  # a peer pruned it first
                pass
            # The delete leaves a tombstone under the object's meta subject: purge it, or
            # every snapshot ever taken would stay listed.
            await self.js.purge_stream(OBJ_STREAM_TEMPLATE.format(bucket=self.name),
                                       subject=self._meta_subject(name))

    def _meta_subject(self, name: str) -> str:
        return OBJ_META_PRE_TEMPLATE.format(
            bucket=self.name, obj=base64.urlsafe_b64encode(name.encode()).decode())

    async def fetch(self, name: str, into: Path) -> None:
        """Download object `name` to file `into`. FileNotFoundError if it is gone (pruned
        meanwhile); SnapshotRefused if it is not whole (NATS's own size, chunk count and
        SHA-256 of the object).

        Read with a pull consumer on the object's chunks (the object store's subjects,
        `OBJ_CHUNKS_PRE_TEMPLATE`), batches of chunks per request: nats-py's `get`
        delivers them through a flow-controlled push consumer at about a fifth of the
        speed (measured on loopback: 60 vs 280 MiB/s)."""
        try:
            info = await self.store.get_info(name)
        except NotFoundError:
            raise FileNotFoundError(self.label(name)) from None
        if info.is_link() or not info.nuid:
            raise SnapshotRefused(f"snapshot {self.label(name)} refused: not a stored object "
                                  "(a link, or no data); the replica rebuilds without it")
        loop = asyncio.get_running_loop()
        digest = hashlib.sha256()
        received = chunks = 0
        sub = await self.js.pull_subscribe(
            OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.name, obj=info.nuid),
            stream=OBJ_STREAM_TEMPLATE.format(bucket=self.name),
            config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL,
                                      ack_policy=api.AckPolicy.NONE, mem_storage=True,
                                      num_replicas=1, inactive_threshold=30.0))
        try:
            with open(into, "wb") as out:
                while chunks < (info.chunks or 0):
                    # A timeout (the chunks purged meanwhile, or NATS too slow) is the
                    # caller's to report; it tries an older snapshot.
                    msgs = await sub.fetch(min(_FETCH_CHUNKS, info.chunks - chunks),
                                           timeout=30.0)
                    data = [msg.data for msg in msgs]
                    await loop.run_in_executor(None, _write_hashing, out, data, digest)
                    chunks += len(data)
                    received += sum(len(piece) for piece in data)
        finally:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection may be reconnecting; the consumer expires
                pass
        expected = base64.urlsafe_b64encode(digest.digest()).decode()
        if received != info.size or info.digest != f"SHA-256={expected}":
            raise SnapshotRefused(f"snapshot {self.label(name)} refused: the object store's "
                                  "size or SHA-256 does not match its chunks (corrupt); the "
                                  "replica rebuilds without it")


async def _patiently(attempt: Callable[[], Awaitable[Any]], what: str) -> Any:
    """`attempt()`, tried again while NATS answers with errors or not at all (a cluster
    busy replicating GBs answers some requests late, or "temporarily unavailable"),
    for up to `_PATIENCE_S`; then None (the caller falls back to older snapshots or the
    stream), with every failure logged."""
    deadline = time.monotonic() + _PATIENCE_S
    while True:
        try:
            return await attempt()
        except (NatsError, asyncio.TimeoutError) as exc:
            if time.monotonic() > deadline:
                log.error("cannot %s (%r); going on without it", what, exc)
                return None
            log.warning("cannot %s yet (%r); retrying", what, exc)
            await asyncio.sleep(1.0)


def _write_hashing(out, pieces: list[bytes], digest) -> None:
    for piece in pieces:
        digest.update(piece)
        out.write(piece)


class Snapshots:
    def __init__(self, directory: str, bucket: SnapshotBucket | None, keep: int = 3) -> None:
        if not directory and bucket is None:
            raise ValueError("snapshots need a directory, a bucket, or both")
        self.dir = SnapshotDir(directory, keep) if directory else None
        self.bucket = bucket
        self._scratch = None if self.dir else SnapshotDir(
            tempfile.mkdtemp(prefix="blend-snapshots-"), keep=1)

    @property
    def _local(self) -> SnapshotDir:
        return self.dir or self._scratch

    def describe(self) -> str:
        places = [str(self.dir.path)] if self.dir else []
        if self.bucket is not None:
            places.append(f"nats://{self.bucket.name}")
        return " and ".join(places)

    # --- writing ------------------------------------------------------------------------

    def write(self, state: Any, meta: dict) -> Path:
        return self._local.save(state, meta)

    async def publish(self, path: Path) -> None:
        try:
            if self.bucket is not None:
                started = time.monotonic()
                await self.bucket.put(path)
                log.info("snapshot uploaded to %s in %.2f s", self.bucket.label(path.name),
                         time.monotonic() - started)
        finally:
            if self.dir is None:
                path.unlink(missing_ok=True)

    # --- reading ------------------------------------------------------------------------

    async def load_newest(self, expect: dict,
                          run: Callable[..., Awaitable[Any]]) -> tuple[Any, dict] | None:
        local = {path.name: path for path in self.dir.files()} if self.dir else {}
        remote: list[str] = []
        if self.bucket is not None:
            names = await _patiently(self.bucket.names, f"list nats://{self.bucket.name}")
            remote = [name for name in names or () if name not in local]
            log.info("snapshots: %d in %s, %d more in nats://%s", len(local),
                     self.dir.path if self.dir else "no directory", len(remote),
                     self.bucket.name)
        for name in sorted([*local, *remote], key=seq_of, reverse=True):
            try:
                if name in local:
                    return await run(read, local[name], expect)
                loaded = await _patiently(lambda: self._load_remote(name, expect, run),
                                          f"download {self.bucket.label(name)}")
                if loaded is not None:
                    return loaded
            except SnapshotRefused as exc:
                log.error("%s", exc)
            except FileNotFoundError:  # pruned meanwhile (by a peer, or a replica sharing it)
                log.warning("snapshot %s is gone (pruned meanwhile); trying an older one",
                            name)
        return None

    async def _load_remote(self, name: str, expect: dict, run) -> tuple[Any, dict]:
        local = self._local
        fd, tmp = local.partial(".fetching-")  # held (locked) until fetched and read
        try:
            await self.bucket.fetch(name, tmp)
            loaded = await run(read, tmp, expect, self.bucket.label(name))
            log.info("loaded snapshot %s (%d bytes)", self.bucket.label(name),
                     tmp.stat().st_size)
            if self.dir is not None:  # a peer's snapshot is now one of ours too
                os.replace(tmp, self.dir.path / name)
                self.dir.prune()
            return loaded
        finally:
            tmp.unlink(missing_ok=True)
            os.close(fd)

    def close(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch.path, ignore_errors=True)


__all__ = ["SnapshotBucket", "Snapshots"]
