"""One reader's huge queries cannot hold the matcher from everyone else (issue 19, item 3).

Before: blend lookups queued FIFO for the one match worker, so four clients sending
2^20-token lookups pushed another client's p99 from 25 ms to 550 ms. Now readers (their
bearer token; without access control, their address) take turns by start-time fair
queuing, each charged the CPU its lookups took (issue 30; before, their bodies' bytes): a
small lookup waits for at most the lookup already running.

Deterministic: the matcher is held on a first lookup until every other lookup is queued;
then the order in which the matcher serves them is what is checked. (A small lookup while
the pool is idle is matched on the event loop instead, which the last test checks.)
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from blend_wire import BLEND_LOOKUP_PATH, encode, encode_tokens

LANE = "unit"

FLOODERS, EACH = 4, 3
TOKENS = {name: name[0].upper() * 4 + name.ljust(16, "-")
          for name in ["gate", "victim", *(f"flood{i}" for i in range(FLOODERS))]}


async def test_a_small_lookup_waits_only_for_the_one_running(start):
    coord = await start(access_tokens=tuple(("reader", token) for token in TOKENS.values()))
    service = coord.coordinator
    served: list[str] = []
    release = threading.Event()
    match = service.directory.match

    def recording_match(tokens, namespace, **kwargs):
        served.append(namespace.cache_salt)
        if namespace.cache_salt == "gate":
            release.wait(60)
        return match(tokens, namespace, **kwargs)

    service.directory.match = recording_match
    parsed = 0
    parse = service.parse_lookup

    def counting_parse(*args, **kwargs):
        nonlocal parsed
        parsed += 1
        return parse(*args, **kwargs)

    service.parse_lookup = counting_parse

    async def lookup(name: str, size: int) -> int:
        tokens = np.arange(size, dtype=np.uint32)
        body = {"tokens_b64": encode_tokens(tokens), "model_name": "m", "cache_salt": name}
        response = await coord.client.post(BLEND_LOOKUP_PATH, data=encode(body),
                                           headers={"Authorization": f"Bearer {TOKENS[name]}"})
        return response.status

    async def until(predicate) -> None:
        for _ in range(2000):
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    # Too large to be matched on the loop: the gate holds the pool, so it is busy.
    requests = [asyncio.create_task(lookup("gate", 30_000))]
    await until(lambda: served == ["gate"])  # the matcher is held
    # Each flooder queues three 40k-token lookups (~210 KB each), then the victim one of 8.
    for i in range(EACH):
        for f in range(FLOODERS):
            requests.append(asyncio.create_task(lookup(f"flood{f}", 40_000)))
    await until(lambda: parsed == 1 + FLOODERS * EACH)
    requests.append(asyncio.create_task(lookup("victim", 8)))
    await until(lambda: parsed == 2 + FLOODERS * EACH)  # parsed, and so queued (same step)
    release.set()
    assert set(await asyncio.gather(*requests)) == {200}
    assert served[1] == "victim", served
    # And the flooders shared the matcher in turns, not one after the other.
    floods = served[2:]
    assert floods[:FLOODERS] and len(set(floods[:FLOODERS])) == FLOODERS, floods


def test_the_pool_keeps_each_readers_order_skips_cancelled_and_settles_at_shutdown():
    from coordinator_stub.service.matchpool import FairPool, PoolClosed

    pool = FairPool(1, "test")
    held, ran = threading.Event(), []
    try:
        first = pool.submit("a", 10, held.wait, 30)
        jobs = [pool.submit("a", 10, ran.append, f"a{i}") for i in range(3)]
        jobs += [pool.submit("b", 10, ran.append, f"b{i}") for i in range(2)]
        failing = pool.submit("c", 1, lambda: 1 / 0)
        skipped = pool.submit("c", 1, ran.append, "skipped")
        assert skipped.cancel()
        held.set()
        assert first.result(30) is True
        for job in jobs:
            job.result(30)
        assert isinstance(failing.exception(30), ZeroDivisionError)
        assert [r for r in ran if r.startswith("a")] == ["a0", "a1", "a2"]
        assert "skipped" not in ran and ran.index("b0") < ran.index("a2")  # turns, not FIFO
        held.clear()
        pool.submit("a", 1, held.wait, 30)
        queued = pool.submit("b", 1, ran.append, "late")
    finally:
        held.set()
        pool.shutdown(wait=True, cancel_futures=True)
    assert queued.cancelled() or queued.done()
    assert isinstance(pool.submit("a", 1, ran.append, "x").exception(1), PoolClosed)


async def test_the_loop_side_hand_off_keeps_turns_results_and_errors():
    """`submit_async` (what the HTTP layer awaits): the same turns as `submit`, the result
    or the job's exception settled on the loop, a cancelled job skipped, and what is still
    queued at shutdown settled (cancelled) on the loop too."""
    from coordinator_stub.service.matchpool import FairPool

    pool = FairPool(1, "test")
    held, ran = threading.Event(), []
    try:
        first = pool.submit("a", 10, held.wait, 30)
        jobs = [pool.submit_async("a", 10, ran.append, f"a{i}") for i in range(2)]
        jobs += [pool.submit_async("b", 10, ran.append, f"b{i}") for i in range(2)]
        failing = pool.submit_async("c", 1, lambda: 1 / 0)
        skipped = pool.submit_async("c", 1, ran.append, "skipped")
        skipped.cancel()
        answer = pool.submit_async("d", 1, lambda: 42)
        held.set()
        assert await asyncio.wait_for(answer, 30) == 42
        await asyncio.wait_for(asyncio.gather(*jobs), 30)
        try:
            await asyncio.wait_for(failing, 30)
        except ZeroDivisionError:
            pass
        else:
            raise AssertionError("the job's exception was not raised where it was awaited")
        assert first.result(30) is True
        assert "skipped" not in ran and ran.index("b0") < ran.index("a1")  # turns, not FIFO
        held.clear()
        pool.submit("a", 1, held.wait, 30)
        queued = pool.submit_async("b", 1, ran.append, "late")
    finally:
        held.set()
        pool.shutdown(wait=True, cancel_futures=True)
    await asyncio.sleep(0)
    assert queued.cancelled() and "late" not in ran


async def test_a_small_lookup_is_matched_on_the_loop_only_while_the_pool_is_idle(start):
    """The thread hop costs more than matching a small query, so an idle pool is skipped;
    a busy one is not (the lookup takes its turn there, as above)."""
    coord = await start()
    service = coord.coordinator
    threads: list[str] = []
    release = threading.Event()
    match = service.directory.match

    def recording_match(tokens, namespace, **kwargs):
        threads.append(threading.current_thread().name)
        if namespace.cache_salt == "gate":
            release.wait(60)
        return match(tokens, namespace, **kwargs)

    service.directory.match = recording_match

    async def lookup(salt: str, size: int) -> int:
        body = {"tokens_b64": encode_tokens(np.arange(size, dtype=np.uint32)),
                "model_name": "m", "cache_salt": salt}
        response = await coord.client.post(BLEND_LOOKUP_PATH, data=encode(body))
        return response.status

    assert await lookup("small", 8_000) == 200
    assert threads == [threading.main_thread().name]
    gate = asyncio.create_task(lookup("gate", 30_000))  # too large for the loop: the pool
    for _ in range(2000):
        if len(threads) == 2:
            break
        await asyncio.sleep(0.01)
    assert threads[1].startswith("match"), threads
    small = asyncio.create_task(lookup("small", 8_000))
    await asyncio.sleep(0.2)
    assert len(threads) == 2 and not small.done()  # queued behind the gate, not on the loop
    release.set()
    assert await gate == 200 and await small == 200
    assert threads[2].startswith("match"), threads


def test_a_reader_is_charged_by_the_cpu_its_lookups_took_not_by_their_bytes():
    """Issue 30: 11 KB of gzip can ask for seconds of matching, so bytes said nothing of
    the work. A reader whose lookups are small in bytes but heavy in CPU waits, after its
    first, behind a reader whose lookups are large in bytes but take no CPU (by bytes the
    heavy one would have gone first every time)."""
    from coordinator_stub.service.matchpool import FairPool

    def heavy(name: str) -> None:
        until = time.thread_time() + 0.03  # 30 ms of this thread's CPU
        while time.thread_time() < until:
            pass
        ran.append(name)

    pool = FairPool(1, "test")
    held, ran = threading.Event(), []
    try:
        gate = pool.submit("gate", 0, held.wait, 30)
        jobs = [pool.submit("heavy", 10, heavy, f"h{i}") for i in range(3)]
        jobs += [pool.submit("light", 10**6, ran.append, f"l{i}") for i in range(3)]
        held.set()
        assert gate.result(30) is True
        for job in jobs:
            job.result(30)
    finally:
        held.set()
        pool.shutdown(wait=True, cancel_futures=True)
    # Both start at the clock (the heavy one first: the smaller body), then the heavy
    # reader's next start is 30 ms of CPU later; the light one's three cost ~nothing.
    assert ran == ["h0", "l0", "l1", "l2", "h1", "h2"], ran
