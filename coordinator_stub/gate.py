"""The ingest gate: which event batches may be applied, per emitting instance.

Contract (DESIGN.md, "Coordinator"; WIRE.md, `CacheEventBatch`):
- One cursor per `instance_id`: `(incarnation, last_seq)` of the last batch admitted.
- A batch with a lower incarnation than the cursor is STALE; one with the same
  incarnation and `seq <= last_seq` is a DUPLICATE. Both are dropped (the caller counts
  them); the cursor does not move.
- A batch with a higher incarnation is FENCE: the caller must first drop every placement
  the instance reported before, then apply the batch. The cursor moves to it.
- Otherwise (first batch of an instance, or a higher `seq`) it is APPLY and the cursor
  moves. Gaps in `seq` are accepted: events are best-effort and a lost batch must not
  block the ones after it.

Not thread-safe: the key directory consults it under its own lock, so admitting a batch
and applying it are one atomic step.
"""

from __future__ import annotations

import enum


class Verdict(enum.Enum):
    APPLY = "apply"
    FENCE = "fence"  # fence the instance's earlier placements, then apply
    DUPLICATE = "duplicate"
    STALE = "stale"


class _Cursor:
    __slots__ = ("incarnation", "last_seq")

    def __init__(self, incarnation: int, last_seq: int) -> None:
        self.incarnation = incarnation
        self.last_seq = last_seq


class IngestGate:
    def __init__(self) -> None:
        self._cursors: dict[str, _Cursor] = {}

    def admit(self, instance_id: str, incarnation: int, seq: int) -> Verdict:
        """Decide a batch's fate and advance the cursor when it is to be applied."""
        cursor = self._cursors.get(instance_id)
        if cursor is None:
            # Nothing of this instance is known, so there is nothing to fence either.
            self._cursors[instance_id] = _Cursor(incarnation, seq)
            return Verdict.APPLY
        if incarnation < cursor.incarnation:
            return Verdict.STALE
        if incarnation > cursor.incarnation:
            # A new stream: it moves to the end, as LMCache's re-created cursor does.
            del self._cursors[instance_id]
            self._cursors[instance_id] = _Cursor(incarnation, seq)
            return Verdict.FENCE
        if seq <= cursor.last_seq:
            return Verdict.DUPLICATE
        cursor.last_seq = seq
        return Verdict.APPLY

    def forget(self, instance_id: str) -> None:
        """Drop the instance's cursor: its next batch is its first (nothing to fence)."""
        self._cursors.pop(instance_id, None)

    def instances(self) -> list[str]:
        """Instances with a cursor, in the order their current stream began."""
        return list(self._cursors)

    def __len__(self) -> int:
        return len(self._cursors)

    def position(self, instance_id: str) -> tuple[int, int] | None:
        """The instance's cursor `(incarnation, last_seq)`, or None: to restore it later."""
        cursor = self._cursors.get(instance_id)
        return None if cursor is None else (cursor.incarnation, cursor.last_seq)

    def restore(self, instance_id: str, position: tuple[int, int] | None) -> None:
        """Put the cursor back where `position()` found it (a batch was rolled back)."""
        if position is None:
            self._cursors.pop(instance_id, None)
        else:
            self._cursors[instance_id] = _Cursor(*position)
