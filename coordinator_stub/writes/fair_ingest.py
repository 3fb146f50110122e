"""Fair, bounded ingest for one process: `/events` bodies are validated and applied one
batch at a time, and emitters are served by start-time fair queuing in bytes
(`coordinator_stub.fairness`), so a flood from any number of emitters delays another
emitter's small batch by at most the step already running.

Contract:
- `FairIngest(ingest)` (`ingest([batch], scope) -> Tally`, `scope` the poster's or None:
  `Coordinator.ingest`, one batch per step); `start()` runs its one scheduler thread, `close()`
  stops it (pending bodies fail with `IngestClosed`). `submit(body)` returns at once with
  a `concurrent.futures.Future` of the body's `Tally`, or of the `WireError` that rejects
  the body (nothing of it applied), or of whatever `ingest` raised.
- Work is cut into steps, each about one batch's work: scanning a body's outline (its
  batches as raw JSON, cheap: no objects built), validating one batch, applying one batch
  (`validation.py`). A step costs the bytes of JSON it works through (a scan an eighth
  of its body's), plus `STEP_BYTES`. Every emitter (the `instance_id` of a body's first
  batch) is a flow with its own FIFO of bodies, as is the queue of bodies not yet scanned.
- Scheduling: the scheduler runs the waiting flow with the lowest start tag (ties: the
  cheaper next step first, then arrival order). A turn is one step, or several while they
  add up to at most `TURN_BYTES` (a small body is scanned, validated and applied in one
  turn; a large batch's step is a turn of its own); the flow's next tag is its start tag
  plus what the turn cost. A flow that becomes active starts at the virtual clock, or at
  its previous finish tag less `TURN_BYTES` if that is later (the credit). A body leaves
  its queue before it is answered, so one its emitter sends on the answer (even before the
  turn ends) finds the flow idle.
- Guarantees, from the tags: (1) a newly active emitter whose next turn is cheaper than
  every backlogged flow's next step is served as soon as the step running ends, however
  many emitters flood; (2) backlogged emitters get equal bytes of work: over any interval
  in which two stay backlogged, their work differs by at most two turns. A body is queued
  with its emitter at once when its text begins `{"batches": [{"instance_id": "..."`
  (what LMCache's encoder and ours write); any other body is scanned first, in the flow
  of its own, and then queued with its emitter. (A body whose opening names one emitter
  and whose batches another can only misplace itself: batches are gated by their own ids.)
- All or nothing per body: every batch is validated (and checked against the poster's
  token scope) before the first is applied; a body that breaks the contract anywhere is
  rejected whole. Per emitter, bodies apply in the order they arrived, and a body's
  batches in their order.
- Memory: a decoded batch is about its JSON's size. Decoded batches are kept from
  validation to application only while the bodies keeping them total at most
  `keep_decoded_bytes`; a larger body is decoded again batch by batch when applied, so
  whatever the burst, at most a batch of decoded objects per busy emitter is alive.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Callable

import msgspec

from blend_wire import CacheEventBatch, WireError
from coordinator_stub.directory import Tally
from coordinator_stub.errors import Forbidden, ShuttingDown
from coordinator_stub.fairness import FairQueues
from coordinator_stub.scopes import Scope
from coordinator_stub.writes.validation import (decode_raw_batch, emitter_of, outline,
                                                peek_emitter, validated_batch)

log = logging.getLogger(__name__)


class IngestClosed(ShuttingDown):
    """The coordinator is shutting down; the body was not (fully) applied."""


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
                 "tally")

    def __init__(self, body: bytes, scope: Scope | None = None) -> None:
        self.body: bytes | None = body
        self.scope = scope
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.raws: list[msgspec.Raw] = []
        self.decoded: list[CacheEventBatch] = []
        self.kept = 0  # bytes counted against keep_decoded_bytes
        self.phase = _SCAN
        self.next = 0
        self.tally = Tally()


class FairIngest:
    """One scheduler thread running validation and application steps, fairly queued."""

    def __init__(self, ingest: Callable[[list[CacheEventBatch], Scope | None], Tally], *,
                 keep_decoded_bytes: int = 16 << 20) -> None:
        self._ingest = ingest
        self.keep_decoded_bytes = keep_decoded_bytes
        self._kept = 0
        self._cond = threading.Condition()
        # Flows: emitters, and None, the queue of bodies not scanned yet.
        self._flows = FairQueues(credit=TURN_BYTES)
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
            for job in self._flows.clear():
                _settle(job, IngestClosed("the coordinator is shutting down"))

    # --- submitting ------------------------------------------------------------------------

    def submit(self, body: bytes, scope: Scope | None = None) -> concurrent.futures.Future:
        """Queue a body; the future resolves to its `Tally` (or its error: a batch outside
        `scope`, the poster's token's, is `Forbidden`, found while validating)."""
        job = _Job(body, scope)
        with self._cond:
            if self._closed:
                _settle(job, IngestClosed("the coordinator is shutting down"))
                return job.future
            self._enqueue_locked(peek_emitter(body), job)
        return job.future

    @property
    def pending(self) -> int:
        """Bodies queued or in progress."""
        with self._cond:
            return self._flows.queued()

    def _enqueue_locked(self, flow: object, job: _Job) -> None:
        self._flows.append(flow, job, _cost(job), active=flow == self._running)
        self._cond.notify()

    # --- the scheduler -------------------------------------------------------------------------

    def _run(self) -> None:
        flows = self._flows
        while True:
            with self._cond:
                turn = flows.wait_for_turn(self._cond, lambda: self._closed)
                if turn is None:
                    return
                start, flow = turn
                self._running = flow
                queue = flows.queues[flow]
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
                    elif flow is None:  # scanned: now it queues behind its emitter's bodies
                        queue.popleft()
                        self._enqueue_locked(emitter_of(job.raws), job)
                    more = (queue and not self._closed
                            and spent + _cost(queue[0]) <= TURN_BYTES)
                    if not more:
                        self._end_turn_locked(flow, start + spent, drained)
                if outcome is not None:
                    # Answered once it has left its queue: a body its emitter sends on
                    # the answer finds the flow idle, and is tagged as newly active.
                    _settle(job, outcome)
                if not more:
                    break

    def _end_turn_locked(self, flow: object, finish: int, drained: bool) -> None:
        self._running = _NOBODY
        flows = self._flows
        queue = flows.queues[flow]
        if not queue:
            flows.went_idle(flow, finish)
            return
        # Bodies that came after the queue emptied: newly active, as if they had come
        # after the turn; otherwise backlogged, next at the turn's finish tag.
        flows.wait(flow, max(flows.clock, finish - TURN_BYTES) if drained else finish,
                   _cost(queue[0]))
        self._cond.notify()

    def _step(self, job: _Job) -> Tally | BaseException | None:
        """One step of `job`: None, or when the body is done, what answers it (its tally,
        or the error that rejects it), to be settled once it has left its queue."""
        if job.phase == _SCAN:
            try:
                job.raws = outline(job.body)
            except WireError as exc:
                return exc
            keep = len(job.body) <= self.keep_decoded_bytes
            with self._cond:
                if keep and self._kept + len(job.body) <= self.keep_decoded_bytes:
                    job.kept = len(job.body)
                    self._kept += job.kept
            job.phase = _VALIDATE
            return job.tally if not job.raws else None
        if job.phase == _VALIDATE:
            try:
                batch = validated_batch(job.body, job.raws, job.next, job.scope)
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
        batch = job.decoded[i] if job.kept else decode_raw_batch(job.raws[i], i)
        if job.kept:
            job.decoded[i] = None  # its objects go as soon as it is applied
        job.tally.add(self._ingest([batch], job.scope))
        job.next += 1
        return job.tally if job.next == len(job.raws) else None


def _cost(job: _Job) -> int:
    """What the job's next step costs: the bytes of JSON it works through, plus the
    fixed `STEP_BYTES`."""
    if job.phase == _SCAN:
        return STEP_BYTES + len(job.body) // _SCAN_DISCOUNT
    return STEP_BYTES + (len(job.raws[job.next]) if job.next < len(job.raws) else 0)


def _settle(job: _Job, outcome: Tally | BaseException) -> None:
    """Answer the body; what it held goes first (then its bytes' last user is done)."""
    job.raws, job.decoded, job.body = [], [], None
    if job.future.done():
        return
    if isinstance(outcome, BaseException):
        job.future.set_exception(outcome)
    else:
        job.future.set_result(outcome)


__all__ = ["FairIngest", "IngestClosed", "STEP_BYTES", "TURN_BYTES"]
