"""Lookups an engine abandons (issue 11, point 4): `cancel(request_id)`, a short life and
O(1) memory beyond the tokens for an abandoned lookup, a cap on tracked lookups, and an
`InMemoryHost` that does not keep every request it ever saw.

Before: an engine that called `cb_unified_lookup` once and aborted left the engine's whole
`LookupKey` (its token list) plus a uint32 copy for 300 s, released only by a sweep a later
lookup ran; there was no way to cancel and no cap (10k abandoned 8k-token lookups: 958 MB).
"""

from __future__ import annotations

import gc
import threading
import time
import tracemalloc
import weakref

import pytest

from helpers import FakeClock, LoopbackServer, Reply, wait_until
from plugin import (BlendPlugin, CBUnifiedLookupResult, InMemoryHost, LookupKey, MatchState,
                    PluginConfig)

LANE = "unit"

C = 16
MODEL = "m"


def _plugin(host, **overrides) -> BlendPlugin:
    return BlendPlugin(PluginConfig(**{"chunk_size": C, "blend_timeout": 0.05, **overrides}),
                       host)


def _key(request_id: str, n: int = 8192) -> LookupKey:
    # A list of Python ints, as engines hand them over: ~8x the size of the uint32 copy.
    return LookupKey(request_id, list(range(100_000, 100_000 + n)), MODEL)


def test_cancel_releases_the_lookup_and_the_hosts_operations():
    host = InMemoryHost(C, prefix_delay_s=60.0)
    with _plugin(host) as plugin:
        assert plugin.cb_unified_lookup(_key("r1", 64)) is None
        assert plugin.active_lookups == 1 and host.pending_ops == 1
        assert plugin.cancel("r1") is True
        assert plugin.active_lookups == 0 and host.pending_ops == 0
        assert plugin.cancel("r1") is False  # idempotent
        assert plugin.stats().cancelled == 1
        # The same id later is a fresh lookup that completes normally.
        host.prefix_delay_s = 0.0
        assert plugin.cb_unified_lookup(_key("r1", 64)) == CBUnifiedLookupResult(0, [])


def test_cancel_withdraws_the_coordinator_query():
    server = LoopbackServer(lambda path, body: Reply(200, {"matches": []}, delay_s=0.5))
    try:
        host = InMemoryHost(C)
        with _plugin(host, coordinator_url=server.url, event_reporting=True,
                     blend_timeout=2.0) as plugin:
            assert plugin.cb_unified_lookup(_key("r1", 4 * C)) is None  # fleet pending
            assert plugin.client.stats().submitted == 1
            assert plugin.cancel("r1")
            # The client forgot it: nothing is tracked, and a late reply is discarded.
            assert plugin.client.take("r1").state is MatchState.UNKNOWN
    finally:
        server.close()


def test_an_abandoned_lookup_is_released_after_a_few_budgets_with_no_later_call():
    # An idle server: one lookup, then nothing calls the plugin again (no lookup, no store,
    # no sweep()). Its sweep task lets the lookup go, with its tokens and the host's ops.
    clock = FakeClock()
    host = InMemoryHost(C, prefix_delay_s=60.0, clock=clock)
    with BlendPlugin(PluginConfig(chunk_size=C, blend_timeout=0.05), host, clock=clock) as plugin:
        assert plugin.config.abandon_after_s == pytest.approx(0.2)  # 4 budgets
        assert plugin.cb_unified_lookup(_key("gone")) is None
        tokens = weakref.ref(plugin._lookups["gone"].tokens)
        clock.advance(0.1)
        time.sleep(0.2)  # several of the sweep's wake-ups (every 0.05 s)
        assert plugin.active_lookups == 1 and host.pending_ops == 1  # within its budgets
        clock.advance(0.15)  # past abandon_after_s; nothing calls the plugin from here on
        assert wait_until(lambda: plugin.active_lookups == 0, 20.0)
        assert wait_until(lambda: host.pending_ops == 0, 20.0)
        gc.collect()
        assert tokens() is None  # the uint32 copy is gone too
        assert plugin.stats().abandoned == 1


def test_the_store_path_sweeps_too():
    clock = FakeClock()
    host = InMemoryHost(C, prefix_delay_s=60.0, clock=clock)
    with BlendPlugin(PluginConfig(chunk_size=C, abandoned_lookup_s=600.0), host,
                     clock=clock) as plugin:
        plugin.cb_unified_lookup(_key("gone", 64))
        clock.advance(601.0)  # the sweep task sleeps in real time (150 s here): not yet
        plugin.on_store(LookupKey("s", list(range(C)), MODEL), [b"\x01" * 16], 0)
        assert plugin.active_lookups == 0 and host.pending_ops == 0
        assert plugin.stats().abandoned == 1


class SlowReleaseHost(InMemoryHost):
    """A host whose cancel cannot release at once (a load in flight): `settle` releases
    what was cancelled once its clock says the load landed."""

    def __init__(self, *args, land_after_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.land_after_s = land_after_s
        self.holding: dict[str, float] = {}
        self.settled = 0

    def cancel(self, request_id: str) -> None:
        super().cancel(request_id)
        self.holding[request_id] = self._clock() + self.land_after_s

    def settle(self) -> int:
        now = self._clock()
        for request_id, lands in list(self.holding.items()):
            if now >= lands:
                del self.holding[request_id]
                self.settled += 1
        return len(self.holding)


def test_what_the_host_still_holds_after_a_cancel_is_settled_with_no_later_call():
    clock = FakeClock()
    host = SlowReleaseHost(C, prefix_delay_s=60.0, clock=clock, land_after_s=5.0)
    with _plugin(host, abandoned_lookup_s=2.0) as plugin:
        assert plugin.cb_unified_lookup(_key("aborted", 64)) is None
        assert plugin.cancel("aborted")  # the engine aborted it; its load is in flight
        assert plugin.active_lookups == 0 and host.holding
        clock.advance(5.0)  # the load lands; nothing calls the plugin any more
        assert wait_until(lambda: not host.holding, 20.0)  # the sweep wakes every 0.5 s
        assert host.settled == 1


def test_close_ends_the_sweep_task_at_once_and_leaves_no_thread():
    def workers():
        return {t for t in threading.enumerate() if t.name.startswith("blend-worker")
                and t.is_alive()}

    before = workers()  # identities: other tests' threads may come and go
    host = InMemoryHost(C, prefix_delay_s=60.0)
    # The sweep sleeps up to abandon_after_s / 4 = 150 s between rounds; close must not wait.
    plugin = _plugin(host, abandoned_lookup_s=600.0)
    assert plugin.cb_unified_lookup(_key("pending", 64)) is None
    assert wait_until(lambda: len(workers() - before) == 1)  # the sweep task's thread
    started = workers() - before
    closing = time.monotonic()
    plugin.close()
    assert time.monotonic() - closing < 30.0  # not the sweep's 150 s sleep
    assert not any(t.is_alive() for t in started)


def test_a_polled_lookup_is_not_abandoned():
    clock = FakeClock()  # scheduler steps 10 ms apart, however loaded the machine
    host = InMemoryHost(C, prefix_delay_s=0.4, clock=clock)
    with BlendPlugin(PluginConfig(chunk_size=C, blend_timeout=0.05), host, clock=clock) as plugin:
        result = None
        for step in range(300):
            result = plugin.cb_unified_lookup(_key("slow", 64))
            if result is not None:
                break
            plugin.cb_unified_lookup(_key(f"other-{step}", 8))  # runs sweeps
            clock.advance(0.01)
        assert result == CBUnifiedLookupResult(0, [])
        # Polled all along, so never released and restarted: one prefix lookup, many polls.
        assert [rid for rid, _ in host.prefix_requests].count("slow") == 1
        assert plugin.trace("slow").calls > 10
        assert plugin.stats().abandoned > 0  # the others, polled once, were let go


def test_tracked_lookups_are_capped_releasing_the_least_recently_polled():
    host = InMemoryHost(C, prefix_delay_s=60.0)
    with _plugin(host, max_tracked_lookups=10, blend_timeout=60.0) as plugin:
        for i in range(25):
            assert plugin.cb_unified_lookup(_key(f"r{i}", 64)) is None
        assert plugin.active_lookups == 10
        assert plugin.stats().evicted == 15
        assert host.pending_ops == 10  # the host forgot the evicted ones as well


def test_an_abandoned_lookup_holds_its_uint32_tokens_and_O1_more():
    host = InMemoryHost(C, prefix_delay_s=60.0)
    n, count = 8192, 200
    with _plugin(host, blend_timeout=60.0) as plugin:
        plugin.cb_unified_lookup(_key("warm", n))  # first-call allocations out of the way
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(count):
                plugin.cb_unified_lookup(_key(f"r{i}", n))  # the engine drops its key here
            gc.collect()
            held = (tracemalloc.get_traced_memory()[0] - before) / count
        finally:
            tracemalloc.stop()
        tokens = 4 * n
        # Before: the engine's list (~8x the tokens) was kept alive too.
        assert held < tokens + 2048, f"{held:.0f} B per abandoned lookup, tokens {tokens} B"


def test_in_memory_host_is_bounded():
    host = InMemoryHost(C, prefix_delay_s=60.0, max_pending_ops=100, history=50)
    for i in range(1000):
        host.submit_prefix_lookup(LookupKey(f"r{i}", list(range(C)), MODEL), 1)
    assert host.pending_ops == 100 and host.dropped_ops == 900
    assert len(host.prefix_requests) <= 100
    assert host.prefix_requests[-1] == ("r999", 1)
    with pytest.raises(KeyError):
        host.poll_prefix_lookup("r0")  # forgotten: says so rather than hang the caller
