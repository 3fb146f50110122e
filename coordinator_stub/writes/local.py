"""Fair, bounded ingest: `/events` bodies are validated and applied one batch at a time,
and emitters are served by start-time fair queuing in bytes, so a flood from any number
of emitters delays another emitter's small batch by at most the step already running.

The rest of its contract: docs/CONTRACTS.md, `coordinator_stub.writes.local`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import heapq
import itertools
import logging
import re
import threading
from typing import Callable

import msgspec

from blend_wire import (CacheEventBatch, EventsReply, WireError, batches_of, decode,
                        decode_batch, encode)
from coordinator_stub.errors import Forbidden, ShuttingDown
from coordinator_stub.scopes import Scope

log = logging.getLogger(__name__)


class IngestClosed(ShuttingDown):
    """The coordinator is shutting down; the body was not (fully) applied."""


class _Outline(msgspec.Struct):
    """A body's shape without its contents: the batches stay raw JSON until their turn."""

    batches: list[msgspec.Raw]


class _Route(msgspec.Struct):
    instance_id: object = ""


_PATH = re.compile(r"`\$")
#: The first batch's instance id, when the body opens with it (no escapes in it).
_OPENING = re.compile(rb'\s*\{\s*"batches"\s*:\s*\[\s*\{\s*"instance_id"\s*:\s*"([^"\\]*)"')
_SCAN, _VALIDATE, _APPLY = "scan", "validate", "apply"
_NOBODY = object()  # `_running` when no flow's turn is running
#: A turn goes on while its steps add up to at most this much JSON (about 40 chunks of
#: 256 tokens): small bodies finish in one turn, a large batch's step is a turn of its own.
TURN_BYTES = 64 << 10
#: What every step costs besides its bytes (its fixed work), so no step is free.
STEP_BYTES = 256
#: Scanning is a byte scan without building objects: this many times cheaper per byte.
_SCAN_DISCOUNT = 8


class _Job:
    __slots__ = ("body", "scope", "future", "raws", "decoded", "kept", "phase", "next",
                 "counts")

    def __init__(self, body: bytes, scope: Scope | None = None) -> None:
        self.body: bytes | None = body
        self.scope = scope
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.raws: list[msgspec.Raw] = []
        self.decoded: list[CacheEventBatch] = []
        self.kept = 0  # bytes counted against keep_decoded_bytes
        self.phase = _SCAN
        self.next = 0
        self.counts = [0, 0, 0]  # applied, duplicates, stale


class FairIngest:
    """One scheduler thread running validation and application steps, fairly queued."""

    def __init__(self, apply_batch: Callable[[CacheEventBatch, Scope | None], str], *,
                 keep_decoded_bytes: int = 16 << 20) -> None:
        self._apply_batch = apply_batch
        self.keep_decoded_bytes = keep_decoded_bytes
        self._kept = 0
        self._cond = threading.Condition()
        # Flows with work queued (the running one included); None is the scan queue.
        self._queues: dict[object, collections.deque[_Job]] = {}
        # Waiting flows: (start tag, cost of the next step, arrival number, flow).
        self._waiting: list[tuple[int, int, int, object]] = []
        self._arrivals = itertools.count()
        self._clock = 0  # virtual bytes: the start tag of the turn last started
        self._finish: dict[object, int] = {}  # idle flows' finish tags ahead of the clock
        self._running: object = _NOBODY
        self._thread: threading.Thread | None = None
        self._closed = False
        self.steps = 0

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="ingest", daemon=True)
                self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cond:
            for queue in self._queues.values():
                for job in queue:
                    _settle(job, IngestClosed("the coordinator is shutting down"))
            self._queues.clear()
            self._waiting.clear()
            self._finish.clear()

    # --- submitting ------------------------------------------------------------------------

    def submit(self, body: bytes, scope: Scope | None = None) -> concurrent.futures.Future:
        """Queue a body; the future resolves to its `EventsReply` (or its error: a batch
        outside `scope`, the poster's token's, is `Forbidden`, found while validating)."""
        job = _Job(body, scope)
        with self._cond:
            if self._closed:
                _settle(job, IngestClosed("the coordinator is shutting down"))
                return job.future
            self._enqueue_locked(_peek_route(body), job)
        return job.future

    @property
    def pending(self) -> int:
        """Bodies queued or in progress."""
        with self._cond:
            return sum(len(queue) for queue in self._queues.values())

    def _enqueue_locked(self, key: object, job: _Job) -> None:
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = collections.deque()
        queue.append(job)
        if len(queue) == 1 and key != self._running:  # newly active
            start = max(self._clock, self._finish.pop(key, 0) - TURN_BYTES)
            self._wait_locked(key, start)

    def _wait_locked(self, key: object, start: int) -> None:
        heapq.heappush(self._waiting, (start, _cost(self._queues[key][0]),
                                       next(self._arrivals), key))
        self._cond.notify()

    # --- the scheduler -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                start, _, _, key = heapq.heappop(self._waiting)
                self._clock = start  # never goes back: every waiting tag is >= the clock
                self._running = key
                queue = self._queues[key]
            spent = 0
            drained = False  # the flow's queue emptied during this turn
            while True:  # one turn: steps of this flow's bodies, up to TURN_BYTES
                job = queue[0]  # only this thread takes from a queue
                spent += _cost(job)
                try:
                    outcome = self._step(job)
                except Exception as exc:  # an internal error fails this body, not the thread
                    log.exception("ingest step failed; the body is answered with an error")
                    outcome = exc
                self.steps += 1
                with self._cond:
                    if outcome is not None:
                        queue.popleft()
                        drained = drained or not queue
                        self._kept -= job.kept
                        job.kept = 0
                    elif key is None:  # scanned: now it queues behind its emitter's bodies
                        queue.popleft()
                        self._enqueue_locked(_route(job), job)
                    more = (queue and not self._closed
                            and spent + _cost(queue[0]) <= TURN_BYTES)
                    if not more:
                        self._end_turn_locked(key, start + spent, drained)
                if outcome is not None:
                    # Answered once it has left its queue: a body its emitter sends on
                    # the answer finds the flow idle, and is tagged as newly active.
                    _settle(job, outcome)
                if not more:
                    break

    def _end_turn_locked(self, key: object, finish: int, drained: bool) -> None:
        self._running = _NOBODY
        if self._queues[key]:
            # Bodies that came after the queue emptied: newly active, as if they had come
            # after the turn; otherwise backlogged, next at the turn's finish tag.
            self._wait_locked(key, max(self._clock, finish - TURN_BYTES) if drained
                              else finish)
            return
        del self._queues[key]
        if not self._queues:  # nothing queued anywhere: no one to be fair to
            self._finish.clear()
            return
        self._finish[key] = finish
        if len(self._finish) > 2 * len(self._queues) + 64:  # forget tags the clock passed
            self._finish = {k: f for k, f in self._finish.items()
                            if f - TURN_BYTES > self._clock}

    def _step(self, job: _Job) -> EventsReply | BaseException | None:
        """One step of `job`: None, or when the body is done, what answers it (its reply,
        or the error that rejects it), to be settled once it has left its queue."""
        if job.phase == _SCAN:
            try:
                job.raws = _outline(job.body)
            except WireError as exc:
                return exc
            keep = len(job.body) <= self.keep_decoded_bytes
            with self._cond:
                if keep and self._kept + len(job.body) <= self.keep_decoded_bytes:
                    job.kept = len(job.body)
                    self._kept += job.kept
            job.phase = _VALIDATE
            return _reply(job) if not job.raws else None
        if job.phase == _VALIDATE:
            try:
                batch = _validated_batch(job.body, job.raws, job.next, job.scope)
            except (WireError, Forbidden) as exc:
                return exc
            if job.kept:
                job.decoded.append(batch)
            job.next += 1
            if job.next == len(job.raws):
                job.phase, job.next = _APPLY, 0
            return None
        # _APPLY
        i = job.next
        batch = job.decoded[i] if job.kept else _decode_batch(job.raws[i], i)
        if job.kept:
            job.decoded[i] = None  # its objects go as soon as it is applied
        verdict = self._apply_batch(batch, job.scope)
        job.counts[_COUNT_OF[verdict]] += 1
        job.next += 1
        return _reply(job) if job.next == len(job.raws) else None



def _peek_route(body: bytes) -> str | None:
    """The emitter named at the very start of the body, or None (scan it first)."""
    found = _OPENING.match(body, 0, 4096)
    if found is None:
        return None
    try:
        return found.group(1).decode("utf-8")
    except UnicodeDecodeError:
        return None


def _cost(job: _Job) -> int:
    """What the job's next step costs: the bytes of JSON it works through, plus the
    fixed `STEP_BYTES`."""
    if job.phase == _SCAN:
        return STEP_BYTES + len(job.body) // _SCAN_DISCOUNT
    return STEP_BYTES + (len(job.raws[job.next]) if job.next < len(job.raws) else 0)


def _route(job: _Job) -> str:
    """The emitter whose turns a body takes: its first batch's instance id. Not validated
    yet: anything that is not a string queues as "" and fails validation in its turn."""
    try:
        instance_id = msgspec.json.decode(job.raws[0], type=_Route).instance_id
    except msgspec.MsgspecError:
        return ""
    return instance_id if isinstance(instance_id, str) else ""


_COUNT_OF = {"applied": 0, "duplicate": 1, "stale": 2}


def _outline(body: bytes) -> list[msgspec.Raw]:
    """The body's batches as raw JSON: found by a byte scan, or when the body is not
    plainly `{"batches": [...]}`, by msgspec (which refuses it, or finds them)."""
    raws = batches_of(body)
    return decode(body, _Outline).batches if raws is None else raws


def _validated_batch(body: bytes, raws: list[msgspec.Raw], index: int,
                     scope: Scope | None) -> CacheEventBatch:
    """Batch `index` decoded and within `scope`, or the error that refuses the body: the
    body's own, when its JSON is broken anywhere (the scan that found the batches does
    not check it), as if it had been decoded whole first."""
    try:
        batch = _decode_batch(raws[index], index)
        if scope is not None:
            scope.check_batch(batch, index)
    except (WireError, Forbidden):
        decode(body, _Outline)
        raise
    return batch


def _decode_batch(raw: msgspec.Raw, index: int) -> CacheEventBatch:
    try:
        return decode_batch(raw)
    except WireError as exc:
        # Name the field as a whole-body decode would: `$.batches[3].seq`, not `$.seq`.
        message = str(exc)
        if "`$" in message:
            message = _PATH.sub(f"`$.batches[{index}]", message)
        else:
            message = f"{message} - at `$.batches[{index}]`"
        raise WireError(message, loc=(exc.loc[0], "batches", index, *exc.loc[1:]),
                        kind=exc.kind, input=exc.input) from None


def validated_batches(body: bytes, scope: Scope | None = None
                      ) -> tuple[list[msgspec.Raw], list[CacheEventBatch]]:
    """Every batch of an `/events` body as raw JSON and decoded, each validated
    (`WireError` names the first that is not, `Forbidden` the first outside `scope`, as
    `FairIngest` would). For the event log: it forwards the raw JSON, and the replica that
    took the body applies the decoded batches."""
    raws = _outline(body)
    return raws, [_validated_batch(body, raws, i, scope) for i in range(len(raws))]


def _reply(job: _Job) -> EventsReply:
    applied, duplicates, stale = job.counts
    return EventsReply(applied=applied, duplicates=duplicates, stale=stale)


def _settle(job: _Job, outcome: EventsReply | BaseException) -> None:
    """Answer the body; what it held goes first (then its bytes' last user is done)."""
    job.raws, job.decoded, job.body = [], [], None
    if job.future.done():
        return
    if isinstance(outcome, BaseException):
        job.future.set_exception(outcome)
    else:
        job.future.set_result(outcome)


class LocalWrites:
    """The `WritePath` of one coordinator process holding everything in memory: `/events`
    bodies go through the coordinator's `FairIngest`, the registry changes in place, and
    what takes the directory lock (registering, fencing, releasing) runs off the loop."""

    failure: str | None = None  # one process never stops on its own

    def __init__(self, coordinator, on_reaped: Callable[[int], None] | None = None) -> None:
        self.coordinator = coordinator  # a coordinator_stub.service.coordinator.Coordinator
        self.ingest_queue = FairIngest(self._apply_batch)
        self._on_reaped = on_reaped or (lambda count: None)

    async def start(self) -> None:
        self.ingest_queue.start()

    async def stop(self) -> None:
        self.ingest_queue.close()

    async def events(self, body: bytes, scope: Scope) -> bytes:
        return await asyncio.wrap_future(self.submit(body, scope))

    def submit(self, body: bytes, scope: Scope | None = None) -> concurrent.futures.Future:
        """Queue an `/events` body; the future's result is the reply body (`bytes`), or
        the refusal (`WireError`, `Forbidden` for a batch outside `scope`): nothing of the
        body applied."""
        reply: concurrent.futures.Future = concurrent.futures.Future()

        def done(job: concurrent.futures.Future) -> None:
            error = job.exception()
            if error is not None:
                reply.set_exception(error)
            else:
                reply.set_result(encode(job.result()))
        self.ingest_queue.submit(body, None if scope is None or scope.unrestricted else scope
                                 ).add_done_callback(done)
        return reply

    def _apply_batch(self, batch: CacheEventBatch, scope: Scope | None = None) -> str:
        reply = self.coordinator.directory.ingest([batch], speaks_for_of(scope))
        return "applied" if reply.applied else "duplicate" if reply.duplicates else "stale"

    async def register(self, request) -> bytes:
        # A chunk size it carries is bound, and its L1 readmitted, under the directory lock.
        return await _off_loop(self.coordinator.register, request)

    async def heartbeat(self, instance_id: str) -> bool:
        return self.coordinator.heartbeat(instance_id)

    async def drop(self, instance_id: str) -> None:
        """Deregister, then fence the instance's L1 and forget its cursor (off the loop: it
        takes the directory lock, between two batches). A client that waits for its last
        `/events` reply before deregistering (LMCache's servers do) has it applied first."""
        self.coordinator.deregister(instance_id)
        await _off_loop(self.coordinator.drop_instance, instance_id)

    async def reap(self, timeout: float) -> None:
        for instance_id in self.coordinator.instances.silent(timeout):
            log.info("instance %s silent for over %.0f s: deregistered, L1 fenced",
                     instance_id, timeout)
            await self.drop(instance_id)
            self._on_reaped(1)
        released = await _off_loop(self.coordinator.release_ghosts, timeout)
        if released:
            log.info("%d unregistered ids holding nothing, silent for over %.0f s: their "
                     "ingest cursors and capacity rows released", len(released), timeout)

    def stats(self) -> None:
        return None


def speaks_for_of(scope: Scope | None) -> Callable[[str], bool] | None:
    """The instances a poster's token speaks for, as `KeyDirectory.ingest` takes them
    (None: any)."""
    return None if scope is None or scope.instances is None else scope.allows_instance


def _off_loop(work: Callable, *args):
    """`work(*args)` on asyncio's default pool."""
    return asyncio.get_running_loop().run_in_executor(None, work, *args)
