"""A coordinator replica: its state is the event log applied in order, plus snapshots.

Contract (README, "Replicas"):
- Every mutation of the directory and of the instance registry is a record of the log
  (`coordinator_stub.durability.eventlog`), applied by every replica in stream order on ONE apply
  thread. Replicas fed the same stream hold the same directory, index and registry, and
  answer every lookup and `GET /instances` alike. Record kinds:
  * `events`: an `/events` body's batches (JSON, validated by the replica that took
    it), through the gate (`KeyDirectory.ingest`);
  * `register`: a `POST /instances` body, its `instance_id` already assigned by the
    replica that took it; inserts or replaces the record;
  * `beats`: a JSON list of instance ids heard from (heartbeats, coalesced);
  * `drop`: an instance left (`DELETE /instances/{id}`): deregistered, its L1
    placements fenced and its cursor forgotten;
  * `reap`: `{"timeout": s, "ids": [...]}`: every instance of `ids` not heard from for
    more than `s` seconds of log time is dropped as by `drop`, at this record (a record
    without `ids`, written before issue 19: every such instance); and ids that are not
    registered, hold nothing and sent no batch across reap records spanning more than
    `s` of log time lose their ingest cursor and capacity rows
    (`KeyDirectory.release_ghosts`). A replica appends a `reap` when it proposes ids, or
    when some id with a cursor is not registered and holds nothing.
- Log time: each record carries the time the stream stored it (stamped by the stream's
  leader, the same for every reader); the log's time is the largest seen so far, so it
  never goes back. A registration's `registration_time`, an instance's last heartbeat
  and every reaping decision use it, never a replica's own clock: every replica (and a
  replica replaying the stream later) reaps the same instances at the same record,
  exactly once. Replicas may all run the reaper.
- Reaping needs two clocks to agree: an instance is dropped only when the log's time
  AND the monotonic clock of the replica proposing the `reap` both say it has been silent
  for more than the timeout. The proposer names, in the record, the ids it has not heard
  of (a heartbeat taken there, or a register / beats record applied there) for over the
  timeout by `time.monotonic()`; applying the record drops those of them silent by log
  time. So a clock step on the log's host (log time jumping ahead of every beat) reaps
  nobody the replicas still hear, and no wall clock step on a replica's host moves its
  monotonic view; the outcome is still decided by the record alone, alike everywhere. A
  replica that starts (or restarts) counts every instance it has not heard of as heard
  when its reaper first looks, so it proposes nobody for a timeout after that. Instances are dropped only at `reap` records,
  so a quiet log reaps nobody until some replica's reaper appends one.
- Heartbeats: a replica answers a heartbeat from the registry it has applied (an id it
  does not know yet makes it first catch up with the log's end, so a registration taken
  by a peer a moment ago is not answered 404). It appends the beat only when it has not
  logged one for that id within `instance_timeout / 3`, and gathers them into one `beats`
  record every `min(1 s, instance_timeout / 10)`: the log carries about three ids per
  instance per timeout, whatever the heartbeat interval and however many replicas. A
  server whose heartbeats move to another replica keeps its registration (its next beat
  is logged at once there). Before appending a `reap`, a replica appends the beats it
  holds, so nothing it heard is reaped. A beat for an unknown id is ignored (a reaped
  instance is not brought back; its next heartbeat is answered 404 and it re-registers).
- `submit_events(body)`: validate the whole body (`WireError` -> 422, nothing appended),
  append its batches (one record, or several of at most `max_record_bytes` each; a batch
  larger than that is `TooLarge`, -> 413), wait for JetStream's acknowledgement, then for this
  replica to apply them, and answer their counts: a client reading from the replica it
  wrote to sees its write. The log not taking the record is `ServiceUnavailable` (-> 503,
  the reporter retries; the gate drops what was already appended). If applying here
  takes longer than `apply_timeout_s` the reply says so (`"pending"`): the records are
  durable and will be applied. `submit_register` answers once its record is applied
  here (`re_registered` as of that point of the log), 503 when the log does not take it
  or it is not applied within `apply_timeout_s` (a retry is a harmless re-registration).
- `start()`: load the newest sound snapshot (`coordinator_stub.durability.snapshot_format`), then apply
  the log from the record after it, and return once caught up with the log's end as it
  was at start: a replica serves only once it knows what its peers knew. Without a
  usable snapshot it replays the stream from its first record.
- Snapshots (with `snapshot_dir` and/or `snapshot_bucket`: `coordinator_stub.durability.snapshot_stores`):
  every `snapshot_interval_s`, and on `stop()`, written on the apply thread between
  records (ingest pauses; lookups go on), then uploaded to the bucket (ingest goes on).
  A snapshot holds the directory (placements, bindings, blend index, gate cursors,
  counters), the instance registry, the log time and the log position it includes. On
  start the newest sound one of either place is loaded: a replica with an empty disk
  starts from a peer's in the bucket.
- Retention: the stream keeps bounded history. A replica whose next record is gone
  (down too long, or paused or too slow while running) does not skip: it reloads the
  newest snapshot covering the gap (the bucket, or a shared `snapshot_dir`, has its
  peers'), and if none does, it stops with an error saying which records are lost and how to recover
  (`failure`; `python -m coordinator_stub` then exits 1) and never snapshots the state
  that misses them.

Not in the log: lookups (read-only), the stats counters' view of rejected requests,
heartbeats not yet due to be logged, and connection state. Runs its coroutines on the event loop; blocking work on its threads.
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

from blend_wire import (EventsReply, EventsRequest, RegisterReply, RegisterRequest, WireError,
                        decode, encode)
from coordinator_stub.config import ClusterConfig
from coordinator_stub.directory import KeyDirectory
from coordinator_stub.errors import ServiceUnavailable, TooLarge
from coordinator_stub.durability.eventlog import EventLog, LogGap, LogRecord, LogSettings, LogUnavailable
from coordinator_stub.writes.local import validated_batches
from coordinator_stub.service.instances import InstanceRegistry, with_instance_id
from coordinator_stub.durability.snapshot_format import layout_of
from coordinator_stub.durability.snapshot_stores import SnapshotBucket, Snapshots

log = logging.getLogger(__name__)

EVENTS = "events"
REGISTER = "register"
BEATS = "beats"
DROP = "drop"
REAP = "reap"

#: What `_append_and_wait` answers when the record is durable but not applied here in time.
_PENDING = object()


class _Reap(msgspec.Struct):
    timeout: float
    # The ids the proposing replica found silent by its own monotonic clock; None (a
    # record written before issue 19): every id silent by log time, as then.
    ids: list[str] | None = None


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
        self._on_reaped = on_reaped or (lambda count: None)
        self.applied = 0  # stream sequence of the last record applied here (loop's view)
        self._in_directory = 0  # ... the apply thread's: what a snapshot includes
        self.snapshot_seq = 0  # ... and of the last snapshot written or loaded
        self.restored_from = 0  # ... and of the snapshot this replica started from
        self.log_time = 0.0  # the latest record's stream time (apply thread)
        self.records_rejected = 0
        # How the last start went: loading the snapshot, then replaying up to the log's end.
        self.restore_s = self.replay_s = 0.0
        self.replayed = 0
        self.snapshot_write_s = 0.0  # the last snapshot written: seconds, bytes
        self.snapshot_bytes = 0
        # Heartbeats heard here, waiting for the next `beats` record; and when this replica
        # last queued a beat per id (monotonic), so a beat is logged once per refresh.
        timeout = coordinator.config.instance_timeout
        self._beat_refresh_s = timeout / 3
        self._beat_flush_s = min(1.0, timeout / 10)
        self._beats: set[str] = set()
        self._beat_queued: dict[str, float] = {}
        self._beats_lock = asyncio.Lock()
        # When this replica last heard of each instance by its own monotonic clock (a
        # heartbeat taken here, or a register / beats record applied): its half of the
        # reaping rule (module doc). An id it has not heard of counts as heard when the
        # reaper first looked (a restarted replica proposes nobody for a timeout).
        self._clock: Callable[[], float] = time.monotonic
        self._heard: dict[str, float] = {}
        self._first_look: float | None = None
        self._apply = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="apply")
        self._validate = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="validate")
        self._waiters: dict[str, asyncio.Future] = {}
        # The batches of `events` records this replica appended, decoded when it validated
        # them, until it applies them (a record from a peer is decoded from the log).
        self._decoded: dict[str, list] = {}
        self._progress = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._broken = False  # missed records: never snapshot this state
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
            config = self.coordinator.config
            state = {"directory": KeyDirectory(chunk_size=config.chunk_size,
                                               probe_stride=config.blend_probe_stride,
                                               enable_blend_lookup=config.enable_blend_lookup,
                                               trust_shared_hashes=config.trust_shared_hashes),
                     "instances": InstanceRegistry(), "log_time": 0.0}
        # On the apply thread: no record is being applied while the state is replaced.
        await loop.run_in_executor(self._apply, self._take, state, seq)
        self.applied = seq

    def _take(self, state: dict, seq: int) -> None:
        self.coordinator.directory.restore_from(state["directory"])
        self.coordinator.instances.restore_from(state["instances"])
        self.log_time = state["log_time"]
        self._in_directory = self.snapshot_seq = self.restored_from = seq

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

    def _apply_records(self, records: list[LogRecord]) -> list[tuple[str, object]]:
        """On the apply thread: every record, in order. Deterministic: a record that
        cannot be applied is skipped alike on every replica."""
        results = []
        for record in records:
            self._in_directory = record.seq  # records are applied whole (or skipped)
            self.log_time = max(self.log_time, record.time)
            try:
                reply = self._apply_record(record)
            except WireError as exc:
                self.records_rejected += 1
                log.error("log record %d is not a valid %s record (%s); skipped",
                          record.seq, record.kind, exc)
                continue
            except Exception as exc:  # nothing of the record applied (all or nothing)
                self.records_rejected += 1
                log.exception("log record %d could not be applied; skipped", record.seq)
                results.append((record.record_id, exc))
                continue
            if reply is _UNKNOWN:
                self.records_rejected += 1
                log.error("log record %d has unknown kind %r; skipped", record.seq,
                          record.kind)
                continue
            results.append((record.record_id, reply))
        return results

    def _apply_record(self, record: LogRecord) -> object:
        directory = self.coordinator.directory
        instances = self.coordinator.instances
        if record.kind == EVENTS:
            batches = self._decoded.pop(record.record_id, None)
            if batches is None:
                batches = decode(record.payload, EventsRequest).batches
            return directory.ingest(batches)
        if record.kind == REGISTER:
            instance_id, re_registered = instances.register(
                decode(record.payload, RegisterRequest), at=self.log_time)
            directory.readmit(instance_id)  # its L1 batches are taken again (gate.py)
            self._heard[instance_id] = self._clock()
            return encode(RegisterReply(instance_id=instance_id, re_registered=re_registered))
        if record.kind == BEATS:
            now = self._clock()
            for instance_id in decode(record.payload, list[str]):
                if instances.heartbeat(instance_id, at=self.log_time):
                    self._heard[instance_id] = now
            return None
        if record.kind == DROP:
            self._depart(record.payload.decode())
            return None
        if record.kind == REAP:
            reap = decode(record.payload, _Reap)
            timeout = reap.timeout
            reaped = instances.silent(timeout, now=self.log_time)
            if reap.ids is not None:  # both clocks must agree (module doc)
                proposed = set(reap.ids)
                reaped = [instance_id for instance_id in reaped if instance_id in proposed]
            for instance_id in reaped:
                log.info("instance %s silent for over %g s of log time (record %d): "
                         "deregistered, L1 fenced", instance_id, timeout, record.seq)
                self._depart(instance_id)
            if reaped:
                self._on_reaped(len(reaped))
            # Ids not registered that hold nothing, idle across reap records: released.
            directory.release_ghosts(instances.__contains__, self.log_time, timeout)
            return reaped
        return _UNKNOWN

    def _depart(self, instance_id: str) -> None:
        self._heard.pop(instance_id, None)
        self.coordinator.instances.deregister(instance_id)
        self.coordinator.directory.drop_instance(instance_id)

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
            return encode(EventsReply(applied=0, duplicates=0, stale=0))
        replies: list[asyncio.Future] = []
        record_ids: list[str] = []
        try:
            for payload, decoded in _records(raws, batches, self.log.max_record_bytes):
                record_id = uuid.uuid4().hex
                record_ids.append(record_id)
                waiter = self._waiters[record_id] = loop.create_future()
                replies.append(waiter)
                self._decoded[record_id] = decoded  # applied from these, not decoded again
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
                self._decoded.pop(record_id, None)
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
        self._beat_queued[request.instance_id] = time.monotonic()  # counts as a heartbeat
        return reply

    async def heartbeat(self, instance_id: str) -> bool:
        """Whether the instance is registered (False: answer 404, it re-registers)."""
        instances = self.coordinator.instances
        if instance_id not in instances:
            await self._caught_up_with_the_log()  # a peer may have taken it a moment ago
            if instance_id not in instances:
                return False
        self._heard[instance_id] = self._clock()
        now = time.monotonic()
        if now - self._beat_queued.get(instance_id, -self._beat_refresh_s) \
                >= self._beat_refresh_s:
            self._beat_queued[instance_id] = now
            self._beats.add(instance_id)
        return True

    async def drop(self, instance_id: str) -> None:
        """Append an instance's departure; return once applied here (or the timeout)."""
        await self._append_and_wait(DROP, instance_id.encode())

    def silent_here(self, timeout: float) -> list[str]:
        """Registered ids this replica has not heard of for over `timeout` s by its own
        monotonic clock (a wall clock step, here or on the log's host, moves nothing)."""
        now = self._clock()
        if self._first_look is None:
            self._first_look = now
        return [instance_id for instance_id in self.coordinator.instances.ids()
                if now - self._heard.get(instance_id, self._first_look) > timeout]

    async def reap(self, timeout: float) -> None:
        """The reaper's turn: when some instance is silent for over `timeout` s by this
        replica's monotonic clock, append the beats heard here, then a `reap` record
        naming those ids; applying it drops those of them also silent by log time."""
        proposed = self.silent_here(timeout)
        if not proposed and not await asyncio.get_running_loop().run_in_executor(
                self._apply, self._unregistered_cursors):
            return
        await self._flush_beats()
        await self._append_and_wait(REAP, encode(_Reap(timeout=timeout, ids=proposed)))

    def _unregistered_cursors(self) -> bool:
        """On the apply thread: whether some id with an ingest cursor is not registered
        and holds nothing (a `reap` record would release it once idle long enough)."""
        return self.coordinator.directory.has_ghosts(self.coordinator.instances.__contains__)

    async def _flush_beats(self) -> None:
        async with self._beats_lock:
            if not self._beats:
                return
            heard = sorted(self._beats)
            try:
                await self.log.append(BEATS, encode(heard), uuid.uuid4().hex)
            except LogUnavailable as exc:  # kept: the next flush tries again
                raise ServiceUnavailable(str(exc)) from None
            self._beats.difference_update(heard)

    async def _beats_every(self) -> None:
        while True:
            await asyncio.sleep(self._beat_flush_s)
            try:
                await self._flush_beats()
            except ServiceUnavailable as exc:
                log.warning("heartbeats not logged yet (%s); retrying", exc)
            except Exception:
                log.exception("logging heartbeats failed; retrying")
            horizon = time.monotonic() - self._beat_refresh_s
            self._beat_queued = {i: t for i, t in self._beat_queued.items() if t > horizon}

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
        path = self.snapshots.write({"directory": self.coordinator.directory,
                                     "instances": self.coordinator.instances,
                                     "log_time": self.log_time},
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
                "records_rejected": self.records_rejected, "log_time": self.log_time,
                "snapshot_write_s": self.snapshot_write_s,
                "snapshot_bytes": self.snapshot_bytes}


_UNKNOWN = object()


def _records(raws: list[msgspec.Raw], batches: list, limit: int):
    """`({"batches": [...]}` payload, its decoded batches) of at most `limit` bytes each,
    batches in order."""
    group: list[bytes] = []
    decoded: list = []
    size = 0
    for raw, batch in zip(raws, batches):
        raw = bytes(raw)
        if len(raw) + 16 > limit:
            raise TooLarge(
                f"a batch of {len(raw)} bytes exceeds the event log's largest record "
                f"({limit} bytes: the NATS server's max_payload); send smaller batches or "
                "raise max_payload")
        if group and size + len(raw) + 16 > limit:
            yield b'{"batches":[' + b",".join(group) + b"]}", decoded
            group, decoded, size = [], [], 0
        group.append(raw)
        decoded.append(batch)
        size += len(raw) + 1
    if group:
        yield b'{"batches":[' + b",".join(group) + b"]}", decoded


_layouts: dict[tuple, str] = {}


def _layout(config) -> str:
    key = (config.chunk_size, config.blend_probe_stride)
    if key not in _layouts:
        scratch = KeyDirectory(chunk_size=config.chunk_size,
                               probe_stride=config.blend_probe_stride,
                               enable_blend_lookup=True)
        index = scratch._index  # noqa: SLF001 - same package; fingerprint only
        _layouts[key] = layout_of(scratch, index, index._store, index._claims,
                                  scratch._gate, InstanceRegistry())
    return _layouts[key]


__all__ = ["LogReplica"]
