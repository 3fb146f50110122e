"""Asyncio helpers of the coordinator process (no third-party imports).

`cancel_until_done(task)`: cancel a task and wait until it has ended, cancelling again
while it has not. A library awaited inside it may swallow one cancellation: nats-py's
connect loop retries on any Exception, and on Python 3.11 a cancellation that meets a
failed connection attempt inside its own `asyncio.wait_for` is lost, so a coordinator
told to stop while it waited for its event log did not stop.
"""

from __future__ import annotations

import asyncio


async def cancel_until_done(task: asyncio.Future, every: float = 0.1) -> None:
    """Cancel `task`, again every `every` s until it has ended; its outcome is dropped."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=every)
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" warning


__all__ = ["cancel_until_done"]
