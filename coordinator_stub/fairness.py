"""Start-time fair queuing (SFQ), the one discipline behind the ingest scheduler
(`coordinator_stub.writes.fair_ingest`, charged in bytes of JSON) and the match workers
(`coordinator_stub.service.matchpool`, charged in microseconds of CPU); docs/DESIGN.md,
"Coordinator".

Every flow (an emitter, a reader) has its own FIFO. A flow with work waits with a start
tag in virtual units; the next turn goes to the lowest tag (ties: the smaller `tie`, then
arrival), and the virtual clock becomes that tag. The owner charges a turn when it ends:
a flow still backlogged waits again at its finish tag (start + what the turn cost); one
that became active (its queue was empty) starts at the clock, or at its previous finish
less `credit` if that is later, so a flow that ran ahead of the others keeps its place
and one that did not (a light emitter, however often it posts) goes first. State is per
flow with work queued, plus the finish tags of idle flows still ahead of the clock
(forgotten once it passes them, and all of them whenever nothing is queued; at most about
as many as flows queued, the furthest ahead kept, however many flows come and go).

Not thread-safe: the owner calls it under its own lock, and decides which flows are in a
turn now (`active`), which never wait in the heap meanwhile.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import threading
from typing import Any, Callable, Hashable


class FairQueues:
    """The flows' FIFOs, the heap of waiting flows and the virtual clock."""

    def __init__(self, credit: int = 0) -> None:
        #: A flow's FIFO, while it has work queued (a flow in its turn included).
        self.queues: dict[Hashable, collections.deque] = {}
        self._waiting: list[tuple[int, int, int, Hashable]] = []
        self._arrivals = itertools.count()
        self.clock = 0
        self._finish: dict[Hashable, int] = {}  # idle flows' finish tags ahead of the clock
        self._credit = credit

    def append(self, flow: Hashable, item: Any, tie: int, *, active: bool = False) -> None:
        """Queue `item` in `flow`'s FIFO; a flow that was idle, and is not `active` (in a
        turn now: it waits again when the turn ends), starts waiting (module doc)."""
        queue = self.queues.get(flow)
        if queue is None:
            queue = self.queues[flow] = collections.deque()
        queue.append(item)
        if len(queue) == 1 and not active:
            self.wait(flow, self.newly_active_start(flow), tie)

    def newly_active_start(self, flow: Hashable) -> int:
        """The start tag of a flow whose queue was empty: the clock, or its last finish
        less the credit, whichever is later."""
        return max(self.clock, self._finish.pop(flow, 0) - self._credit)

    def wait(self, flow: Hashable, start: int, tie: int) -> None:
        """`flow` (with work queued) waits for a turn from `start`."""
        heapq.heappush(self._waiting, (start, tie, next(self._arrivals), flow))

    def wait_for_turn(self, cond: threading.Condition, closed: Callable[[], bool]
                      ) -> tuple[int, Hashable] | None:
        """With `cond` (the owner's lock) held: wait until some flow waits for a turn, then
        `next_turn()`; None once `closed()`."""
        while not self._waiting and not closed():
            cond.wait()
        return None if closed() else self.next_turn()

    def next_turn(self) -> tuple[int, Hashable]:
        """The waiting flow with the lowest tag, taken out of the heap: `(start, flow)`.
        The clock moves up to its start (never back)."""
        start, _, _, flow = heapq.heappop(self._waiting)
        self.clock = max(self.clock, start)
        return start, flow

    def went_idle(self, flow: Hashable, finish: int) -> None:
        """`flow`'s queue is empty after a turn that finished at `finish`."""
        del self.queues[flow]
        if not self.queues:  # nothing queued anywhere: no one to be fair to
            self._finish.clear()
            return
        self._finish[flow] = finish
        if len(self._finish) > 2 * len(self.queues) + 64:  # forget tags the clock passed
            self._finish = {f: t for f, t in self._finish.items()
                            if t - self._credit > self.clock}
            keep = len(self.queues) + 32
            if len(self._finish) > keep:
                # Many flows served once while the clock stood still (each new flow starts
                # at it): keep the tags furthest ahead. Forgetting the others lets those
                # flows start at the clock again, the least head start there is to give.
                self._finish = dict(heapq.nlargest(keep, self._finish.items(),
                                                   key=lambda item: item[1]))

    def clear(self) -> list:
        """Forget every flow; what was queued, to be failed by the owner."""
        items = [item for queue in self.queues.values() for item in queue]
        self.queues.clear()
        self._waiting.clear()
        self._finish.clear()
        return items

    @property
    def waiting(self) -> bool:
        """Some flow waits for a turn."""
        return bool(self._waiting)

    def queued(self) -> int:
        """Items queued in every FIFO."""
        return sum(len(queue) for queue in self.queues.values())


__all__ = ["FairQueues"]
