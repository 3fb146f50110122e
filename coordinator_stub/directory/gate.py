"""The ingest gate: which event batches may be applied, per emitting instance, and what
each emitter's stream has lost.

Contract (DESIGN.md, "Coordinator"; WIRE.md, "POST /events"; LMCache 0.5.7's
`EventGate`):
- One cursor per `instance_id`: `(incarnation, last_seq)` of the last batch admitted.
- A batch with a lower incarnation than the cursor is STALE; one with the same
  incarnation and `seq <= last_seq` is a DUPLICATE. Both are dropped (the caller counts
  them); the cursor does not move.
- A batch with a higher incarnation is FENCE: the caller must first drop every placement
  the instance reported before, then apply the batch. The cursor moves to it.
- Otherwise (first batch of an instance, or a higher `seq`) it is APPLY and the cursor
  moves. Gaps in `seq` are accepted: events are best-effort and a lost batch must not
  block the ones after it.
- Departed instances (LMCache 0.5.7): after `depart(id)` (deregistered or reaped: its L1
  was fenced) the instance's L1 batches of the same or an older incarnation are STALE
  until it registers again (`readmit`) or a higher incarnation arrives (a restart, which
  fences as usual); its L2 batches are applied (shared storage does not go away with
  it). So deltas from a server the coordinator gave up on are not laid on a fenced
  slice. At most `MAX_DEPARTED` departures are remembered (the oldest is forgotten: its
  next batch is then a first one, as in LMCache 0.5.6).
- Loss accounting (LMCache 0.5.7), per cursor, for the emitter's current incarnation:
  `missing_batches` (skipped `seq` values, counted only in a stream the gate was already
  tracking), `events_dropped` (the rises of the batches' cumulative `dropped_events`; the
  first report of a stream joined midway is only remembered), `gap_detected` (set by
  either, cleared only by a new stream), the time of the last admitted batch and the
  delivery delay of the last one carrying `ts` (its send time to admission, across the
  two hosts' clocks). Totals (`batches_missing`, `events_dropped`) never reset.

- Idleness, for releasing cursors nobody needs (`KeyDirectory.release_ghosts`): the
  reaper's sweeps ask `idle_for(id, now)`; any batch of the id resets it; `forget` drops
  a ghost's cursor (not a departure: it never registered, nothing is refused).

Not thread-safe: the key directory consults it under its own lock, so admitting a batch
and applying it are one atomic step. `snapshot()`/`restore()` put a cursor (and the
totals, and a departure) back exactly when a batch is rolled back. Reads for stats and
metrics (`streams`, `totals`) copy first, so they may run without that lock.
"""

from __future__ import annotations

import collections
import copy
import enum
import logging
import time

log = logging.getLogger(__name__)

#: Departed instances remembered (their L1 batches refused until they register again).
MAX_DEPARTED = 4096


class Verdict(enum.Enum):
    APPLY = "apply"
    FENCE = "fence"  # fence the instance's earlier placements, then apply
    DUPLICATE = "duplicate"
    STALE = "stale"


class _Cursor:
    __slots__ = ("incarnation", "last_seq", "gap_detected", "last_dropped",
                 "missing_batches", "events_dropped", "last_admitted", "admitted_at",
                 "delivery_delay")

    def __init__(self, incarnation: int, last_dropped: int | None) -> None:
        self.incarnation = incarnation
        self.last_seq = 0
        self.gap_detected = False
        self.last_dropped = last_dropped  # None: not known yet (a stream joined midway)
        self.missing_batches = 0
        self.events_dropped = 0
        self.last_admitted = time.monotonic()
        self.admitted_at = time.time()
        self.delivery_delay: float | None = None


_NOT_DEPARTED = object()


class IngestGate:
    def __init__(self) -> None:
        self._cursors: dict[str, _Cursor] = {}
        self._departed: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.batches_missing = 0
        self.events_dropped = 0
        # Ids the reaper found idle (`idle_for`), and since when; any batch clears it.
        self._idle: dict[str, float] = {}

    def admit(self, instance_id: str, incarnation: int, seq: int, *, tier: str = "l1",
              dropped_events: int = 0, ts: float = 0.0) -> Verdict:
        """Decide a batch's fate and advance the cursor when it is to be applied."""
        if self._idle:
            self._idle.pop(instance_id, None)
        departed = self._departed.get(instance_id)
        if departed is not None:
            if incarnation > departed:
                del self._departed[instance_id]
            elif tier == "l1":
                return Verdict.STALE
        cursor = self._cursors.get(instance_id)
        tracked = cursor is not None
        verdict = Verdict.APPLY
        if cursor is not None:
            if incarnation < cursor.incarnation:
                return Verdict.STALE
            if incarnation > cursor.incarnation:
                # A new stream: it moves to the end, as LMCache's re-created cursor does.
                del self._cursors[instance_id]
                cursor, verdict = None, Verdict.FENCE
            elif seq <= cursor.last_seq:
                return Verdict.DUPLICATE
        if cursor is None:
            # A new incarnation, or a stream seen from its first batch, has dropped nothing
            # yet; one joined midway has an unknown history.
            cursor = self._cursors[instance_id] = _Cursor(
                incarnation, 0 if tracked or seq == 1 else None)
        skipped = seq - cursor.last_seq - 1
        if skipped > 0:
            self._mark_gap(instance_id, cursor, f"seq jumped {cursor.last_seq} -> {seq}")
            if tracked:
                cursor.missing_batches += skipped
                self.batches_missing += skipped
        if cursor.last_dropped is not None and dropped_events > cursor.last_dropped:
            dropped = dropped_events - cursor.last_dropped
            self._mark_gap(instance_id, cursor, f"emitter reported {dropped} dropped events")
            cursor.events_dropped += dropped
            self.events_dropped += dropped
        cursor.last_dropped = dropped_events
        cursor.last_seq = seq
        cursor.last_admitted = time.monotonic()
        cursor.admitted_at = time.time()
        if ts > 0:
            cursor.delivery_delay = cursor.admitted_at - ts
        return verdict

    @staticmethod
    def _mark_gap(instance_id: str, cursor: _Cursor, reason: str) -> None:
        if not cursor.gap_detected:
            cursor.gap_detected = True
            log.warning("event loss for instance %s (incarnation %d): %s; its slice of the "
                        "directory is incomplete until it restarts or leaves", instance_id,
                        cursor.incarnation, reason)

    def depart(self, instance_id: str) -> None:
        """The instance left (its L1 is fenced): drop its cursor and refuse its L1 batches
        of this incarnation until `readmit` (module doc, "Departed instances")."""
        cursor = self._cursors.pop(instance_id, None)
        self._idle.pop(instance_id, None)
        if cursor is None:
            return
        self._departed.pop(instance_id, None)
        self._departed[instance_id] = cursor.incarnation
        while len(self._departed) > MAX_DEPARTED:
            self._departed.popitem(last=False)

    def readmit(self, instance_id: str) -> None:
        """The instance registered again: take its L1 batches again."""
        self._departed.pop(instance_id, None)

    def forget(self, instance_id: str) -> None:
        """Drop the cursor of an id that holds nothing and is not registered (a ghost,
        `KeyDirectory.release_ghosts`): its next batch is a first one, refused nothing."""
        self._cursors.pop(instance_id, None)
        self._idle.pop(instance_id, None)

    def idle_for(self, instance_id: str, now: float) -> float:
        """How long the instance has sent no batch, as far as the reaper's sweeps (`now`
        each) can tell: 0 at the first sweep that asks, then the time since it."""
        return now - self._idle.setdefault(instance_id, now)

    def not_idle(self, instance_id: str) -> None:
        """The reaper keeps this id whatever its batches (registered, or holding data)."""
        self._idle.pop(instance_id, None)

    def instances(self) -> list[str]:
        """Instances with a cursor, in the order their current stream began."""
        return list(self._cursors)

    def __len__(self) -> int:
        return len(self._cursors)

    def departed(self) -> int:
        """How many departed instances are remembered."""
        return len(self._departed)

    def position(self, instance_id: str) -> tuple[int, int] | None:
        """The instance's cursor `(incarnation, last_seq)`, or None."""
        cursor = self._cursors.get(instance_id)
        return None if cursor is None else (cursor.incarnation, cursor.last_seq)

    def snapshot(self, instance_id: str) -> tuple:
        """What `admit` may change for this instance, to `restore` it after a rollback."""
        cursor = self._cursors.get(instance_id)
        return (copy.copy(cursor), self._departed.get(instance_id, _NOT_DEPARTED),
                self.batches_missing, self.events_dropped)

    def restore(self, instance_id: str, snapshot: tuple) -> None:
        """Put everything back where `snapshot()` found it (a batch was rolled back)."""
        cursor, departed, self.batches_missing, self.events_dropped = snapshot
        if cursor is None:
            self._cursors.pop(instance_id, None)
        else:
            self._cursors[instance_id] = cursor
        if departed is not _NOT_DEPARTED and instance_id not in self._departed:
            self._departed[instance_id] = departed

    def totals(self) -> dict[str, int]:
        return {"batches_missing": self.batches_missing, "events_dropped": self.events_dropped}

    def streams(self, *, ages: bool = False) -> dict[str, dict]:
        """Every tracked emitter's figures (LMCache 0.5.7's `InstanceStreamStats`). The
        time of its last admitted batch is `last_event_time` (epoch seconds), or with
        `ages` (metrics) `seconds_since_last_event` as LMCache reports it."""
        now = time.monotonic()
        return {instance_id: {
            "incarnation": cursor.incarnation,
            "last_seq": cursor.last_seq,
            "gap_detected": cursor.gap_detected,
            "missing_batches": cursor.missing_batches,
            "events_dropped": cursor.events_dropped,
            **({"seconds_since_last_event": max(0.0, now - cursor.last_admitted)} if ages
               else {"last_event_time": cursor.admitted_at}),
            "event_delivery_delay_seconds": cursor.delivery_delay,
        } for instance_id, cursor in list(self._cursors.items())}
