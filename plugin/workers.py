"""`DaemonPool`: the plugin's thread pool, whose threads never keep a process alive.

`concurrent.futures.ThreadPoolExecutor` joins its threads when the interpreter exits, and
the plugin runs tasks that end only when told to (the reporter's flush loop, the sweep of
abandoned lookups): a serving process, or a script, that never called `close()` would
never exit. This pool's threads are daemons, so whoever owns the pool decides what happens
at exit (`BlendPlugin` flushes its events there, within a bound). Otherwise it is an
`Executor` like any other: threads start as tasks need them, up to `max_workers`;
`shutdown(wait=True)` waits for every task taken.
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Executor, Future
from typing import Any, Callable

_STOP = None  # what a worker reads to end; it puts it back for the next one


class DaemonPool(Executor):
    """A thread pool of daemon threads (module doc)."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers} must be >= 1")
        self.max_workers = max_workers
        self._prefix = thread_name_prefix
        self._numbers = itertools.count()
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one release per worker waiting for a task
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._shut_down = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with self._lock:
            if self._shut_down:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: Future = Future()
            self._tasks.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self.max_workers:
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"{self._prefix}_{next(self._numbers)}")
                thread.start()
                self._threads.append(thread)
            return future

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            if task is _STOP:
                self._tasks.put(_STOP)
                return
            future, fn, args, kwargs = task
            del task
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # the future carries it, as the stdlib pool's do
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future, fn, args, kwargs  # nothing of a finished task is kept alive here
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new tasks; queued ones still run unless `cancel_futures`; `wait`: join every
        thread (each ends once the queue is empty)."""
        with self._lock:
            self._shut_down = True
            if cancel_futures:
                while True:
                    try:
                        task = self._tasks.get_nowait()
                    except queue.Empty:
                        break
                    if task is not _STOP:
                        task[0].cancel()
            self._tasks.put(_STOP)
            threads = list(self._threads)
        if wait:
            for thread in threads:
                thread.join()
