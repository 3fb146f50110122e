"""A coordinator replica: its state is the event log applied in order, plus snapshots.

Contract (README, "Replicas"):
- Every mutation of the directory is a record of the log (`coordinator_stub.eventlog`),
  applied by every replica in stream order on ONE apply thread through the same gate
  (`KeyDirectory.ingest`). Replicas fed the same stream hold the same directory and
  answer every lookup alike. Record kinds: `events` (an `/events` body's batches, as
  JSON, already validated by the replica that took it) and `drop` (an instance left:
  deregistered or reaped; its L1 placements are fenced and its cursor forgotten, at the
  same point of the stream on every replica).
- The instance registry is per replica: a server registers and heartbeats with the
  replica it talks to, and only that replica reaps it (appending a `drop`). A replica
  restart forgets its registrations; servers re-register on their next heartbeat (404).
- `submit_events(body)`: validate the whole body (`WireError` -> 422, nothing appended),
  append its batches (one record, or several of at most `max_record_bytes` each; a batch
  larger than that is `TooLarge`, -> 413), wait for JetStream's acknowledgement, then for this
  replica to apply them, and answer their counts: a client reading from the replica it
  wrote to sees its write. The log not taking the record is `ServiceUnavailable` (-> 503,
  the reporter retries; the gate drops what was already appended). If applying here
  takes longer than `apply_timeout_s` the reply says so (`"pending"`): the records are
  durable and will be applied.
- `start()`: load the newest sound snapshot (`coordinator_stub.snapshot`), then apply
  the log from the record after it, and return once caught up with the log's end as it
  was at start: a replica serves only once it knows what its peers knew. Without a
  usable snapshot it replays the stream from its first record.
- Snapshots (with `snapshot_dir` and/or `snapshot_bucket`: `coordinator_stub.snapshots`):
  every `snapshot_interval_s`, and on `stop()`, written on the apply thread between
  records (ingest pauses; lookups go on), then uploaded to the bucket (ingest goes on).
  A snapshot holds the directory (placements, bindings, blend index, gate cursors,
  counters) and the log position it includes. On start the newest sound one of either
  place is loaded: a replica with an empty disk starts from a peer's in the bucket.
- Retention: the stream keeps bounded history. A replica whose next record is gone
  (down too long, or too slow) does not skip: it reloads the newest snapshot covering
  the gap (the bucket, or a shared `snapshot_dir`, has its peers'), and if none does, it
  stops with an error saying what is lost and how to recover.

Not in the log: lookups (read-only), the stats counters' view of rejected requests, and
connection state. Runs its coroutines on the event loop; blocking work on its threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import os
import signal
import socket
import time
import uuid
from pathlib import Path
from typing import Callable

import msgspec

from blend_wire import EventsReply, EventsRequest, WireError, decode, encode
from coordinator_stub.config import ClusterConfig
from coordinator_stub.directory import KeyDirectory
from coordinator_stub.eventlog import EventLog, LogGap, LogRecord, LogSettings, LogUnavailable
from coordinator_stub.ingest import validated_batches
from coordinator_stub.service import ServiceUnavailable, TooLarge
from coordinator_stub.snapshot import layout_of
from coordinator_stub.snapshots import SnapshotBucket, Snapshots

log = logging.getLogger(__name__)

EVENTS = "events"
DROP = "drop"


class LogReplica:
    def __init__(self, coordinator, cluster: ClusterConfig, port: int) -> None:
        self.coordinator = coordinator
        self.cluster = cluster
        self.name = cluster.replica_name or f"{socket.gethostname()}-{port}"
        self.log = EventLog(LogSettings(
            servers=cluster.servers, stream=cluster.stream, replicas=cluster.replicas,
            max_bytes=cluster.max_bytes, max_msgs=cluster.max_msgs,
            max_age_s=cluster.max_age_s))
        self.snapshots: Snapshots | None = None  # opened in start() (the bucket needs NATS)
        self.applied = 0  # stream sequence of the last record applied here (loop's view)
        self._in_directory = 0  # ... the apply thread's: what a snapshot includes
        self.snapshot_seq = 0  # ... and of the last snapshot written or loaded
        self.restored_from = 0  # ... and of the snapshot this replica started from
        self.records_rejected = 0
        # How the last start went: loading the snapshot, then replaying up to the log's end.
        self.restore_s = self.replay_s = 0.0
        self.replayed = 0
        self.snapshot_write_s = 0.0  # the last snapshot written: seconds, bytes
        self.snapshot_bytes = 0
        self._apply = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="apply")
        self._validate = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="validate")
        self._waiters: dict[str, asyncio.Future] = {}
        self._progress = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._broken = False  # missed records: never snapshot this state

    # --- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        await self.log.open()
        cluster = self.cluster
        if cluster.snapshot_dir or cluster.snapshot_bucket:
            bucket = None
            if cluster.snapshot_bucket:
                bucket = await SnapshotBucket.open(
                    self.log.jetstream(timeout=60.0), cluster.snapshot_bucket,
                    cluster.replicas, cluster.snapshot_keep, self.log.max_record_bytes)
            self.snapshots = Snapshots(cluster.snapshot_dir, bucket, cluster.snapshot_keep)
        started = time.monotonic()
        await self._restore()
        self.restore_s = time.monotonic() - started
        _, last = await self.log.bounds()
        self._tasks.append(asyncio.create_task(self._consume(), name="log-consumer"))
        started = time.monotonic()
        await self._caught_up(last)
        self.replay_s = time.monotonic() - started
        self.replayed = last - self.restored_from
        log.info("replica %s restored (snapshot at record %d) in %.1f s, replayed %d records "
                 "in %.1f s", self.name, self.restored_from, self.restore_s, self.replayed,
                 self.replay_s)
        if self.snapshots is not None:
            self._tasks.append(asyncio.create_task(self._snapshot_every(), name="snapshots"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        loop = asyncio.get_running_loop()
        if self.snapshots is not None:
            try:
                path = await loop.run_in_executor(self._apply, self._snapshot)
                if path is not None:
                    await self.snapshots.publish(path)
            except Exception:
                log.exception("the snapshot on the way out failed")
            self.snapshots.close()
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(ServiceUnavailable("the replica is shutting down"))
        await self.log.close()
        self._apply.shutdown(wait=True)
        self._validate.shutdown(wait=True)

    # --- restoring ---------------------------------------------------------------------

    def _expect(self) -> dict:
        config = self.coordinator.config
        return {"stream": self.cluster.stream, "stream_created": self.log.created,
                "chunk_size": config.chunk_size, "blend": config.enable_blend_lookup,
                "probe_stride": config.blend_probe_stride,
                "layout": _layout(config)}

    async def _restore(self) -> None:
        """Newest usable snapshot into a fresh directory; `applied` = its position."""
        loop = asyncio.get_running_loop()
        first, last = await self.log.bounds()
        loaded = None
        if self.snapshots is not None:
            loaded = await self.snapshots.load_newest(
                self._expect(), lambda fn, *args: loop.run_in_executor(self._apply, fn, *args))
        seq, directory = 0, None
        if loaded is not None:
            state, meta = loaded
            if meta["seq"] > last:
                log.error("snapshot at record %d is ahead of the log (last record %d): it "
                          "was not taken from this stream's history; rebuilding from the "
                          "log", meta["seq"], last)
            else:
                directory, seq = state["directory"], meta["seq"]
                # It lives as long as the process: out of every later collection pass
                # (millions of records; the server freezes what it holds at start too).
                gc.freeze()
                log.info("replica %s loaded the snapshot at record %d", self.name, seq)
        if first > seq + 1:
            raise RuntimeError(
                f"the event log begins at record {first}, but the newest usable snapshot "
                f"covers records up to {seq}: records {seq + 1}..{first - 1} are gone "
                f"(retention). Copy a newer snapshot from a peer replica into "
                f"--snapshot-dir (or share the directory, or use --snapshot-store nats), or "
                f"raise the stream's retention")
        if directory is None:
            config = self.coordinator.config
            directory = KeyDirectory(chunk_size=config.chunk_size,
                                     probe_stride=config.blend_probe_stride,
                                     enable_blend_lookup=config.enable_blend_lookup)
        self.coordinator.directory.restore_from(directory)
        self.applied = self._in_directory = self.snapshot_seq = self.restored_from = seq

    async def _caught_up(self, seq: int) -> None:
        while self.applied < seq:
            self._progress.clear()
            await self._progress.wait()

    # --- applying ---------------------------------------------------------------------

    async def _consume(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                async for records in self.log.read_from(self.applied + 1):
                    results = await loop.run_in_executor(self._apply, self._apply_records,
                                                         records)
                    for record_id, reply in results:
                        waiter = self._waiters.pop(record_id, None)
                        if waiter is not None and not waiter.done():
                            if isinstance(reply, Exception):
                                waiter.set_exception(reply)
                            else:
                                waiter.set_result(reply)
                    self.applied = records[-1].seq
                    self._progress.set()
            except LogGap as gap:
                log.error("replica %s fell behind the log: %s; reloading a snapshot",
                          self.name, gap)
                try:
                    await self._restore()
                except RuntimeError as exc:
                    self._broken = True
                    log.critical("replica %s cannot continue without missing events: %s; "
                                 "stopping", self.name, exc)
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
            except LogUnavailable as exc:
                log.warning("event log unavailable (%s); retrying", exc)
                await asyncio.sleep(0.5)
            except Exception:  # the consumer must outlive any surprise, and say so
                log.exception("applying the event log failed at record %d; retrying",
                              self.applied + 1)
                await asyncio.sleep(0.5)

    def _apply_records(self, records: list[LogRecord]) -> list[tuple[str, object]]:
        """On the apply thread: every record, in order, through the gate."""
        directory = self.coordinator.directory
        results = []
        for record in records:
            self._in_directory = record.seq  # records are applied whole (or skipped)
            if record.kind == DROP:
                directory.drop_instance(record.payload.decode())
                results.append((record.record_id, None))
                continue
            if record.kind != EVENTS:
                # Deterministic on every replica: all of them skip it alike.
                self.records_rejected += 1
                log.error("log record %d has unknown kind %r; skipped", record.seq,
                          record.kind)
                continue
            try:
                batches = decode(record.payload, EventsRequest).batches
            except WireError as exc:
                self.records_rejected += 1
                log.error("log record %d is not a valid events body (%s); skipped",
                          record.seq, exc)
                continue
            try:
                results.append((record.record_id, directory.ingest(batches)))
            except Exception as exc:  # nothing of the batch applied (all or nothing)
                self.records_rejected += 1
                log.exception("log record %d could not be applied; skipped", record.seq)
                results.append((record.record_id, exc))
        return results

    # --- ingest ------------------------------------------------------------------------

    async def submit_events(self, body: bytes) -> bytes:
        loop = asyncio.get_running_loop()
        raws = await loop.run_in_executor(self._validate, validated_batches, body)
        if not raws:
            return encode(EventsReply(applied=0, duplicates=0, stale=0))
        replies: list[asyncio.Future] = []
        try:
            for payload in _records(raws, self.log.max_record_bytes):
                record_id = uuid.uuid4().hex
                waiter = self._waiters[record_id] = loop.create_future()
                replies.append(waiter)
                try:
                    await self.log.append(EVENTS, payload, record_id)
                except LogUnavailable as exc:
                    self._waiters.pop(record_id, None)
                    raise ServiceUnavailable(str(exc)) from None
            done, pending = await asyncio.wait(replies, timeout=self.cluster.apply_timeout_s)
        except BaseException:
            for waiter in replies:
                waiter.cancel()
            raise
        applied = duplicates = stale = 0
        for waiter in done:
            reply = waiter.result()
            applied += reply.applied
            duplicates += reply.duplicates
            stale += reply.stale
        if pending:
            for waiter in pending:
                waiter.cancel()
            log.warning("records appended but not applied here within %g s",
                        self.cluster.apply_timeout_s)
            return encode({"applied": applied, "duplicates": duplicates, "stale": stale,
                           "pending": len(pending)})
        return encode(EventsReply(applied=applied, duplicates=duplicates, stale=stale))

    async def submit_drop(self, instance_id: str) -> None:
        """Append an instance's departure; return once applied here (or the timeout)."""
        loop = asyncio.get_running_loop()
        record_id = uuid.uuid4().hex
        waiter = self._waiters[record_id] = loop.create_future()
        try:
            await self.log.append(DROP, instance_id.encode(), record_id)
            await asyncio.wait([waiter], timeout=self.cluster.apply_timeout_s)
        except LogUnavailable as exc:
            raise ServiceUnavailable(str(exc)) from None
        finally:
            self._waiters.pop(record_id, None)
            waiter.cancel()

    # --- snapshots -------------------------------------------------------------------------

    async def _snapshot_every(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.cluster.snapshot_interval_s)
            try:
                path = await loop.run_in_executor(self._apply, self._snapshot)
                if path is not None:
                    await self.snapshots.publish(path)
            except Exception:
                log.exception("snapshot failed; the next one is tried in %g s",
                              self.cluster.snapshot_interval_s)

    def _snapshot(self) -> Path | None:
        """On the apply thread, so no record is half applied. The file written, if any."""
        # `_in_directory`, not `applied`: a stop may cancel the consumer after a batch of
        # records was applied but before the loop saw it.
        seq = self._in_directory
        if self._broken or seq <= self.snapshot_seq:
            return None
        started = time.monotonic()
        path = self.snapshots.write({"directory": self.coordinator.directory},
                                    dict(self._expect(), seq=seq, replica=self.name,
                                         written_at=time.time()))
        self.snapshot_seq = seq
        self.snapshot_write_s = time.monotonic() - started
        self.snapshot_bytes = path.stat().st_size
        log.info("snapshot at record %d written in %.2f s (%d bytes): %s", seq,
                 self.snapshot_write_s, self.snapshot_bytes, path)
        return path

    def stats(self) -> dict:
        return {"replica": self.name, "stream": self.cluster.stream,
                "applied_seq": self.applied, "snapshot_seq": self.snapshot_seq,
                "restored_from_seq": self.restored_from, "restore_s": self.restore_s,
                "snapshot_write_s": self.snapshot_write_s,
                "snapshot_bytes": self.snapshot_bytes,
                "replayed_records": self.replayed, "replay_s": self.replay_s,
                "records_rejected": self.records_rejected}


def _records(raws: list[msgspec.Raw], limit: int):
    """`{"batches": [...]}` payloads of at most `limit` bytes, batches in order."""
    group: list[bytes] = []
    size = 0
    for raw in raws:
        raw = bytes(raw)
        if len(raw) + 16 > limit:
            raise TooLarge(
                f"a batch of {len(raw)} bytes exceeds the event log's largest record "
                f"({limit} bytes: the NATS server's max_payload); send smaller batches or "
                "raise max_payload")
        if group and size + len(raw) + 16 > limit:
            yield b'{"batches":[' + b",".join(group) + b"]}"
            group, size = [], 0
        group.append(raw)
        size += len(raw) + 1
    if group:
        yield b'{"batches":[' + b",".join(group) + b"]}"


_layouts: dict[tuple, str] = {}


def _layout(config) -> str:
    key = (config.chunk_size, config.blend_probe_stride)
    if key not in _layouts:
        scratch = KeyDirectory(chunk_size=config.chunk_size,
                               probe_stride=config.blend_probe_stride,
                               enable_blend_lookup=True)
        index = scratch._index  # noqa: SLF001 - same package; fingerprint only
        _layouts[key] = layout_of(scratch, index, index._store, scratch._gate)
    return _layouts[key]


__all__ = ["LogReplica"]
