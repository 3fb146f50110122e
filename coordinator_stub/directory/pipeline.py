"""Ingest's last stage: validated batches, in order, through the gate, then to the consumers
(docs/DESIGN.md, "Coordinator ingest"). Both write paths end here: one process's fair
ingest scheduler (`coordinator_stub.writes.fair_ingest`) and a replica's event log
(`coordinator_stub.writes.records`), each through `Coordinator.ingest`.

The gate (`gate.IngestGate`) decides each batch's fate per emitter stream: `APPLY`,
`FENCE` (a new incarnation: what the instance reported before goes first), `DUPLICATE` or
`STALE` (counted, nothing applied). A `Consumer` takes what the gate admits:
`consume(batch)` applies one batch, `fence(instance_id, departed)` drops what an instance
reported (`departed`: it left, so its L1, that process's memory, goes; otherwise a new
incarnation: all of it). The consumers are the bindings (placements and contents; they
stage the blend index's updates in its one writer) and the capacity table (`config`
batches). An admitted batch applies all or nothing: `atomic` (the directory's undo
journal) rolls every consumer back, and the gate's cursor with it, when one raises, and
flushes the index writer when the batch commits.

Not thread-safe: the directory calls it under its lock.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable, Protocol, Sequence

from blend_wire import CacheEventBatch, EventsReply
from coordinator_stub.directory.gate import IngestGate, Verdict
from coordinator_stub.directory.journal import JournaledDict


class Consumer(Protocol):
    def consume(self, batch: CacheEventBatch) -> None:
        """Apply one admitted batch (undone by the journal if any consumer raises)."""

    def fence(self, instance_id: str, departed: bool) -> None:
        """Drop what the instance reported: its L1 if it `departed`, else everything."""


class Tally:
    """Batches counted by verdict: what an `/events` reply says."""

    __slots__ = ("applied", "duplicates", "stale")

    def __init__(self) -> None:
        self.applied = self.duplicates = self.stale = 0

    def count(self, verdict: Verdict) -> None:
        if verdict is Verdict.DUPLICATE:
            self.duplicates += 1
        elif verdict is Verdict.STALE:
            self.stale += 1
        else:
            self.applied += 1

    def add(self, other: "Tally") -> None:
        self.applied += other.applied
        self.duplicates += other.duplicates
        self.stale += other.stale

    def __eq__(self, other: object) -> bool:
        return type(other) is Tally and (self.applied, self.duplicates, self.stale) == (
            other.applied, other.duplicates, other.stale)

    __hash__ = None  # counts change

    def __repr__(self) -> str:
        return (f"Tally(applied={self.applied}, duplicates={self.duplicates}, "
                f"stale={self.stale})")

    def reply(self) -> EventsReply:
        return EventsReply(applied=self.applied, duplicates=self.duplicates,
                           stale=self.stale)


class Capacity(JournaledDict):
    """What each place declared it can hold (`config` batches): `{(instance_id, tier,
    backend): (capacity_bytes, capacity_revision)}`. A departed instance declares it
    again when it returns."""

    __slots__ = ()

    def consume(self, batch: CacheEventBatch) -> None:
        if batch.event_type == "config":
            self[batch.instance_id, batch.tier, batch.backend] = (batch.capacity_bytes,
                                                                   batch.capacity_revision)

    def fence(self, instance_id: str, departed: bool) -> None:
        if departed:
            self.forget(lambda place: place[0] == instance_id)

    def forget(self, gone: Callable[[tuple], bool]) -> None:
        for place in [p for p in self if gone(p)]:
            del self[place]

    def __reduce__(self):
        return Capacity, (self.journal, dict(self))


class IngestPipeline:
    """The gate, then the consumers, per batch (module doc)."""

    def __init__(self, gate: IngestGate, consumers: Sequence[Consumer],
                 atomic: Callable[[CacheEventBatch, tuple], AbstractContextManager],
                 settle: Callable[[], None], counters: dict[str, int]) -> None:
        self.gate = gate
        self.consumers = consumers
        self._atomic = atomic  # (batch, the gate's position before it) -> all or nothing
        self._settle = settle  # after a departure: the index writer flushed, ids freed
        self._counters = counters

    def ingest(self, batches: list[CacheEventBatch]) -> Tally:
        """Each batch, in order: gated, then applied by every consumer, all or nothing."""
        tally = Tally()
        counters = self._counters
        for batch in batches:
            verdict = self._one(batch)
            tally.count(verdict)
            entries = "entries_duplicate" if verdict is Verdict.DUPLICATE else (
                "entries_stale" if verdict is Verdict.STALE else "entries_applied")
            counters[entries] += len(batch.entries)
        counters["batches_applied"] += tally.applied
        counters["batches_duplicate"] += tally.duplicates
        counters["batches_stale"] += tally.stale
        return tally

    def _one(self, batch: CacheEventBatch) -> Verdict:
        gate, instance_id = self.gate, batch.instance_id
        position = gate.snapshot(instance_id)
        verdict = gate.admit(instance_id, batch.incarnation, batch.seq, tier=batch.tier,
                             dropped_events=batch.dropped_events, ts=batch.ts)
        if verdict is Verdict.DUPLICATE or verdict is Verdict.STALE:
            return verdict
        with self._atomic(batch, position):
            if verdict is Verdict.FENCE:
                for consumer in self.consumers:
                    consumer.fence(instance_id, False)
            for consumer in self.consumers:
                consumer.consume(batch)
        return verdict

    def depart(self, instance_id: str) -> None:
        """The instance left: every consumer fences its L1, and the gate refuses its L1
        batches of this incarnation until it registers again (`IngestGate.depart`)."""
        self._counters["instances_dropped"] += 1
        try:
            for consumer in self.consumers:
                consumer.fence(instance_id, True)
        finally:
            self.gate.depart(instance_id)
            self._settle()


__all__ = ["Capacity", "Consumer", "IngestPipeline", "Tally"]
