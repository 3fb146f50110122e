"""A coordinator replica (`--event-log`): its state is the event log applied in order, plus
snapshots. The mechanism, record kinds, log time and the two clocks of reaping:
docs/DESIGN.md, "Coordinator replicas"; running replicas: docs/OPERATIONS.md.

Contract: `LogReplica` is the `WritePath` (`coordinator_stub.writes`) of a replica.
- `start()`: restore the newest sound snapshot, apply the log from there, return once
  caught up with the log's end as it was at start (RuntimeError when records it needs are
  gone or the log stays unreachable); `stop()` snapshots and closes.
- `events(body, scope)`: validate the whole body (`WireError`, `Forbidden`: nothing
  appended), append its batches (a batch over the log's largest record: `TooLarge`), answer
  once acknowledged and applied here (`"pending"` after `apply_timeout_s`); the log not
  taking it: `ServiceUnavailable`. `register`, `drop`, `reap` go through the log alike;
  `heartbeat` answers from the registry applied here.
- `failure`: why it stopped on its own (records it can no longer apply), or None.
Coroutines run on the event loop; records are applied on one apply thread.
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

from blend_wire import RegisterRequest, encode
from coordinator_stub.config import ClusterConfig
from coordinator_stub.directory import KeyDirectory, Tally
from coordinator_stub.errors import ServiceUnavailable
from coordinator_stub.memory import AfterBurst
from coordinator_stub.durability.eventlog import EventLog, LogGap, LogSettings, LogUnavailable
from coordinator_stub.writes.validation import validated_batches
from coordinator_stub.service.instances import InstanceRegistry, with_instance_id
from coordinator_stub.durability.snapshot_format import layout_of
from coordinator_stub.durability.snapshot_stores import SnapshotBucket, Snapshots
from coordinator_stub.writes.liveness import Liveness
from coordinator_stub.writes.records import (BEATS, DROP, EVENTS, REAP, REGISTER, RecordApplier,
                                             Reap, payloads)

log = logging.getLogger(__name__)

#: What `_append_and_wait` answers when the record is durable but not applied here in time.
_PENDING = object()


class LogReplica:
    def __init__(self, coordinator, cluster: ClusterConfig, port: int,
                 on_reaped: Callable[[int], None] | None = None) -> None:
        self.coordinator = coordinator
        self.cluster = cluster
        self.name = cluster.replica_name or f"{socket.gethostname()}-{port}"
        self.log = EventLog(LogSettings(
            servers=cluster.servers, stream=cluster.stream, replicas=cluster.replicas,
            max_bytes=cluster.max_bytes, max_msgs=cluster.max_msgs,
            max_age_s=cluster.max_age_s, connect_timeout_s=cluster.connect_timeout_s))
        self.snapshots: Snapshots | None = None  # opened in start() (the bucket needs NATS)
        self.applied = 0  # stream sequence of the last record applied here (loop's view)
        self.snapshot_seq = 0  # ... and of the last snapshot written or loaded
        self.restored_from = 0  # ... and of the snapshot this replica started from
        # How the last start went: loading the snapshot, then replaying up to the log's end.
        self.restore_s = self.replay_s = 0.0
        self.replayed = 0
        self.snapshot_write_s = 0.0  # the last snapshot written: seconds, bytes
        self.snapshot_bytes = 0
        # Its half of the reaping rule, and the heartbeats it logs (writes.liveness).
        self.liveness = Liveness(coordinator.config.instance_timeout)
        # Applies records on the apply thread (writes.records); its `in_directory` is what
        # a snapshot includes, its `log_time` the log's time.
        self.applier = RecordApplier(coordinator, self.liveness, on_reaped)
        self._apply = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="apply")
        self._validate = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="validate")
        self._waiters: dict[str, asyncio.Future] = {}
        self._progress = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._broken = False  # missed records: never snapshot this state
        self.after_burst = AfterBurst()  # gives the applied records' memory back
        #: Why this replica stopped on its own (records it can no longer apply), or None.
        self.failure: str | None = None

    # --- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Restore and catch up before serving (module doc). A start that does not finish
        (a signal during start-up, or it failed) is undone: nothing is left open."""
        try:
            await self._start()
        except BaseException:
            await asyncio.shield(self.stop(snapshot=False))
            raise

    async def _start(self) -> None:
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
        self._tasks.append(asyncio.create_task(self._beats_every(), name="heartbeats"))
        if self.snapshots is not None:
            self._tasks.append(asyncio.create_task(self._snapshot_every(), name="snapshots"))

    async def stop(self, snapshot: bool = True) -> None:
        """Stop what `start` began. `snapshot=False`: a start that did not finish (a signal
        during start-up, or it failed): its state is partial, nothing is written."""
        for task in self._tasks:
            task.cancel()
        self.after_burst.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        loop = asyncio.get_running_loop()
        if self.snapshots is not None and snapshot:
            try:
                path = await loop.run_in_executor(self._apply, self._snapshot)
                if path is not None:
                    await self.snapshots.publish(path)
            except Exception:
                log.exception("the snapshot on the way out failed")
        if self.snapshots is not None:
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
                "trust_shared_hashes": config.trust_shared_hashes,
                "layout": _layout(config)}

    async def _restore(self) -> None:
        """Newest usable snapshot into a fresh state; `applied` = its position."""
        loop = asyncio.get_running_loop()
        first, last = await self.log.bounds()
        loaded = None
        if self.snapshots is not None:
            loaded = await self.snapshots.load_newest(
                self._expect(), lambda fn, *args: loop.run_in_executor(self._apply, fn, *args))
        seq, state = 0, None
        if loaded is not None:
            snapshot, meta = loaded
            if meta["seq"] > last:
                log.error("snapshot at record %d is ahead of the log (last record %d): it "
                          "was not taken from this stream's history; rebuilding from the "
                          "log", meta["seq"], last)
            else:
                state, seq = snapshot, meta["seq"]
                log.info("replica %s loaded the snapshot at record %d", self.name, seq)
                # It lives as long as the process: out of every later collection pass
                # (millions of records; the server freezes what it holds at start too).
                gc.freeze()
        if first > seq + 1:
            raise RuntimeError(
                f"the event log begins at record {first}, but the newest usable snapshot "
                f"covers records up to {seq}: records {seq + 1}..{first - 1} are gone "
                f"(retention). Copy a newer snapshot from a peer replica into "
                f"--snapshot-dir (or share the directory, or use --snapshot-store nats), or "
                f"raise the stream's retention")
        if state is None:
            state = {**self.coordinator.fresh_state(), "log_time": 0.0}
        # On the apply thread: no record is being applied while the state is replaced.
        await loop.run_in_executor(self._apply, self._take, state, seq)
        self.applied = seq

    def _take(self, state: dict, seq: int) -> None:
        self.coordinator.take_state(state)
        self.applier.log_time = state["log_time"]
        self.applier.in_directory = self.snapshot_seq = self.restored_from = seq

    async def _caught_up(self, seq: int) -> None:
        while self.applied < seq:
            self._progress.clear()
            await self._progress.wait()

    async def _caught_up_with_the_log(self) -> None:
        """Until this replica has applied what the log held when asked (bounded by
        `apply_timeout_s`; on a timeout, or the log unavailable, it answers from what it has)."""
        try:
            _, last = await self.log.bounds()
            await asyncio.wait_for(self._caught_up(last), self.cluster.apply_timeout_s)
        except (LogUnavailable, asyncio.TimeoutError):
            pass

    # --- applying ---------------------------------------------------------------------

    async def _consume(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                async for records in self.log.read_from(self.applied + 1):
                    results = await loop.run_in_executor(self._apply, self.applier.apply,
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
                    # A peer's burst is held here as the bodies were where they came in.
                    self.after_burst.came(loop, sum(len(record.payload) for record in records))
            except LogGap as gap:
                log.error("replica %s fell behind the log: %s; reloading a snapshot",
                          self.name, gap)
                try:
                    await self._restore()
                except RuntimeError as exc:
                    self._fail(f"replica {self.name} cannot continue without missing events "
                               f"({gap}): {exc}")
                    return
                log.info("replica %s reloaded the snapshot at record %d; applying the log "
                         "from there", self.name, self.applied)
            except LogUnavailable as exc:
                log.warning("event log unavailable (%s); retrying", exc)
                await asyncio.sleep(0.5)
            except Exception:  # the consumer must outlive any surprise, and say so
                log.exception("applying the event log failed at record %d; retrying",
                              self.applied + 1)
                await asyncio.sleep(0.5)

    def _fail(self, reason: str) -> None:
        """Stop serving: this replica's state misses records it can no longer read."""
        self._broken = True
        self.failure = reason
        log.critical("%s; stopping", reason)
        os.kill(os.getpid(), signal.SIGTERM)

    # --- writing to the log -------------------------------------------------------------------

    async def _append_and_wait(self, kind: str, payload: bytes) -> object:
        """Append one record; its result once applied here, or `_PENDING` after
        `apply_timeout_s` (it is durable: it will be applied). `ServiceUnavailable` when
        the log does not take it."""
        loop = asyncio.get_running_loop()
        record_id = uuid.uuid4().hex
        waiter = self._waiters[record_id] = loop.create_future()
        try:
            try:
                await self.log.append(kind, payload, record_id)
            except LogUnavailable as exc:
                raise ServiceUnavailable(str(exc)) from None
            done, _ = await asyncio.wait([waiter], timeout=self.cluster.apply_timeout_s)
            return waiter.result() if done else _PENDING
        finally:
            self._waiters.pop(record_id, None)
            waiter.cancel()

    async def events(self, body: bytes, scope=None) -> bytes:
        loop = asyncio.get_running_loop()
        raws, batches = await loop.run_in_executor(self._validate, validated_batches, body,
                                                   scope)
        if not raws:
            return encode(Tally().reply())
        replies: list[asyncio.Future] = []
        record_ids: list[str] = []
        try:
            speaks_for = None if scope is None else scope.instances
            for payload, decoded in payloads(raws, batches, self.log.max_record_bytes,
                                             speaks_for):
                record_id = uuid.uuid4().hex
                record_ids.append(record_id)
                waiter = self._waiters[record_id] = loop.create_future()
                replies.append(waiter)
                # Applied here from these, not decoded again (peers decode the record).
                self.applier.decoded[record_id] = decoded, speaks_for
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
        finally:  # applied by now, or left to be decoded from the log when it comes
            for record_id in record_ids:
                self.applier.decoded.pop(record_id, None)
        tally = Tally()
        for waiter in done:
            tally.add(waiter.result())
        if pending:
            for waiter in pending:
                waiter.cancel()
            log.warning("records appended but not applied here within %g s",
                        self.cluster.apply_timeout_s)
            return encode({"applied": tally.applied, "duplicates": tally.duplicates,
                           "stale": tally.stale, "pending": len(pending)})
        return encode(tally.reply())

    # --- the instance registry --------------------------------------------------------------

    async def register(self, request: RegisterRequest) -> bytes:
        """`POST /instances` (its body decoded) through the log: the reply body once
        applied here. A chunk size it carries is checked first (`ChunkSizeConflict`)."""
        await asyncio.get_running_loop().run_in_executor(
            None, self.coordinator.check_registration, request)
        request = with_instance_id(request)
        reply = await self._append_and_wait(REGISTER, encode(request))
        if reply is _PENDING:
            raise ServiceUnavailable(
                f"registration appended but not applied here within "
                f"{self.cluster.apply_timeout_s:g} s; retry (a repeat is a re-registration)")
        self.liveness.registered(request.instance_id)
        return reply

    async def heartbeat(self, instance_id: str) -> bool:
        """Whether the instance is registered (False: answer 404, it re-registers)."""
        registered = self.coordinator.registered
        if not registered(instance_id):
            await self._caught_up_with_the_log()  # a peer may have taken it a moment ago
            if not registered(instance_id):
                return False
        self.liveness.beat(instance_id)
        return True

    async def drop(self, instance_id: str) -> None:
        """Append an instance's departure; return once applied here (or the timeout)."""
        await self._append_and_wait(DROP, instance_id.encode())

    def silent_here(self, timeout: float) -> list[str]:
        """Registered ids this replica has not heard of for over `timeout` s by its own
        monotonic clock."""
        return self.liveness.silent(self.coordinator.registered_ids(), timeout)

    async def reap(self, timeout: float) -> None:
        """The reaper's turn: when some instance is silent for over `timeout` s by this
        replica's monotonic clock, append the beats heard here, then a `reap` record
        naming those ids; applying it drops those of them also silent by log time."""
        proposed = self.silent_here(timeout)
        if not proposed and not await asyncio.get_running_loop().run_in_executor(
                self._apply, self._unregistered_cursors):
            return
        await self._flush_beats()
        await self._append_and_wait(REAP, encode(Reap(timeout=timeout, ids=proposed)))

    def _unregistered_cursors(self) -> bool:
        """On the apply thread: whether some id with an ingest cursor is not registered
        and holds nothing (a `reap` record would release it once idle long enough)."""
        return self.coordinator.has_ghosts()

    async def _flush_beats(self) -> None:
        await self.liveness.flush(self._append_beats)

    async def _append_beats(self, heard: list[str]) -> None:
        try:
            await self.log.append(BEATS, encode(heard), uuid.uuid4().hex)
        except LogUnavailable as exc:  # kept: the next flush tries again
            raise ServiceUnavailable(str(exc)) from None

    async def _beats_every(self) -> None:
        while True:
            await asyncio.sleep(self.liveness.flush_s)
            try:
                await self._flush_beats()
            except ServiceUnavailable as exc:
                log.warning("heartbeats not logged yet (%s); retrying", exc)
            except Exception:
                log.exception("logging heartbeats failed; retrying")
            self.liveness.prune()

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
        # `in_directory`, not `applied`: a stop may cancel the consumer after a batch of
        # records was applied but before the loop saw it.
        seq = self.applier.in_directory
        if self._broken or seq <= self.snapshot_seq:
            return None
        started = time.monotonic()
        path = self.snapshots.write({**self.coordinator.state(),
                                     "log_time": self.applier.log_time},
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
                "replayed_records": self.replayed, "replay_s": self.replay_s,
                "records_rejected": self.applier.records_rejected,
                "log_time": self.applier.log_time,
                "snapshot_write_s": self.snapshot_write_s,
                "snapshot_bytes": self.snapshot_bytes,
                "memory_given_back": self.after_burst.count}


_layouts: dict[tuple, str] = {}


def _layout(config) -> str:
    key = (config.chunk_size, config.blend_probe_stride)
    if key not in _layouts:
        scratch = KeyDirectory(chunk_size=config.chunk_size,
                               probe_stride=config.blend_probe_stride,
                               enable_blend_lookup=True)
        index = scratch._index  # noqa: SLF001 - same package; fingerprint only
        _layouts[key] = layout_of(*scratch.state_parts(), index, index._store,
                                  index._claims, index._claims.chunks, InstanceRegistry())
    return _layouts[key]


__all__ = ["LogReplica"]
