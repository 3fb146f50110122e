"""Giving the C heap's free memory back to the OS after a burst (docs/DESIGN.md,
"Coordinator"): glibc keeps freed blocks (request bodies, applied log records) in its heap
for reuse, so without this a burst's peak could stay in the RSS for good. Both write paths
use it once a burst is over: the HTTP layer after request bodies
(`coordinator_stub.http.budget`), a replica after the log records it applied
(`coordinator_stub.writes.replicated`); and the process once at start-up.
"""

from __future__ import annotations

import asyncio
import ctypes
from typing import Callable

#: Bytes (request bodies, log records) that come and go before an idle coordinator gives
#: memory back, and how long after the last it looks (a burst's last ones are freed).
#: Small enough for a small store (MuSiQue B's 150 prompts post 4.3 MiB of events at chunk
#: 256: its RSS growth was 14.8 B per stored token, where the directory holds 4.9); a trim
#: costs ~1 ms on a heap of hundreds of MiB: at most one per MiB of ingest (~10 ms of its
#: CPU) and per `TRIM_DELAY_S`.
TRIM_AFTER_BYTES = 1 << 20
TRIM_DELAY_S = 0.05


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's, in this process
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def give_back_memory() -> None:
    """Hand the C heap's free pages back to the OS. glibc keeps freed blocks of up to
    32 MiB (request bodies) in its heap for reuse, so without this a burst's peak could
    stay in the RSS for good. `malloc_trim(0)` (about a millisecond on a heap of hundreds
    of MiB; run it off the event loop); nothing without glibc."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class AfterBurst:
    """Gives memory back once `TRIM_AFTER_BYTES` came and went and nothing more came for
    `TRIM_DELAY_S` (`came(loop, size)` per arrival, all on the event loop; `count`: how
    many times). For a path with nothing in flight to wait for (a replica applying log
    records); the HTTP layer waits for its bodies instead (`http.budget`)."""

    def __init__(self) -> None:
        self.count = 0
        self._bytes = 0
        self._timer: asyncio.TimerHandle | None = None

    def came(self, loop: asyncio.AbstractEventLoop, size: int) -> None:
        self._bytes += size
        if self._bytes < TRIM_AFTER_BYTES:
            return
        self.cancel()
        self._timer = loop.call_later(TRIM_DELAY_S, self._give_back, loop)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _give_back(self, loop: asyncio.AbstractEventLoop) -> None:
        self._bytes, self._timer = 0, None
        self.count += 1
        loop.run_in_executor(None, give_back_memory)
