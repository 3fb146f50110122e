"""The match workers, shared fairly between readers: start-time fair queuing by the CPU each
lookup took (docs/DESIGN.md, "Coordinator").

The rest of its contract: docs/CONTRACTS.md, `coordinator_stub.service.matchpool`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import heapq
import itertools
import threading
import time
from typing import Any, Callable, Hashable

from coordinator_stub.errors import ShuttingDown

#: The least a lookup is charged, in microseconds of CPU, so that no lookup is free.
MIN_CHARGE_US = 50


class PoolClosed(ShuttingDown):
    """The coordinator is shutting down; the lookup did not run (503, `Retry-After`)."""


class ClientGone(RuntimeError):
    """The lookup's client went away before a worker reached it; it did not run."""


class FairPool:
    def __init__(self, workers: int, name: str = "match") -> None:
        self._cond = threading.Condition()
        self._queues: dict[Hashable, collections.deque] = {}
        self._waiting: list[tuple[int, int, int, Hashable]] = []
        self._arrivals = itertools.count()
        self._clock = 0
        self._finish: dict[Hashable, int] = {}
        self._running: set[Hashable] = set()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, flow: Hashable, size: int, fn: Callable[..., Any], *args
               ) -> concurrent.futures.Future:
        """Run `fn(*args)` in `flow`'s turn. `size` (the body's bytes) only orders flows
        whose turns tie; the flow is charged by the CPU the job takes."""
        return self._queue(concurrent.futures.Future(), flow, size, fn, args)

    def submit_async(self, flow: Hashable, size: int, fn: Callable[..., Any], *args,
                     wanted: Callable[[], bool] | None = None) -> asyncio.Future:
        """As `submit`, from a running event loop: await the future it returns there.
        `wanted`: asked by the worker that reaches the job; False (its client left) drops
        it unrun, the future failing with `ClientGone`."""
        if wanted is not None:
            fn, args = _run_if_wanted, (wanted, fn, *args)
        return self._queue(asyncio.get_running_loop().create_future(), flow, size, fn, args)

    def _queue(self, future, flow: Hashable, size: int, fn: Callable[..., Any], args: tuple):
        size = max(0, int(size))
        with self._cond:
            if self._closed:
                future.set_exception(PoolClosed("the coordinator is shutting down"))
                return future
            queue = self._queues.get(flow)
            if queue is None:
                queue = self._queues[flow] = collections.deque()
            queue.append((size, fn, args, future))
            if len(queue) == 1 and flow not in self._running:  # newly active
                self._wait_locked(flow, max(self._clock, self._finish.pop(flow, 0)))
        return future

    def _wait_locked(self, flow: Hashable, start: int) -> None:
        heapq.heappush(self._waiting, (start, self._queues[flow][0][0], next(self._arrivals),
                                       flow))
        self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                start, _, _, flow = heapq.heappop(self._waiting)
                self._clock = max(self._clock, start)
                _, fn, args, future = self._queues[flow].popleft()
                self._running.add(flow)
            # Charged by the work done, known only now: the thread's CPU (numba's kernels
            # run on it, without the GIL, and count), not the body, which says little of it.
            used = time.thread_time_ns()
            _run_job(future, fn, args)
            used = time.thread_time_ns() - used
            del fn, args, future  # nothing of a finished lookup stays with the thread
            with self._cond:
                self._running.discard(flow)
                if self._closed:  # shutdown() settled what was queued
                    return
                finish = start + max(MIN_CHARGE_US, used // 1000)
                if self._queues[flow]:
                    self._wait_locked(flow, finish)  # backlogged: next at its finish tag
                    continue
                del self._queues[flow]
                if not self._queues:  # nothing queued anywhere: no one to be fair to
                    self._finish.clear()
                    continue
                self._finish[flow] = finish
                if len(self._finish) > 2 * len(self._queues) + 64:  # forget passed tags
                    self._finish = {f: t for f, t in self._finish.items() if t > self._clock}

    def shutdown(self, wait: bool = True, cancel_futures: bool = True) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            pending = [job for queue in self._queues.values() for job in queue]
            self._queues.clear()
            self._waiting.clear()
        for _, _, _, future in pending:
            if type(future) is concurrent.futures.Future:
                _close(future, cancel_futures)
            else:  # an asyncio future: settled on its own loop's thread
                _on_loop_of(future, _close, future, cancel_futures)
        if wait:
            for thread in self._threads:
                thread.join()

    @property
    def idle(self) -> bool:
        """Nothing running or queued. Read without the lock: an answer a moment stale only
        decides where one small lookup runs (the HTTP layer's inline matching)."""
        return not self._running and not self._waiting

    @property
    def pending(self) -> int:
        """Lookups queued, not yet started."""
        with self._cond:
            return sum(len(queue) for queue in self._queues.values())


def _run_job(future, fn: Callable[..., Any], args: tuple) -> None:
    """Run one job on a worker thread and settle its future (concurrent or asyncio)."""
    if type(future) is concurrent.futures.Future:
        if future.set_running_or_notify_cancel():
            try:
                result = fn(*args)
            except BaseException as exc:  # the caller's to answer (422, 413, ...)
                future.set_exception(exc)
            else:
                future.set_result(result)
        return
    if future.cancelled():  # read off its loop: a cancel racing it only wastes the job
        return
    try:
        outcome, failed = fn(*args), False
    except BaseException as exc:  # the caller's to answer (422, 413, ...)
        outcome, failed = exc, True
    _on_loop_of(future, _settle, future, outcome, failed)


def _run_if_wanted(wanted: Callable[[], bool], fn: Callable[..., Any], *args) -> Any:
    if not wanted():
        raise ClientGone("the client went away before its lookup ran")
    return fn(*args)


def _on_loop_of(future: asyncio.Future, callback: Callable[..., None], *args) -> None:
    loop = future.get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        callback(*args)
        return
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # its loop is closed: no one awaits the result any more
        pass


def _settle(future: asyncio.Future, outcome: Any, failed: bool) -> None:
    if future.done():  # cancelled while it ran (the request went away)
        return
    if failed:
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _close(future, cancel: bool) -> None:
    if cancel:
        future.cancel()
    if not future.done():
        future.set_exception(PoolClosed("the coordinator is shutting down"))


__all__ = ["ClientGone", "FairPool", "MIN_CHARGE_US", "PoolClosed"]
