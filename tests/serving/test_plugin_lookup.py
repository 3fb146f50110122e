"""The unified lookup: state machine, merge order, prefetch, deadline, gating.

The serving side is the real `InMemoryHost` (with artificial delays for the pending paths),
the local leg the real `LocalMatcher`, and the coordinator a real loopback HTTP server whose
replies each test chooses.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import numpy as np
import pytest

from blend_wire import BLEND_LOOKUP_PATH, EVENTS_PATH, decode_tokens
from helpers import (FakeClock, LoopbackServer, Reply, closed_port_url, ok_reply, poll_lookup,
                     store, wait_until)
from plugin import (BlendPlugin, CBMatchResult, CBUnifiedLookupResult, InMemoryHost, LookupKey,
                    MatchState, PluginConfig, Source)
from plugin.lookup import Candidate, select
from plugin.types import FoundContent, Place

LANE = "unit"

LOCAL, FLEET, BOTH = Source.LOCAL, Source.FLEET, Source.BOTH

C = 16
MODEL = "m"
rng = np.random.default_rng(7)


def fresh(n: int) -> np.ndarray:
    return rng.integers(1000, 60000, n, dtype=np.uint32)


def make_plugin(host, url=None, clock=time.monotonic, **overrides) -> BlendPlugin:
    options = dict(chunk_size=C, coordinator_url=url, event_reporting=url is not None,
                   blend_timeout=0.3, event_flush_interval=0.05, breaker_cooldown_s=30.0)
    options.update(overrides)
    return BlendPlugin(PluginConfig(**options), host, clock=clock)


@pytest.fixture
def plugins():
    made = []

    def factory(host, url=None, clock=time.monotonic, **overrides):
        made.append(make_plugin(host, url, clock, **overrides))
        return made[-1]

    yield factory
    for plugin in made:
        plugin.close()


def save(plugin, host, tokens, start=0):
    """Store every full chunk of `tokens` from `start` under made-up hashes, as an engine would."""
    count = (len(tokens) - start) // C
    hashes = [bytes([len(host.store_map) % 256, i % 256]) + tokens[start + i * C:start + i * C + 2].tobytes()
              for i in range(count)]
    return store(plugin, host, LookupKey("store", tokens, MODEL), hashes, start)


def fleet_reply(*matches, delay_s=0.0):
    body = {"matches": [{"chunk_hash": h.hex(), "old_st": o, "cur_st": c} for h, o, c in matches]}
    return lambda path, b: Reply(200, body, delay_s=delay_s)


def seg(old_st, cur_st, chunk_hash):
    return CBMatchResult(old_st, old_st + C, cur_st, cur_st + C, chunk_hash)


# --- selection (pure; the property test against a brute force is test_plugin_selection.py) ----


def found(positions, *chunks, place=Place.PEER):
    """A content found at `positions`, held by `chunks` ((hash, old_st) pairs)."""
    return FoundContent(tuple(positions), place, tuple(chunks))


def local(positions, *chunks):
    return found(positions, *chunks, place=Place.THIS_SERVER)


def test_prefix_covered_position_is_dropped_before_overlaps_are_resolved():
    covered = local([8], (b"p", 0))    # starts inside the 16-token prefix, ends at 24
    usable = local([20], (b"u", 100))  # overlaps the covered one
    assert select([covered, usable], [], 16, C) == [Candidate(seg(100, 20, b"u"), LOCAL)]
    # With no prefix the covered position is kept and shadows the usable one.
    assert [c.segment for c in select([covered, usable], [], 0, C)] == [seg(0, 8, b"p")]


def test_overlaps_resolve_leftmost_greedy_and_ascending():
    kept = select([local([40], (b"a", 0)), local([10], (b"c", 0))],
                  [found([0], (b"b", 0)), found([16], (b"d", 0))], 0, C)
    assert [k.segment for k in kept] == [seg(0, 0, b"b"), seg(0, 16, b"d"), seg(0, 40, b"a")]
    assert [k.source for k in kept] == [FLEET, FLEET, LOCAL]


def test_a_chunk_is_not_spent_on_a_position_the_selection_drops():
    # Content X occurs at 8 (overlapped by the kept match at 0) and again at 40. LMCache's
    # rule gives X's only chunk to 8, which is then dropped, and 40 gets nothing.
    kept = select([], [found([0], (b"a", 0)), found([8, 40], (b"x", 256))], 0, C)
    assert [k.segment for k in kept] == [seg(0, 0, b"a"), seg(256, 40, b"x")]


def test_each_chunk_serves_one_position_and_the_cheapest_chunk_is_given():
    offers = found([0, 16, 32], (b"peer", 0))
    shared = found([0, 16, 32], (b"l2", 512), place=Place.SHARED)
    mine = local([0, 16, 32], (b"mine", 256))
    kept = select([mine], [offers, shared], 0, C)
    assert [(k.segment.cur_st, k.segment.hash) for k in kept] == [
        (0, b"mine"), (16, b"l2"), (32, b"peer")]


def test_a_chunk_both_legs_name_is_one_chunk_at_its_cheaper_place():
    kept = select([local([48], (b"x", 32))], [found([20, 48], (b"x", 32))], 0, C)
    # The fleet's earlier position is kept; the local leg named the same chunk: BOTH.
    assert kept == [Candidate(seg(32, 20, b"x"), BOTH)]


# --- the state machine --------------------------------------------------------------------------


def test_first_call_starts_prefix_local_and_coordinator(plugins):
    answer = threading.Event()  # the coordinator answers only once the test has looked

    def behave(path, body):
        answer.wait(30.0)
        return Reply(200, {"matches": []})

    with LoopbackServer(behave) as server:
        host = InMemoryHost(C)
        # A budget no loaded machine runs out of before the test lets the coordinator answer
        # (seen once with 2 s under load: the leg timed out, "ok" was "timeout").
        plugin = plugins(host, server.url, blend_timeout=20.0)
        doc = fresh(2 * C)
        hashes = save(plugin, host, doc)
        query = np.concatenate([fresh(5), doc, fresh(3)])
        assert plugin.cb_unified_lookup(LookupKey("r1", query, MODEL), 2) is None
        assert host.prefix_requests == [("r1", 2)]
        # The local match ran on that first call: chunks leaving the local matcher now (the
        # host still holds them) are still part of this lookup.
        plugin.on_evict(hashes)
        # The plugin's event reporter posts to the same server; count lookups only.
        assert wait_until(lambda: len(server.bodies(BLEND_LOOKUP_PATH)) == 1, 10.0)
        sent = server.bodies(BLEND_LOOKUP_PATH)[0]
        assert list(decode_tokens(sent["tokens_b64"])) == query.tolist()
        answer.set()
        result, _, _ = poll_lookup(plugin, LookupKey("r1", query, MODEL))
        trace = plugin.trace("r1")
        assert trace.local_matches == 2 and trace.fleet_status == "ok"
        assert [s.cur_st for s in result.non_prefix_segments] == [5, 5 + C]


def test_no_coordinator_query_below_one_chunk(plugins):
    with LoopbackServer(fleet_reply()) as server:
        host = InMemoryHost(C)
        plugin = plugins(host, server.url)
        result, _, calls = poll_lookup(plugin, LookupKey("short", fresh(C - 1), MODEL))
        assert result == CBUnifiedLookupResult(0, []) and calls == 1
        assert plugin.client.stats().submitted == 0
        assert plugin.trace("short").fleet_status == "short"
        assert server.requests == []


def test_pending_prefix_returns_none_without_blocking(plugins):
    now = [0.0]  # the host's clock: its prefix lookup completes only when the test says so
    host = InMemoryHost(C, prefix_delay_s=0.1, clock=lambda: now[0])
    plugin = plugins(host)
    key = LookupKey("r1", fresh(4 * C), MODEL)
    # Structural: the prefix cannot complete while the clock stands, so a call that waited
    # for it would never return.
    assert plugin.cb_unified_lookup(key) is None
    assert plugin.cb_unified_lookup(key) is None
    now[0] += 0.1
    assert plugin.cb_unified_lookup(key) == CBUnifiedLookupResult(0, [])
    assert plugin.trace("r1").calls == 3


def test_pending_prefetch_returns_none(plugins):
    host = InMemoryHost(C, prefetch_delay_s=0.1)
    plugin = plugins(host)
    doc = fresh(C)
    save(plugin, host, doc)
    key = LookupKey("r1", np.concatenate([fresh(3), doc]), MODEL)
    assert plugin.cb_unified_lookup(key) is None
    assert len(host.prefetch_requests) == 1
    result, _, _ = poll_lookup(plugin, key)
    assert [s.cur_st for s in result.non_prefix_segments] == [3]
    assert len(host.prefetch_requests) == 1  # polled, not re-submitted


class HeldReply:
    """A `behave` that answers blend lookups with `matches`, each only once the test calls
    `release()`; `waiting` is how many are held now. Other requests (the plugin's events)
    are answered at once."""

    def __init__(self, *matches) -> None:
        self._reply, self._released = fleet_reply(*matches), threading.Event()
        self.waiting = 0

    def __call__(self, path: str, body: bytes) -> Reply:
        if path != BLEND_LOOKUP_PATH:
            return ok_reply(path, body)
        self.waiting += 1
        self._released.wait(60)
        self.waiting -= 1
        return self._reply(path, body)

    def release(self) -> None:
        self._released.set()


def test_pending_coordinator_before_the_deadline_returns_none(plugins):
    l2 = {}
    fleet_chunk = b"\xf1" * 4
    l2[fleet_chunk] = np.zeros(C, dtype=np.uint32)
    held = HeldReply((fleet_chunk, 64, 2 * C))
    with LoopbackServer(held) as server:
        plugin = plugins(InMemoryHost(C, shared_l2=l2), server.url, FakeClock(),
                         blend_timeout=2.0)
        key = LookupKey("r1", fresh(4 * C), MODEL)
        assert plugin.cb_unified_lookup(key) is None
        assert wait_until(lambda: held.waiting == 1)  # the query waits at the coordinator
        assert plugin.cb_unified_lookup(key) is None  # pending, within the budget
        held.release()
        result, _, _ = poll_lookup(plugin, key, timeout=30.0)
        assert result.non_prefix_segments == [seg(64, 2 * C, fleet_chunk)]
        assert plugin.trace("r1").fleet_status == "ok"


def test_union_of_local_and_fleet_rides_one_prefetch(plugins):
    l2 = {}
    host = InMemoryHost(C, shared_l2=l2)
    doc_local = fresh(C)
    fleet_chunk = b"\xf2" * 4
    l2[fleet_chunk] = np.zeros(C, dtype=np.uint32)
    query = np.concatenate([fresh(C), doc_local, fresh(C)])
    with LoopbackServer(fleet_reply((fleet_chunk, 320, 2 * C))) as server:
        plugin = plugins(host, server.url)
        local_hash, = save(plugin, host, doc_local)
        result, _, _ = poll_lookup(plugin, LookupKey("r1", query, MODEL))
    expected = [seg(0, C, local_hash), seg(320, 2 * C, fleet_chunk)]
    assert result.non_prefix_segments == expected  # ascending by cur_st
    assert host.prefetch_requests == [("r1", expected)]
    assert plugin.trace("r1").sources == [LOCAL, FLEET]


def test_prefix_covered_fleet_match_does_not_shadow_a_local_one(plugins):
    host = InMemoryHost(C)
    prefix = fresh(C)
    tail = fresh(C)
    query = np.concatenate([prefix, fresh(4), tail])
    # The engine's prefix cache holds the first chunk of the query.
    key = LookupKey("r1", query, MODEL)
    host.store(key, host.chunk_hashes(key)[:1], 0)
    shadow = b"\x5a" * 4
    host.store_map[shadow] = np.zeros(C, dtype=np.uint32)
    with LoopbackServer(fleet_reply((shadow, 0, 8))) as server:  # starts inside the prefix
        plugin = plugins(host, server.url)
        local_hash, = save(plugin, host, tail)
        result, _, _ = poll_lookup(plugin, key)
    assert result.prefix_coverage_tokens == C
    assert result.non_prefix_segments == [seg(0, C + 4, local_hash)]


def test_chunk_reported_by_both_sources_appears_once(plugins, monkeypatch):
    host = InMemoryHost(C)
    doc = fresh(C)
    query = np.concatenate([fresh(7), doc])
    server = LoopbackServer()
    try:
        plugin = plugins(host, server.url)
        chunk, = save(plugin, host, doc)
        server.behave = fleet_reply((chunk, 0, 7))
        result, _, _ = poll_lookup(plugin, LookupKey("r1", query, MODEL))
    finally:
        server.close()
    assert result.non_prefix_segments == [seg(0, 7, chunk)]
    assert plugin.trace("r1").sources == [BOTH]
    assert host.prefetch_requests[0][1] == [seg(0, 7, chunk)]


def test_overlapping_fleet_matches_resolve_leftmost_greedy(plugins):
    l2 = {h: np.zeros(C, dtype=np.uint32) for h in (b"a", b"b", b"c")}
    with LoopbackServer(fleet_reply((b"a", 0, 0), (b"b", 0, 8), (b"c", 0, C))) as server:
        plugin = plugins(InMemoryHost(C, shared_l2=l2), server.url)
        result, _, _ = poll_lookup(plugin, LookupKey("r1", fresh(3 * C), MODEL))
    assert result.non_prefix_segments == [seg(0, 0, b"a"), seg(0, C, b"c")]


def test_no_prefetch_when_nothing_to_fetch(plugins):
    host = InMemoryHost(C)
    plugin = plugins(host)
    result, _, calls = poll_lookup(plugin, LookupKey("r1", fresh(3 * C), MODEL))
    assert result == CBUnifiedLookupResult(0, []) and calls == 1
    assert host.prefetch_requests == []


def test_only_chunks_the_prefetch_found_are_returned(plugins):
    host = InMemoryHost(C)  # its own store: it cannot fetch what another server holds
    doc = fresh(C)
    with LoopbackServer(fleet_reply((b"\xee\xee", 0, 2 * C))) as server:
        plugin = plugins(host, server.url)
        local_hash, = save(plugin, host, doc)
        query = np.concatenate([doc, fresh(C), fresh(C)])
        result, _, _ = poll_lookup(plugin, LookupKey("r1", query, MODEL))
    assert result.non_prefix_segments == [seg(0, 0, local_hash)]
    trace = plugin.trace("r1")
    assert trace.prefetched == 2 and trace.fleet_matches == 1


def test_past_the_deadline_the_lookup_goes_local_only(plugins):
    # The coordinator holds its reply until the test lets it go; the budget is 5 s on the
    # plugin's clock, which moves only when the test says: pending within the budget, then
    # local-only at it, while the reply is still held (so not waited for).
    l2 = {b"\x0f": np.zeros(C, dtype=np.uint32)}
    host = InMemoryHost(C, shared_l2=l2)
    doc = fresh(C)
    clock = FakeClock()
    held = HeldReply((b"\x0f", 0, 2 * C))
    with LoopbackServer(held) as server:
        plugin = plugins(host, server.url, clock, blend_timeout=5.0)
        local_hash, = save(plugin, host, doc)
        key = LookupKey("r1", np.concatenate([doc, fresh(2 * C)]), MODEL)
        assert plugin.cb_unified_lookup(key) is None
        assert wait_until(lambda: held.waiting == 1)  # the query waits at the coordinator
        clock.advance(4.9)
        assert plugin.cb_unified_lookup(key) is None  # pending, within the budget
        clock.advance(0.1)
        result = plugin.cb_unified_lookup(key)
        assert result.non_prefix_segments == [seg(0, 0, local_hash)]
        assert held.waiting == 1  # completed with the reply still held at the coordinator
        assert plugin.trace("r1").fleet_status == "timeout"
        # Whatever arrives later is discarded, not kept for anyone.
        held.release()
        assert wait_until(lambda: plugin.client.stats().late_discarded == 1, 30.0)
        assert plugin.client.take("r1").state is MatchState.UNKNOWN
        assert plugin.client.stats().tracked == 0


def test_a_slow_coordinator_gets_each_event_batch_once_while_lookups_keep_their_budget():
    # Alive but slow: every answer takes 1.5 s, past the lookup budget (blend_timeout, 1 s by
    # default) and within the event POSTs' own deadline (event_timeout, LMCache's 2 s).
    def slow(path, body):
        reply = ok_reply(path, body)
        reply.delay_s = 1.5
        return reply

    config = PluginConfig(chunk_size=C, event_flush_interval=0.05, instance_id="slow-test")
    assert (config.blend_timeout, config.event_timeout) == (1.0, 2.0)  # the defaults
    with LoopbackServer(slow) as server:
        host = InMemoryHost(C)
        config = dataclasses.replace(config, coordinator_url=server.url, event_reporting=True)
        with BlendPlugin(config, host) as plugin:
            doc = fresh(3 * C)
            hashes = save(plugin, host, doc)
            result, _, _ = poll_lookup(plugin, LookupKey("r1", np.concatenate(
                [fresh(5), doc]), MODEL), timeout=30.0)
            # The lookup did not wait for the coordinator's answer: local only, on its budget
            # (a lookup that waited would say "ok").
            assert plugin.trace("r1").fleet_status in ("timeout", "failed")
            assert [s.cur_st for s in result.non_prefix_segments] == [5, 5 + C, 5 + 2 * C]
            plugin.on_evict(hashes[:1])
            # Both POSTs (the stores, then the delete) were answered: each batch went once.
            assert wait_until(lambda: plugin.reporter.stats().sent_batches == 2, 15.0)
            stats = plugin.reporter.stats()
            assert (stats.failed_flushes, stats.dropped_events, stats.pending) == (0, 0, 0)
            posted = [b["seq"] for body in server.bodies(EVENTS_PATH) for b in body["batches"]]
            assert posted == [1, 2]


def test_state_is_released_when_the_lookup_completes(plugins):
    host = InMemoryHost(C, delay_s=0.02)
    plugin = plugins(host)
    key = LookupKey("r1", fresh(2 * C), MODEL)
    assert plugin.cb_unified_lookup(key) is None
    assert plugin.active_lookups == 1
    poll_lookup(plugin, key)
    assert plugin.active_lookups == 0
    poll_lookup(plugin, key)  # the same id again is a new lookup
    assert [rid for rid, _ in host.prefix_requests] == ["r1", "r1"]


def test_abandoned_lookups_are_released(plugins):
    clock = FakeClock()
    host = InMemoryHost(C, prefix_delay_s=60.0, clock=clock)
    plugin = plugins(host, clock=clock, abandoned_lookup_s=0.05)
    assert plugin.cb_unified_lookup(LookupKey("abandoned", fresh(C), MODEL)) is None
    clock.advance(0.1)
    assert plugin.cb_unified_lookup(LookupKey("next", fresh(C), MODEL)) is None
    assert plugin.stats().abandoned == 1 and plugin.active_lookups == 1


class BrokenHost(InMemoryHost):
    def poll_prefix_lookup(self, request_id):
        raise RuntimeError("engine hiccup")


def test_errors_never_reach_the_serving_path(plugins, caplog):
    plugin = plugins(BrokenHost(C))
    assert plugin.cb_unified_lookup(LookupKey("r1", fresh(2 * C), MODEL)) == CBUnifiedLookupResult(0, [])
    assert plugin.active_lookups == 0 and plugin.stats().errors == 1
    assert "engine hiccup" in caplog.text


def test_a_range_that_does_not_fit_is_logged_and_not_indexed(plugins, caplog):
    host = InMemoryHost(C)
    plugin = plugins(host)
    doc = fresh(C)
    key = LookupKey("bad", doc, MODEL)
    host.store(key, [b"1"], 0)
    plugin.on_store(key, [b"1", b"2"], 0)  # two chunks in one chunk of tokens: never raises
    assert "do not fit" in caplog.text
    assert poll_lookup(plugin, LookupKey("q", np.concatenate([fresh(3), doc]), MODEL))[0] == \
        CBUnifiedLookupResult(0, [])


@pytest.mark.parametrize("bad_tokens", [[-1] * (2 * C), [2**32] * (2 * C), [0.5] * (2 * C)])
def test_token_ids_outside_uint32_are_refused_at_the_edge(bad_tokens, plugins, caplog):
    with LoopbackServer() as server:
        host = InMemoryHost(C)
        plugin = plugins(host, server.url)
        plugin.on_store(LookupKey("s", bad_tokens, MODEL), [b"\x01"], 0)  # never raises
        assert "not indexed" in caplog.text
        # A lookup answers "no reuse" rather than matching wrapped ids, and asks no one.
        assert plugin.cb_unified_lookup(LookupKey("q", bad_tokens, MODEL)) == \
            CBUnifiedLookupResult(0, [])
        assert plugin.stats().errors == 1 and plugin.active_lookups == 0
        plugin.close()
        assert server.requests == []  # nothing reported, nothing asked


def test_an_error_releases_only_the_lookup_it_worked_on(plugins):
    plugin = None

    class RacingHost(InMemoryHost):
        raced = False

        def poll_prefix_lookup(self, request_id):
            if not self.raced:
                self.raced = True
                # Meanwhile this lookup is released elsewhere and another thread starts a new
                # one under the same id; then this call fails.
                assert plugin.cancel(request_id)
                assert plugin.cb_unified_lookup(LookupKey(request_id, fresh(2 * C), MODEL)) is None
                raise RuntimeError("engine hiccup")
            return super().poll_prefix_lookup(request_id)

    plugin = plugins(RacingHost(C, prefix_delay_s=60.0))
    failed = plugin.cb_unified_lookup(LookupKey("r1", fresh(2 * C), MODEL))
    assert failed == CBUnifiedLookupResult(0, [])
    assert plugin.active_lookups == 1  # the new lookup lives on
    assert plugin.cb_unified_lookup(LookupKey("r1", fresh(2 * C), MODEL)) is None


@pytest.mark.parametrize("bad", ["0a0b", 12, bytearray(b"\x01"), None])
def test_chunk_hashes_must_be_bytes(bad, caplog):
    with LoopbackServer() as server:
        host = InMemoryHost(C)
        plugin = make_plugin(host, server.url)
        doc = fresh(2 * C)
        key = LookupKey("s", doc, MODEL)
        with caplog.at_level(logging.ERROR, logger="plugin.plugin"):
            plugin.on_store(key, [b"\x01", bad], 0)  # never raises into the serving path
            plugin.on_evict([bad])
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 2 and all(type(bad).__name__ in e for e in errors), errors
        plugin.on_store(key, [b"\x02"], C)  # a good range afterwards is unaffected
        host.store(key, [b"\x01", b"\x02"], 0)
        result = poll_lookup(plugin, LookupKey("q", doc, MODEL))[0]
        assert [s.hash for s in result.non_prefix_segments] == [b"\x02"]  # the bad range skipped
        plugin.close()  # flushes
        sent = [e["key"]["chunk_hash_hex"] for body in server.bodies("/events")
                for b in body["batches"] for e in b["entries"]]
        assert sent == ["02"]


def test_reported_tokens_survive_the_engine_reusing_its_buffer():
    with LoopbackServer() as server:
        plugin = make_plugin(InMemoryHost(C), server.url)
        buffer = fresh(2 * C)  # uint32: np.asarray would not copy it
        expected = buffer.tolist()
        plugin.on_store(LookupKey("s", buffer, MODEL), [b"\x01", b"\x02"], 0)
        buffer[:] = 7  # the engine reuses its buffer before the flush
        plugin.close()  # flushes
        stored = [e["token_ids"] for body in server.bodies("/events") for b in body["batches"]
                  for e in b["entries"]]
        assert stored == [expected[:C], expected[C:]]


@pytest.mark.parametrize("model, world_size", [("", 1), (MODEL, 0)])
def test_a_namespace_the_coordinator_must_reject_is_not_asked(model, world_size, plugins):
    with LoopbackServer(fleet_reply()) as server:
        host = InMemoryHost(C)
        plugin = plugins(host, server.url)
        doc = fresh(C)
        key = LookupKey("s", doc, model, world_size)
        store(plugin, host, key, [b"\x01"])
        result, _, calls = poll_lookup(plugin, LookupKey("r1", np.concatenate([fresh(3), doc]), model,
                                                 world_size))
        assert [s.hash for s in result.non_prefix_segments] == [b"\x01"]  # local-only
        assert plugin.trace("r1").fleet_status == "not_asked" and calls == 1
        assert plugin.client.stats().submitted == 0
        assert server.bodies(BLEND_LOOKUP_PATH) == []


def test_one_local_matcher_serves_every_namespace(plugins, monkeypatch):
    import plugin.plugin as plugin_module

    made = []

    class CountingMatcher(plugin_module.LocalMatcher):
        def __init__(self, *args, **kwargs):
            made.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(plugin_module, "LocalMatcher", CountingMatcher)
    host = InMemoryHost(C)
    plugin = plugins(host)
    doc = fresh(C)
    for tenant in range(5):
        key = LookupKey(f"s{tenant}", doc, MODEL, cache_salt=f"tenant-{tenant}")
        store(plugin, host, key, [bytes([tenant])])
    assert len(made) == 1
    for tenant in range(5):  # still one tenant's chunk per tenant
        result = poll_lookup(plugin, LookupKey(f"q{tenant}", doc, MODEL, cache_salt=f"tenant-{tenant}"))[0]
        assert [s.hash for s in result.non_prefix_segments] == [bytes([tenant])]


def test_resolve_after_prefetch_lets_an_available_chunk_through(plugins):
    # The leftmost candidate is gone from storage; an overlapping one is available.
    l2 = {b"there": np.zeros(C, dtype=np.uint32)}
    reply = fleet_reply((b"gone", 0, 0), (b"there", 0, 8))
    with LoopbackServer(reply) as server:
        plain = plugins(InMemoryHost(C, shared_l2=l2), server.url)
        better = plugins(InMemoryHost(C, shared_l2=l2), server.url, resolve_after_prefetch=True)
        query = fresh(2 * C)
        assert poll_lookup(plain, LookupKey("r1", query, MODEL))[0].non_prefix_segments == []
        assert poll_lookup(better, LookupKey("r1", query, MODEL))[0].non_prefix_segments == [seg(0, 8, b"there")]
        assert len(better.host.prefetch_requests) == 1


def test_breaker_open_lookups_complete_in_one_call(plugins):
    host = InMemoryHost(C)
    plugin = plugins(host, closed_port_url(), breaker_threshold=1)
    poll_lookup(plugin, LookupKey("first", fresh(2 * C), MODEL))  # refused: opens the breaker
    assert plugin.client.breaker_state == "open"
    result, elapsed, calls = poll_lookup(plugin, LookupKey("second", fresh(2 * C), MODEL))
    assert calls == 1 and plugin.trace("second").fleet_status == "declined"


def test_local_matches_stay_in_their_namespace(plugins):
    host = InMemoryHost(C)
    plugin = plugins(host)
    doc = fresh(C)
    hashes = [b"\x01\x02"]
    stored = LookupKey("s", doc, MODEL, world_size=1, cache_salt="tenant-a")
    store(plugin, host, stored, hashes)
    query = np.concatenate([fresh(3), doc])
    same = poll_lookup(plugin, LookupKey("a", query, MODEL, 1, "tenant-a"))[0]
    assert len(same.non_prefix_segments) == 1
    for other in (LookupKey("b", query, MODEL, 1, "tenant-b"), LookupKey("c", query, "other", 1, "tenant-a"),
                  LookupKey("d", query, MODEL, 2, "tenant-a")):
        assert poll_lookup(plugin, other)[0].non_prefix_segments == []


def test_evicted_chunks_are_no_longer_found_locally(plugins):
    host = InMemoryHost(C)
    plugin = plugins(host)
    doc = fresh(2 * C)
    hashes = save(plugin, host, doc)
    host.evict(hashes[:1])
    plugin.on_evict(hashes[:1])
    result = poll_lookup(plugin, LookupKey("r1", doc, MODEL))[0]
    assert result.non_prefix_segments == [seg(C, C, hashes[1])]
    assert plugin.trace("r1").local_matches == 1


def test_evicting_a_hash_two_namespaces_stored_removes_it_from_both():
    with LoopbackServer() as server:
        host = InMemoryHost(C)
        plugin = make_plugin(host, server.url)
        doc = fresh(C)
        hashes = [b"\x09\x09"]
        tenants = [LookupKey(f"s-{salt}", doc, MODEL, 1, salt) for salt in ("a", "b")]
        for key in tenants:
            store(plugin, host, key, hashes)
        plugin.on_evict(hashes)
        for key in tenants:
            assert poll_lookup(plugin, LookupKey(f"q-{key.cache_salt}", doc, MODEL, 1,
                                         key.cache_salt))[0].non_prefix_segments == []
        plugin.close()  # flushes
        deleted = sorted(e["key"]["cache_salt"] for body in server.bodies("/events")
                         for b in body["batches"] if b["event_type"] == "delete"
                         for e in b["entries"])
        assert deleted == ["a", "b"]


def test_store_and_evict_are_reported_with_offsets():
    with LoopbackServer() as server:
        host = InMemoryHost(C)
        plugin = make_plugin(host, server.url)
        tokens = fresh(3 * C)
        hashes = save(plugin, host, tokens, start=C)  # chunks at 16 and 32
        plugin.on_evict(hashes[:1])
        plugin.close()  # flushes
        batches = [b for body in server.bodies("/events") for b in body["batches"]]
        stores = [e for b in batches if b["event_type"] == "store" for e in b["entries"]]
        deletes = [e for b in batches if b["event_type"] == "delete" for e in b["entries"]]
        assert [(e["token_offset"], e["token_ids"]) for e in stores] == [
            (C, tokens[C:2 * C].tolist()), (2 * C, tokens[2 * C:].tolist())]
        assert [e["key"]["chunk_hash_hex"] for e in deletes] == [hashes[0].hex()]


# --- gating --------------------------------------------------------------------------------------


def _plugin_threads(prefixes=("blend-",)):
    return [t for t in threading.enumerate() if t.name.startswith(prefixes) and t.is_alive()]


def test_no_url_means_local_only_and_no_threads(plugins):
    before = len(_plugin_threads())
    plugin = plugins(InMemoryHost(C))
    assert plugin.client is None and plugin.reporter is None
    assert len(_plugin_threads()) == before
    assert poll_lookup(plugin, LookupKey("r1", fresh(2 * C), MODEL))[0] == CBUnifiedLookupResult(0, [])
    assert plugin.trace("r1").fleet_status == "off"


def test_url_without_event_reporting_warns_once_and_creates_no_client(plugins, caplog):
    caplog.set_level(logging.WARNING)
    before = len(_plugin_threads())
    plugin = plugins(InMemoryHost(C), closed_port_url(), event_reporting=False)
    warnings = [r for r in caplog.records if "EVENT_REPORTING" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert plugin.client is None and plugin.reporter is None
    assert len(_plugin_threads()) == before
    poll_lookup(plugin, LookupKey("r1", fresh(2 * C), MODEL))
    assert len([r for r in caplog.records if "EVENT_REPORTING" in r.getMessage()]) == 1


def test_a_server_that_reports_its_own_events_gets_the_fleet_leg_without_a_second_reporter():
    # LMCache's `lmcache server` reports every placement itself; a second reporter would
    # double-count each chunk. The fleet lookup still runs; stores only feed the matcher.
    with LoopbackServer(lambda path, body: Reply(200, {"matches": []})) as server:
        host = InMemoryHost(C)
        plugin = BlendPlugin(PluginConfig(chunk_size=C, coordinator_url=server.url,
                                          event_reporting=True, instance_id="server-1"),
                             host, report_events=False)
        try:
            assert plugin.client is not None and plugin.reporter is None
            doc = fresh(2 * C)
            save(plugin, host, doc)
            result, _, _ = poll_lookup(plugin, LookupKey("r1", np.concatenate([fresh(3), doc]),
                                                         MODEL))
            assert [s.cur_st for s in result.non_prefix_segments] == [3, 3 + C]
            assert plugin.trace("r1").fleet_status == "ok"
            assert plugin.flush()
        finally:
            plugin.close()
        assert [path for path, _ in server.requests] == [BLEND_LOOKUP_PATH]


def test_default_instance_id_with_the_fleet_leg_warns_once(caplog):
    caplog.set_level(logging.WARNING, logger="plugin.plugin")

    def warnings():
        return [r for r in caplog.records if "LMCACHE_COORDINATOR_INSTANCE_ID" in r.getMessage()]

    with LoopbackServer() as server:
        plugin = make_plugin(InMemoryHost(C), server.url)  # instance_id defaulted
        for i in range(3):
            poll_lookup(plugin, LookupKey(f"r{i}", fresh(2 * C), MODEL))
        plugin.close()
        assert len(warnings()) == 1 and warnings()[0].levelno == logging.WARNING
        assert plugin.config.instance_id in warnings()[0].getMessage()
        caplog.clear()
        make_plugin(InMemoryHost(C), server.url, instance_id="server-7").close()
        make_plugin(InMemoryHost(C)).close()  # no fleet leg: nothing to fence
        assert warnings() == []


def test_close_stops_every_plugin_thread():
    before = _plugin_threads()
    with LoopbackServer(fleet_reply(delay_s=0.1)) as server:
        plugin = make_plugin(InMemoryHost(C), server.url)
        save(plugin, plugin.host, fresh(C))
        poll_lookup(plugin, LookupKey("r1", fresh(2 * C), MODEL))  # a round-trip ran
        assert len(_plugin_threads()) > len(before)
        plugin.close()
        assert _plugin_threads() == before
        assert len(server.bodies("/events")) == 1  # the queued store was flushed on the way


def test_the_local_matcher_indexes_on_the_plugin_pool_and_close_stops_it():
    both = ("blend-", "local-matcher")
    before = set(_plugin_threads(both))  # identities: other tests' threads may come and go
    plugin = make_plugin(InMemoryHost(C))  # local only: one background worker at most
    doc = fresh(2 * C)
    save(plugin, plugin.host, doc)  # schedules the matcher's background indexing
    started = set(_plugin_threads(both)) - before
    assert [t.name.split("_")[0] for t in started] == ["blend-worker"]  # none of the matcher's own
    result, _, _ = poll_lookup(plugin, LookupKey("r1", np.concatenate([fresh(3), doc]), MODEL))
    assert [s.cur_st for s in result.non_prefix_segments] == [3, 3 + C]
    plugin.close()
    assert not any(t.is_alive() for t in started)
