"""The match workers, shared fairly between readers: start-time fair queuing
(`coordinator_stub.fairness`) by the CPU each lookup took (docs/DESIGN.md, "Coordinator").

One reader's huge queries must not hold the matcher from everyone else. Every reader
(`flow`: the bearer token with access control on, else the client's address) has its own
FIFO of lookups; a worker takes the flow with the lowest start tag (ties: the smaller body
first, then arrival), and once the lookup ran the flow is charged what it took: its finish
is start + the worker thread's CPU microseconds for the job (`time.thread_time`, numba's
kernels included; at least `MIN_CHARGE_US`), and its next lookup is tagged that finish.
The body's size says little of the work (11 KB of gzip can ask for a million tokens of one
repeated token): the charge comes after the work, so a flow's own next lookup pays for its
last one.

Guarantees: a reader who was not ahead of the others (its last finish at most the clock)
is served as soon as a worker finishes the lookup it is running, before any lookup of a
reader whose last lookups took more CPU, however many lookups other readers have queued;
readers that flood share the workers equally by CPU. A lookup is not stopped once it runs:
the wait behind one is bounded by the bounded work of a lookup (WIRE.md, "Limits"). A flow
has at most one lookup running at a time, so one reader cannot occupy every worker either,
and its lookups run in the order they came.

Contract: `FairPool(workers, name)`; `submit(flow, size, fn, *args)` returns a
`concurrent.futures.Future` at once, `submit_async` (on an event loop) an `asyncio.Future`
that the worker settles on that loop directly (one `call_soon_threadsafe`, the HTTP
layer's hand-off per lookup); either cancelled before it runs is skipped.
`submit_async(..., wanted=f)`: the worker that reaches the job asks `f()` first; False
(its client's connection is gone) drops it unrun, the future failing with `ClientGone`.
`shutdown(cancel_futures=True)` stops the threads (what has not started is cancelled, or
fails with `PoolClosed`). `idle`: nothing running or queued (read without the lock; the
HTTP layer matches a small lookup on the loop only then, so a lookup arriving while others
wait still takes its turn here).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, Callable, Hashable

from coordinator_stub.errors import ShuttingDown
from coordinator_stub.fairness import FairQueues

#: The least a lookup is charged, in microseconds of CPU, so that no lookup is free.
MIN_CHARGE_US = 50


class PoolClosed(ShuttingDown):
    """The coordinator is shutting down; the lookup did not run (503, `Retry-After`)."""


class ClientGone(RuntimeError):
    """The lookup's client went away before a worker reached it; it did not run."""


class FairPool:
    def __init__(self, workers: int, name: str = "match") -> None:
        self._cond = threading.Condition()
        self._flows = FairQueues()  # jobs: (size, fn, args, future); tags in CPU us
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
            self._flows.append(flow, (size, fn, args, future), size,
                               active=flow in self._running)
            self._cond.notify()
        return future

    def _run(self) -> None:
        flows = self._flows
        while True:
            with self._cond:
                turn = flows.wait_for_turn(self._cond, lambda: self._closed)
                if turn is None:
                    return
                start, flow = turn
                _, fn, args, future = flows.queues[flow].popleft()
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
                queue = flows.queues[flow]
                if queue:  # backlogged: next at its finish tag
                    flows.wait(flow, finish, queue[0][0])
                    self._cond.notify()
                else:
                    flows.went_idle(flow, finish)

    def shutdown(self, wait: bool = True, cancel_futures: bool = True) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            pending = self._flows.clear()
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
        return not self._running and not self._flows.waiting

    @property
    def pending(self) -> int:
        """Lookups queued, not yet started."""
        with self._cond:
            return self._flows.queued()


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
