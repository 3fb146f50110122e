"""End to end on real LMCache MP servers loading the plugin (`--server-module`): LMCache
0.5.6 here, and the same scenarios on 0.5.7rc2 when tests/e2e/test_lmcache057.py runs this file
in a process importing that version (the servers run the LMCache this process imports).

Processes, all on free loopback ports: the bundled coordinator; servers A and B started as
`lmcache server` (HTTP front end: registration, LMCache's own tier-aware cache events) with a
shared filesystem L2; server C started ZMQ-only (`python -m lmcache.v1.multiprocess.server`),
where the plugin reports events itself. Each client is an engine worker with a CPU KV cache
in shared memory, speaking LMCache's own client API.

The servers are shared by the whole module (starting one costs seconds), so the tests run in
file order and later ones build on the state earlier ones leave: the coordinator outage, the
side-by-side, the L1 eviction and A's restart come last. Every test uses its own documents.
"""

from __future__ import annotations

import functools
import os

import httpx
import lmcache
import numpy as np
import pytest
import torch

from blend_wire import BLEND_LOOKUP_PATH, DIRECTORY_LOOKUP_PATH, INSTANCES_PATH, encode_tokens
from coordinator_stub.launch.process import start_coordinator
from helpers import HTTP_TIMEOUT, found, tokens, wait_until
from plugin.harness.lmcache_process import ServerFleet

LANE = "lmcache"

C = 256
MODEL = "fleet-model"  # EngineClient's default model
BUDGET = 0.5
MARGIN = 1.5  # "within budget, not hung": generous for a loaded 2-core CI machine
# An outcome that crosses several processes (engine -> server -> coordinator): generous, as a
# loaded 2-core machine is slow; polled every 50 ms (each poll is an RPC or an HTTP request).
settled = functools.partial(wait_until, timeout=60.0, interval=0.05)


class Fleet(ServerFleet):
    """The module's processes: the coordinator, servers A and B (`lmcache server`) and C
    (ZMQ-only); `restart(name)` and `restart_coordinator()` replace one in place."""

    def __init__(self, tmp_path_factory) -> None:
        self.l2_dir = str(tmp_path_factory.mktemp("shared-l2"))
        self.coordinator = start_coordinator("--enable-blend-lookup")
        self.url = self.coordinator.url
        # One client for the tests' requests (`httpx.post(...)` builds one, SSL context and
        # all, ~45 ms, per call: each poll of a wait). No keep-alive: no connection outlives
        # the coordinator it went to (it is restarted on the same port).
        self.http = httpx.Client(timeout=HTTP_TIMEOUT,
                                 limits=httpx.Limits(max_keepalive_connections=0))
        super().__init__(coordinator_url=self.url, l2_dir=self.l2_dir,
                         log_dir=str(tmp_path_factory.mktemp("lmcache-logs")))
        try:
            self.start_many({
                **{name: dict(instance_id=f"server-{name}",
                              module_config={"builtin_lookup": True, "blend_timeout": BUDGET})
                   for name in ("A", "B")},
                "C": dict(front_end=False, instance_id="server-C",
                          module_config={"blend_timeout": BUDGET})})
        except BaseException:
            self.close()  # no process outlives a failed set-up
            raise

    def restart_coordinator(self) -> None:
        port = self.coordinator.port
        self.coordinator.stop()
        self.coordinator = start_coordinator("--enable-blend-lookup", port=port)

    def fleet_matches(self, sequence: list[int], model: str = MODEL) -> int:
        """How many chunks of `sequence` the coordinator's blend index offers."""
        body = {"tokens_b64": encode_tokens(np.asarray(sequence, dtype=np.uint32)),
                "model_name": model, "world_size": 1, "cache_salt": ""}
        reply = self.http.post(f"{self.url}{BLEND_LOOKUP_PATH}", json=body)
        return len(reply.json()["matches"])

    def directory(self, sequence: list[int]) -> list[dict]:
        """The coordinator's record of each chunk of `sequence` (its key, its placements);
        the tokens form hashes them as LMCache does."""
        body = {"token_ids": sequence, "model_name": MODEL, "world_size": 1}
        reply = self.http.post(f"{self.url}{DIRECTORY_LOOKUP_PATH}", json=body)
        return reply.json()["results"]

    def placements(self, sequence: list[int]) -> list[dict]:
        """Every placement of `sequence`'s chunks."""
        return [p for result in self.directory(sequence) for p in result["placements"]]

    def instances(self) -> list[str]:
        reply = self.http.get(f"{self.url}{INSTANCES_PATH}")
        return [i["instance_id"] for i in reply.json()["instances"]]

    def in_l2(self, sequence: list[int]) -> bool:
        """Every chunk of `sequence` has an L2 placement, so its file is complete: LMCache's
        fs L2 writes `<key>.tmp`, renames it, and only then reports the L2 store."""
        results = self.directory(sequence)
        return len(results) == len(sequence) // C and all(
            any(p["tier"] == "l2" for p in result["placements"]) for result in results)

    def l2_files_written(self) -> int:
        """Complete files in the shared L2 folder (not LMCache's `<key>.tmp` in progress)."""
        return sum(not name.endswith(".tmp")
                   for _, _, names in os.walk(self.l2_dir) for name in names)

    def store_and_wait(self, name: str, sequence: list[int], request_id: str) -> None:
        """Store on one server; wait until the coordinator indexed it and L2 holds it (a
        peer can load it from there)."""
        chunks = len(sequence) // C
        assert self.clients[name].store(sequence, request_id)
        assert settled(lambda: self.fleet_matches(sequence) == chunks)
        assert settled(lambda: self.in_l2(sequence))

    def close(self) -> None:
        super().close()
        self.coordinator.stop()
        self.http.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with Fleet(tmp_path_factory) as running:
        yield running


def test_each_server_runs_the_plugin_with_exactly_one_event_reporter(fleet):
    a, c = fleet.clients["A"].status(), fleet.clients["C"].status()
    # The servers run the LMCache this process speaks to them with.
    assert a["lmcache_version"] == c["lmcache_version"] == lmcache.__version__
    # `lmcache server` reports cache events itself: the plugin adds no second stream.
    assert a["reporting"] == "lmcache" and a["lmcache_coordinator_client"] == "open"
    # The ZMQ-only server has no reporter of its own: the plugin's reports, and LMCache's
    # coordinator client (whose lookup is replaced) is closed.
    assert c["reporting"] == "plugin" and c["lmcache_coordinator_client"] == "closed"
    # Registration and heartbeats stay LMCache's: both `lmcache server`s are listed; the
    # ZMQ-only entry point has no HTTP front end and does not register.
    assert settled(lambda: {"server-A", "server-B"} <= set(fleet.instances()))
    assert "server-C" not in fleet.instances()
    if lmcache.__version__ != "0.5.6":
        # LMCache 0.5.7 binds its negotiated chunk size at the coordinator (PUT
        # /config/chunk-size, and in each registration): another size is refused now.
        reply = httpx.put(f"{fleet.url}/config/chunk-size", json={"chunk_size": 2 * C},
                          timeout=HTTP_TIMEOUT)
        assert reply.status_code == 409 and f"bound to chunk size {C}" in reply.text


def test_b_finds_a_document_stored_behind_another_prefix_on_a(fleet):
    a, b = fleet.clients["A"], fleet.clients["B"]
    system_a, doc = tokens(C), tokens(3 * C)
    fleet.store_and_wait("A", system_a + doc, "a-doc")
    before = b.status()
    query = tokens(100) + doc + tokens(40)  # another prefix, not chunk-aligned
    result, seconds, _ = b.lookup(query, "b-finds-doc")
    # All three chunks, at their new positions, from the fleet leg (B never stored them).
    assert result.prefix_coverage_tokens == 0
    assert found(result) == [(256, 100), (512, 356), (768, 612)]
    after = b.status()
    assert after["plugin"]["segments_fleet_only"] - before["plugin"]["segments_fleet_only"] == 3
    # Prefetched: read-locked in B's L1 for the retrieve that follows, as LMCache leaves them.
    assert after["l1_read_locked"] >= before["l1_read_locked"] + 3
    # The engine's retrieve consumes them. (On a CPU-only machine LMCache 0.5.6's CacheBlend
    # scatter kernel is GPU-only, so it answers "not scattered" and the engine recomputes; the
    # locks are released either way.)
    b.retrieve_blend(query, "b-finds-doc", result.non_prefix_segments)
    assert b.status()["l1_read_locked"] == before["l1_read_locked"]
    # The bytes B can load for those chunks are the KV A stored (through the shared L2).
    loaded = b.retrieve_prefix(system_a + doc, "b-loads-a-doc", 4)
    assert loaded is not None
    assert all(torch.equal(loaded[c], a.chunk_kv("a-doc", c)) for c in range(4))


def test_a_passage_repeated_in_the_prompt_is_reused_where_the_selection_keeps_it(fleet):
    # Overlapping retrieved passages: x occurs twice in B's prompt, and its first occurrence
    # overlaps a match (z, a window that runs into x) that the selection keeps. LMCache's
    # rule names x's chunk at its first occurrence, which is then dropped; ours names it at
    # the second. The chunks are A's (B gets them through the fleet and the shared L2).
    b = fleet.clients["B"]
    x = tokens(C)
    prompt = tokens(150) + x + tokens(90) + x + tokens(30)
    at_x2 = 150 + C + 90
    z = prompt[50:50 + C]
    fleet.store_and_wait("A", tokens(C) + x, "a-passage-x")
    fleet.store_and_wait("A", tokens(C) + z, "a-window-z")
    baseline = b.status()["l1_read_locked"]
    ours, _, _ = b.lookup(prompt, "b-repeated-ours")
    assert found(ours) == [(C, 50), (C, at_x2)]
    assert len({s.hash for s in ours.non_prefix_segments}) == 2  # each chunk named once
    theirs, _, _ = b.lookup(prompt, "b-repeated-builtin", builtin=True)
    assert found(theirs) == [(C, 50)]  # x's chunk spent on the dropped first occurrence
    b.end_session("b-repeated-builtin")
    # LMCache's sparse prefetch loaded and read-locked both chunks; its retrieve takes them.
    assert b.status()["l1_read_locked"] >= baseline + 2
    b.retrieve_blend(prompt, "b-repeated-ours", ours.non_prefix_segments)
    assert settled(lambda: b.status()["l1_read_locked"] == baseline)


def test_an_unknown_document_finds_nothing(fleet):
    result, _, _ = fleet.clients["B"].lookup(tokens(5 * C), "b-unknown")
    assert result.prefix_coverage_tokens == 0 and found(result) == []


def test_another_cache_salt_finds_nothing(fleet):
    doc = tokens(2 * C)
    fleet.store_and_wait("A", tokens(C) + doc, "a-salted-doc")
    b = fleet.clients["B"]
    query = tokens(30) + doc
    other, _, _ = b.lookup(query, "b-other-salt", salt="tenant-2")
    assert found(other) == []
    same, _, _ = b.lookup(query, "b-same-salt")
    assert len(found(same)) == 2  # the document is there for its own tenant
    for rid in ("b-other-salt", "b-same-salt"):
        b.end_session(rid)  # no retrieve follows: release the read locks


def test_an_abandoned_lookup_releases_its_locks(fleet):
    b = fleet.clients["B"]
    prefix = tokens(2 * C)
    fleet.store_and_wait("A", prefix, "a-prefix")
    start = b.status()
    baseline = start["l1_read_locked"]

    def released(counter: str, before: dict):
        """B's status once one more lookup was `counter` and its two prefix read locks were
        released (False while not): outcomes the plugin and host count, so no intermediate
        state has to be caught in time (the sweep may release a lookup at any moment)."""
        s = b.status()
        return (s["plugin"][counter] > before["plugin"][counter]
                and s["host"].get("released_prefix_chunks", 0)
                >= before["host"].get("released_prefix_chunks", 0) + 2
                and s["l1_read_locked"] == baseline and s)

    # The engine starts a lookup whose prefix is cached (the prefix leg loads it from the
    # shared L2 and read-locks it), then drops the request: its session ends, maybe while
    # the prefix is still loading (then its locks go as soon as it lands).
    key = b.key(prefix + tokens(C), "b-abandoned", worker=None)
    b.lookup_once(key)
    b.end_session("b-abandoned")
    status = settled(lambda: released("cancelled", start))
    assert status, "the cancelled lookup's read locks were not released"
    assert status["host"]["in_flight"] == 0 and status["host"]["releasing"] == 0
    # A lookup nobody polls again and whose session never ends is released after
    # `abandon_after_s` (four match budgets) with no later lookup: the plugin's sweep task
    # releases it and its read locks (the status RPC only reads).
    before = status
    key = b.key(prefix + tokens(2 * C), "b-forgotten", worker=None)
    b.lookup_once(key)
    status = settled(lambda: released("abandoned", before))
    assert status, "the abandoned lookup's read locks were not released"
    assert status["host"]["in_flight"] == 0
    assert status["plugin"]["active_lookups"] == 0
    # A completed lookup whose retrieve never comes is released when its session ends too.
    doc = tokens(2 * C)
    fleet.store_and_wait("A", tokens(C) + doc, "a-doc-unretrieved")
    result, _, _ = b.lookup(tokens(50) + doc, "b-unretrieved")
    assert len(found(result)) == 2
    assert b.status()["l1_read_locked"] >= baseline + 2
    b.end_session("b-unretrieved")
    assert settled(lambda: b.status()["l1_read_locked"] == baseline)


def test_zmq_only_server_reports_its_l1_and_l2_placements_itself(fleet):
    c, b = fleet.clients["C"], fleet.clients["B"]
    sequence = tokens(2 * C)
    fleet.store_and_wait("C", sequence, "c-doc")
    places = lambda: {(p["instance_id"], p["tier"], p["backend"])
                      for p in fleet.placements(sequence)}
    # Each chunk's L1 and L2 placement, reported by the plugin with its tier and backend.
    assert settled(lambda: places() == {("server-C", "l1", "dram"), ("server-C", "l2", "fs")})
    assert c.status()["tracked_chunks"] >= 2
    # An L1 eviction is a DELETE for tier L1 only; the L2 copies stay, so C keeps the chunks
    # in its local matcher and the fleet still offers them.
    c.clear_l1()
    assert settled(lambda: places() == {("server-C", "l2", "fs")})
    assert c.status()["tracked_chunks"] >= 2
    result, _, _ = b.lookup(tokens(70) + sequence, "b-finds-c-doc")
    assert [cur for _, cur in found(result)] == [70, 70 + C]


def test_coordinator_down_b_answers_within_budget_local_only(fleet):
    b = fleet.clients["B"]
    remote_doc = tokens(2 * C)
    fleet.store_and_wait("A", tokens(C) + remote_doc, "a-doc-before-outage")
    fleet.coordinator.stop()
    local_doc = tokens(2 * C)
    files = fleet.l2_files_written()
    assert b.store(tokens(C) + local_doc, "b-doc-during-outage")  # its events are lost
    # LMCache writes L2 in the background and reports that store when it is done: wait for
    # it, so those events too are lost in the outage rather than delivered after the next
    # test restarts the coordinator (seen under load: LMCache's lookup then found B's doc).
    assert settled(lambda: fleet.l2_files_written() >= files + 3)
    fleet.local_doc = local_doc
    before = b.status()["plugin"]
    query = tokens(20) + remote_doc + tokens(20) + local_doc
    result, seconds, _ = b.lookup(query, "b-outage")
    assert seconds < BUDGET + MARGIN
    # Local only: its own document, not A's.
    assert found(result) == [(256, 20 + 2 * C + 20), (512, 20 + 3 * C + 20)]
    after = b.status()["plugin"]["fleet_outcomes"]
    before = before["fleet_outcomes"]
    assert sum(after.get(k, 0) - before.get(k, 0) for k in ("failed", "timeout", "declined")) == 1


def test_side_by_side_ours_covers_strictly_more_than_lmcache_builtin(fleet):
    # After the outage the coordinator knows what was stored since (A's new document), not
    # what B stored meanwhile; B's local matcher knows that. Ours takes both legs; LMCache's
    # built-in lookup in coordinator mode asks the coordinator only.
    fleet.restart_coordinator()
    b = fleet.clients["B"]
    new_doc = tokens(3 * C)
    fleet.store_and_wait("A", tokens(C) + new_doc, "a-doc-after-outage")
    query = tokens(64) + new_doc + tokens(16) + fleet.local_doc + tokens(32)
    ours, ours_s, _ = b.lookup(query, "b-side-ours")
    theirs, theirs_s, _ = b.lookup(query, "b-side-builtin", builtin=True)
    ours_tokens = sum(s.cur_ed - s.cur_st for s in ours.non_prefix_segments)
    theirs_tokens = sum(s.cur_ed - s.cur_st for s in theirs.non_prefix_segments)
    print(f"\n{'lookup':<28}{'reused tokens':>14}{'of':>6}{'ms':>8}")
    print(f"{'ours (local + fleet)':<28}{ours_tokens:>14}{len(query):>6}{ours_s * 1e3:>8.1f}")
    print(f"{'LMCache built-in (coord.)':<28}{theirs_tokens:>14}{len(query):>6}{theirs_s * 1e3:>8.1f}")
    assert ours_tokens == 5 * C and theirs_tokens == 3 * C
    assert ours_tokens > theirs_tokens
    for rid in ("b-side-ours", "b-side-builtin"):
        b.end_session(rid)


def test_after_an_l1_eviction_on_a_with_the_l2_copy_kept_b_still_finds_it(fleet):
    a, b = fleet.clients["A"], fleet.clients["B"]
    doc = tokens(2 * C)
    fleet.store_and_wait("A", tokens(C) + doc, "a-doc-evicted")
    tracked = a.status()["tracked_chunks"]
    a.clear_l1()
    assert settled(lambda: a.status()["l1_objects"] == 0)
    # L2 still holds them: A's local matcher keeps them, and the fleet still offers them.
    assert a.status()["tracked_chunks"] == tracked
    result, _, _ = b.lookup(tokens(10) + doc, "b-after-a-eviction")
    assert found(result) == [(256, 10), (512, 10 + C)]
    own, _, _ = a.lookup(tokens(10) + doc, "a-after-eviction")
    assert found(own) == [(256, 10), (512, 10 + C)]


def test_a_restarted_its_old_l1_placements_are_fenced(fleet):
    sequence = tokens(C) + tokens(2 * C)
    fleet.store_and_wait("A", sequence, "a-doc-before-restart")
    tiers = lambda: {(p["instance_id"], p["tier"]) for p in fleet.placements(sequence)}
    assert settled(lambda: {("server-A", "l1"), ("server-A", "l2")} <= tiers())
    fleet.restart("A")  # SIGTERM: LMCache deregisters, then a new process starts
    # The old process's L1 died with it. (Its L2 copies are the coordinator's call: LMCache's
    # keeps them; the bundled one fences every placement of an older incarnation, so when the
    # old process's last events land after its deregistration, they go too.)
    assert settled(lambda: ("server-A", "l1") not in tiers())
    # The new process is registered again, serves the plugin, and its documents are found.
    assert settled(lambda: "server-A" in fleet.instances())
    assert fleet.clients["A"].status()["reporting"] == "lmcache"
    new_doc = tokens(2 * C)
    fleet.store_and_wait("A", tokens(C) + new_doc, "a-after-restart")
    result, _, _ = fleet.clients["B"].lookup(tokens(40) + new_doc, "b-after-a-restart")
    assert [cur for _, cur in found(result)] == [40, 40 + C]
