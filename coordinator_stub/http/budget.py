"""Request bytes in flight, bounded, for both write paths: the HTTP layer reserves a body's
bytes before reading it and answers 503 + Retry-After when it cannot (docs/DESIGN.md,
"Coordinator"). Bodies up to `small_body_bytes` draw on a reserve of their own, so large
bodies cannot crowd out ordinary batches. When a burst is over (nothing in flight
`TRIM_DELAY_S` after `TRIM_AFTER_BYTES` came and went), the HTTP layer calls
`coordinator_stub.memory.give_back_memory`, so the burst's peak does not stay in the RSS.
"""

from __future__ import annotations

from typing import Callable

from coordinator_stub.memory import TRIM_AFTER_BYTES


class ByteBudget:
    """Request bytes in flight, bounded. Used from the event loop only (no lock).

    `try_reserve(size)` returns a release callable, or None when `size` does not fit.
    `burst_over()` is True while nothing is in flight after at least `TRIM_AFTER_BYTES`
    came and went since the last `trimmed()`: the moment to `give_back_memory`.
    """

    def __init__(self, limit: int, *, small_body_bytes: int = 1 << 20,
                 small_reserve: int = 32 << 20) -> None:
        self.limit = limit
        self.small_body_bytes = small_body_bytes
        self.small_reserve = small_reserve
        self.in_flight = 0
        self.small_in_flight = 0
        self.refused = 0
        self._released = 0  # bytes released since the last trimmed()

    def try_reserve(self, size: int) -> Callable[[], None] | None:
        if self.in_flight + size <= self.limit:
            self.in_flight += size
            return lambda: self._release(size, small=False)
        if size <= self.small_body_bytes and self.small_in_flight + size <= self.small_reserve:
            self.small_in_flight += size
            return lambda: self._release(size, small=True)
        self.refused += 1
        return None

    def burst_over(self) -> bool:
        return (not self.in_flight and not self.small_in_flight
                and self._released >= TRIM_AFTER_BYTES)

    def trimmed(self) -> None:
        """Memory was given back: the next burst counts from here."""
        self._released = 0

    def _release(self, size: int, *, small: bool) -> None:
        self._released += size
        if small:
            self.small_in_flight -= size
        else:
            self.in_flight -= size
