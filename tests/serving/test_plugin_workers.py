"""`plugin.workers.DaemonPool`: an Executor whose threads never hold a process up."""

from __future__ import annotations

import threading

import pytest

from plugin.workers import DaemonPool

LANE = "unit"


def test_tasks_run_on_daemon_threads_up_to_the_limit_and_carry_results_and_errors():
    pool = DaemonPool(2, thread_name_prefix="t")
    release = threading.Event()
    seen: list[threading.Thread] = []

    def held() -> str:
        seen.append(threading.current_thread())
        release.wait(10)
        return "done"

    futures = [pool.submit(held) for _ in range(3)]  # the third waits for a free thread
    failed = pool.submit(lambda: 1 / 0)
    release.set()
    assert [f.result(10) for f in futures] == ["done"] * 3
    with pytest.raises(ZeroDivisionError):
        failed.result(10)
    assert len(set(seen)) == 2 and all(t.daemon for t in seen)
    pool.shutdown()
    assert not any(t.is_alive() for t in seen)


def test_shutdown_runs_what_was_queued_unless_cancelled_and_refuses_more():
    pool = DaemonPool(1, thread_name_prefix="t")
    gate = threading.Event()
    first = pool.submit(gate.wait, 10)
    queued = pool.submit(lambda: "ran")
    gate.set()
    pool.shutdown(wait=True)
    assert first.result() is True and queued.result() == "ran"
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(print)

    pool = DaemonPool(1, thread_name_prefix="t")
    gate.clear()
    running = pool.submit(gate.wait, 10)
    dropped = pool.submit(lambda: "ran")  # queued behind it: the only thread is busy
    pool.shutdown(wait=False, cancel_futures=True)
    assert dropped.cancelled()
    gate.set()
    assert running.result(10) is True
