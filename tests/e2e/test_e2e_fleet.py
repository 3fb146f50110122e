"""End to end: the bundled coordinator process, real HTTP, two or three plugin servers.

Each server is a `BlendPlugin` over its own `InMemoryHost`; hosts share one L2 dict where a
test needs server B to fetch what server A stored. Namespaces (model names) differ per test so
one coordinator process can serve the whole module.
"""

from __future__ import annotations

import itertools
import time

import httpx
import numpy as np
import pytest

from coordinator_stub.launch.process import CoordinatorProcess, launch_coordinator, start_coordinator
from helpers import NOT_HUNG_S, HangingServer, poll_lookup, store, wait_until
from plugin import BlendPlugin, CBMatchResult, InMemoryHost, LookupKey, PluginConfig

LANE = "coordinator"

C = 256
BUDGET = 0.3
rng = np.random.default_rng(11)
_models = itertools.count()


def fresh(n: int) -> np.ndarray:
    return rng.integers(1000, 60000, n, dtype=np.uint32)


@pytest.fixture(scope="module")
def shared_coordinator():
    with launch_coordinator("--enable-blend-lookup") as running:
        yield running


@pytest.fixture
def model():
    return f"model-{next(_models)}"


class Server:
    """One serving process: an engine-side host and the plugin it loaded."""

    def __init__(self, name: str, url: str | None, l2: dict | None, **overrides) -> None:
        options = dict(chunk_size=C, coordinator_url=url, event_reporting=url is not None,
                       blend_timeout=BUDGET, event_flush_interval=0.05, instance_id=name,
                       breaker_cooldown_s=30.0)
        options.update(overrides)
        self.host = InMemoryHost(C, shared_l2=l2)
        self.plugin = BlendPlugin(PluginConfig(**options), self.host)
        self._ids = itertools.count()

    def save(self, tokens, model, salt="", world_size=1) -> list[bytes]:
        """Store a whole sequence (a document) as the engine would, from position 0."""
        key = LookupKey(f"store-{next(self._ids)}", tokens, model, world_size, salt)
        return store(self.plugin, self.host, key, self.host.chunk_hashes(key))

    def evict(self, hashes) -> None:
        self.host.evict(hashes)
        self.plugin.on_evict(hashes)

    def lookup(self, tokens, model, salt="", world_size=1):
        """(result, trace, seconds, calls) of one lookup polled to completion."""
        key = LookupKey(f"req-{next(self._ids)}", tokens, model, world_size, salt)
        result, elapsed, calls = poll_lookup(self.plugin, key, world_size, timeout=NOT_HUNG_S)
        return result, self.plugin.trace(key.request_id), elapsed, calls


@pytest.fixture
def servers():
    made = []

    def factory(name, url, l2=None, **overrides):
        made.append(Server(name, url, l2, **overrides))
        return made[-1]

    yield factory
    for server in made:
        server.plugin.close()


def segments_of(hashes, old_starts, cur_st):
    return [CBMatchResult(o, o + C, cur_st + i * C, cur_st + (i + 1) * C, h)
            for i, (h, o) in enumerate(zip(hashes, old_starts))]


def test_server_b_finds_server_a_documents_through_the_fleet(shared_coordinator, servers, model):
    l2 = {}
    a = servers("A", shared_coordinator.url, l2)
    b = servers("B", shared_coordinator.url, l2)
    doc1, doc2, doc3 = fresh(2 * C), fresh(2 * C), fresh(C)
    h1, h2 = a.save(doc1, model), a.save(doc2, model)
    h3 = b.save(doc3, model)
    assert a.plugin.flush() and b.plugin.flush()

    # A RAG prompt on B: A's documents in shuffled order between fresh text, plus B's own.
    pieces = [fresh(100), doc2, fresh(37), doc3, fresh(50), doc1, fresh(20)]
    query = np.concatenate(pieces)
    at2, at3, at1 = 100, 100 + 2 * C + 37, 100 + 2 * C + 37 + C + 50
    result, trace, _, _ = b.lookup(query, model)

    assert result.prefix_coverage_tokens == 0
    assert result.non_prefix_segments == (segments_of(h2, [0, C], at2) + segments_of(h3, [0], at3)
                                          + segments_of(h1, [0, C], at1))
    # A's chunks came from the fleet, B's own from its local matcher (the coordinator knows them
    # too, since B reports its stores: they collapse into one).
    assert trace.sources == ["fleet", "fleet", "both", "fleet", "fleet"]
    assert trace.local_matches == 1 and trace.fleet_matches == 5

    # Local-only B (same host, no coordinator) would find its own document alone.
    local_only = servers("B-local", None, l2)
    local_only.plugin.on_store(LookupKey("s", doc3, model), h3, 0)
    alone, _, _, _ = local_only.lookup(query, model)
    assert alone.non_prefix_segments == segments_of(h3, [0], at3)


def test_tenants_models_and_world_sizes_never_see_each_other(shared_coordinator, servers, model):
    l2 = {}
    a = servers("A", shared_coordinator.url, l2)
    b = servers("B", shared_coordinator.url, l2)
    doc = fresh(2 * C)
    hashes = a.save(doc, model, salt="tenant-1", world_size=2)
    assert a.plugin.flush()
    query = np.concatenate([fresh(64), doc])
    found, trace, _, _ = b.lookup(query, model, "tenant-1", 2)
    assert [s.hash for s in found.non_prefix_segments] == hashes
    for salt, name, world_size in [("tenant-2", model, 2), ("", model, 2),
                                   ("tenant-1", model + "-other", 2), ("tenant-1", model, 1)]:
        result, trace, _, _ = b.lookup(query, name, salt, world_size)
        assert trace.fleet_status == "ok" and trace.fleet_matches == 0, (salt, name, world_size)
        assert result.non_prefix_segments == []


def test_evicted_chunk_is_no_longer_offered(shared_coordinator, servers, model):
    l2 = {}
    a = servers("A", shared_coordinator.url, l2)
    b = servers("B", shared_coordinator.url, l2)
    doc = fresh(2 * C)
    hashes = a.save(doc, model)
    assert a.plugin.flush()
    query = np.concatenate([fresh(10), doc])
    assert b.lookup(query, model)[1].fleet_matches == 2
    a.evict(hashes[:1])
    assert a.plugin.flush()
    result, trace, _, _ = b.lookup(query, model)
    assert trace.fleet_matches == 1
    assert [s.hash for s in result.non_prefix_segments] == hashes[1:]


def test_events_reach_the_coordinator_in_the_background(shared_coordinator, servers, model):
    a = servers("A", shared_coordinator.url)
    b = servers("B", shared_coordinator.url)
    doc = fresh(C)
    a.save(doc, model)  # no explicit flush: the 0.05 s background flush delivers it
    assert wait_until(lambda: b.lookup(doc, model)[1].fleet_matches == 1, timeout=3.0)


def test_a_restarted_server_fences_its_previous_incarnation(shared_coordinator, servers, model):
    a = servers("A-restarts", shared_coordinator.url)
    b = servers("B", shared_coordinator.url)
    old_doc, new_doc = fresh(C), fresh(C)
    a.save(old_doc, model)
    assert a.plugin.flush()
    assert b.lookup(old_doc, model)[1].fleet_matches == 1
    a.plugin.close()
    # Same instance id, new process: its first batch fences what the old one reported.
    a2 = servers("A-restarts", shared_coordinator.url)
    assert a2.plugin.reporter.incarnation > a.plugin.reporter.incarnation
    a2.save(new_doc, model)
    assert a2.plugin.flush()
    assert b.lookup(old_doc, model)[1].fleet_matches == 0
    assert b.lookup(new_doc, model)[1].fleet_matches == 1


def test_coordinator_stopped_then_restarted(servers, model):
    l2 = {}
    with launch_coordinator("--enable-blend-lookup") as first:
        port = int(first.url.rsplit(":", 1)[1])
        # The cool-down must outlast the "breaker open" checks below on a loaded machine.
        a = servers("A", first.url, l2, breaker_threshold=2, breaker_cooldown_s=2.0)
        b = servers("B", first.url, l2, breaker_threshold=2, breaker_cooldown_s=2.0)
        mine = fresh(C)
        b.save(mine, model)
        a.save(fresh(C), model)
        assert a.plugin.flush() and b.plugin.flush()
        first.stop()

    # Down: lookups complete local-only, on the budget (not waiting for an answer)...
    query_tail = fresh(C)
    query = np.concatenate([fresh(40), mine, query_tail])
    for _ in range(2):
        result, trace, _, _ = b.lookup(query, model)
        assert trace.fleet_status in ("failed", "timeout") and trace.sources == ["local"]
    # The lookup may give up a hair before the client's worker records the refusal.
    assert wait_until(lambda: b.plugin.client.breaker_state == "open", 5.0)
    # ...then at local-only speed: one call, no coordinator wait.
    for _ in range(5):
        result, trace, _, calls = b.lookup(query, model)
        assert calls == 1 and trace.fleet_status == "declined"
        assert [s.hash for s in result.non_prefix_segments] == b.host.chunk_hashes(
            LookupKey("x", mine, model))
    # A keeps storing while the coordinator is away; its events wait in the queue.
    late_doc = fresh(C)
    late_hashes = a.save(late_doc, model)
    assert not a.plugin.flush()

    restarted = _restart_on(port)
    try:
        # The queued events are delivered to the new process, once A's reporter has sat out
        # its bench (it failed twice: the one fail-over policy, plugin.http) and probed.
        assert wait_until(a.plugin.flush, timeout=10.0, interval=0.05)
        # After the cool-down one probe closes the breaker and the fleet leg is back.
        def fleet_back():
            result, trace, _, _ = b.lookup(np.concatenate([fresh(8), late_doc, query_tail]), model)
            return trace.fleet_status == "ok" and [s.hash for s in result.non_prefix_segments] == late_hashes
        assert wait_until(fleet_back, timeout=10.0, interval=0.05)
        assert b.plugin.client.breaker_state == "closed"
    finally:
        restarted.stop()


def _restart_on(port: int, attempts: int = 5) -> CoordinatorProcess:
    """The coordinator again on `port`; something else may hold it for a moment, so retry."""
    for attempt in range(attempts):
        try:
            return start_coordinator("--enable-blend-lookup", port=port)
        except RuntimeError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.5)


@pytest.mark.unit
def test_hanging_coordinator_never_delays_a_lookup_past_the_budget(servers, model):
    with HangingServer() as hanging:
        # Event POSTs get the lookup budget as their deadline too, so close() is quick.
        b = servers("B", hanging.url, event_timeout=BUDGET)
        mine = fresh(C)
        hashes = b.save(mine, model)
        for i in range(4):
            query = np.concatenate([fresh(5 + i), mine, fresh(C)])
            result, trace, _, _ = b.lookup(query, model)  # it completes: not hung
            assert [s.hash for s in result.non_prefix_segments] == hashes
            assert trace.fleet_status in ("timeout", "failed", "declined")
        started = time.monotonic()
        b.plugin.close()  # its event flushes meet the hanging server too: bounded
        # Round-trips in flight end within the budget; a flush in flight, then the last one,
        # each within the events' own deadline (background work: not the lookup budget).
        assert time.monotonic() - started < NOT_HUNG_S


def test_coordinator_stats_see_what_the_servers_stored(shared_coordinator, servers, model):
    a = servers("A-stats", shared_coordinator.url)
    before = httpx.get(shared_coordinator.url + "/directory/stats").json()["blend"]["num_chunks"]
    a.save(fresh(3 * C), model)
    assert a.plugin.flush()
    after = httpx.get(shared_coordinator.url + "/directory/stats").json()["blend"]["num_chunks"]
    assert after - before == 3
