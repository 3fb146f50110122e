"""Who a replica hears from: its half of the reaping rule, and the heartbeats it logs
(docs/DESIGN.md, "Coordinator replicas").

Contract:
- `heard(id)` when this replica hears of an instance (a heartbeat taken here, a register or
  beats record applied here), by its own monotonic clock (`clock`); `silent(ids,
  timeout)`: those of `ids` not heard of for over `timeout` s. An id never heard of counts
  as heard when `silent` first looked, so a restarted replica proposes nobody for a
  timeout.
- `beat(id)`: a heartbeat taken here. It is queued for the next `beats` record only when
  this replica has not queued one for that id within `refresh_s` (a third of the instance
  timeout); `flush(append)` hands the queued ids to `append` (which raises
  `ServiceUnavailable` to keep them for the next flush), every `flush_s`.
Runs on the event loop (`heard` also on the apply thread: a dict store).
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable


class Liveness:
    def __init__(self, instance_timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.refresh_s = instance_timeout / 3
        self.flush_s = min(1.0, instance_timeout / 10)
        self._heard: dict[str, float] = {}
        self._first_look: float | None = None
        self._beats: set[str] = set()  # heard here, waiting for the next `beats` record
        self._queued: dict[str, float] = {}  # when a beat was last queued per id
        self._lock = asyncio.Lock()

    def heard(self, instance_id: str, now: float | None = None) -> None:
        self._heard[instance_id] = self.clock() if now is None else now

    def forget(self, instance_id: str) -> None:
        self._heard.pop(instance_id, None)

    def silent(self, instance_ids: list[str], timeout: float) -> list[str]:
        """Those of `instance_ids` not heard of for over `timeout` s by `clock` (a wall
        clock step, here or on the log's host, moves nothing)."""
        now = self.clock()
        if self._first_look is None:
            self._first_look = now
        return [instance_id for instance_id in instance_ids
                if now - self._heard.get(instance_id, self._first_look) > timeout]

    def beat(self, instance_id: str) -> None:
        """A heartbeat taken here: heard, and queued for the log when one is due."""
        self.heard(instance_id)
        now = time.monotonic()
        if now - self._queued.get(instance_id, -self.refresh_s) >= self.refresh_s:
            self._queued[instance_id] = now
            self._beats.add(instance_id)

    def registered(self, instance_id: str) -> None:
        """A registration taken here counts as a logged heartbeat."""
        self._queued[instance_id] = time.monotonic()

    async def flush(self, append: Callable[[list[str]], Awaitable[None]]) -> None:
        """Hand the queued beats to `append`; they stay queued if it raises."""
        async with self._lock:
            if not self._beats:
                return
            heard = sorted(self._beats)
            await append(heard)
            self._beats.difference_update(heard)

    def prune(self) -> None:
        """Forget when beats were queued for ids whose refresh is past."""
        horizon = time.monotonic() - self.refresh_s
        self._queued = {i: t for i, t in self._queued.items() if t > horizon}
