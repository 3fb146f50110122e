"""The candidates form end to end: the bundled coordinator process over HTTP, plugin servers
on `InMemoryHost`s sharing an L2, and LMCache 0.5.6's own coordinator for the fallback.

What users rely on: a document that occurs twice in a prompt (overlapping retrieved
passages), its first occurrence shadowed by an earlier match, is reused at the second; the
default reply stays LMCache's; the candidates reply says where each chunk is held; against a
coordinator without the form the plugin uses the default reply, detected once.
"""

from __future__ import annotations

import itertools
import logging
import time

import httpx
import numpy as np
import pytest

from blend_wire import BLEND_LOOKUP_PATH, encode_tokens
from coordinator_stub.launch.process import launch_coordinator
from helpers import poll_lookup, store
from plugin import BlendPlugin, CBMatchResult, InMemoryHost, LookupKey, PluginConfig
from plugin.replies import found_in
from plugin.types import Place

LANE = "coordinator"

C = 256
DELIVERY_DEADLINE_S = 30.0  # generous: a wait for the event, not a bound on its time
rng = np.random.default_rng(18)
_ids = itertools.count()


def fresh(n: int) -> np.ndarray:
    return rng.integers(1000, 60000, n, dtype=np.uint32)


class Server:
    def __init__(self, name: str, url: str, l2: dict) -> None:
        self.name = name
        self.host = InMemoryHost(C, shared_l2=l2)
        self.plugin = BlendPlugin(PluginConfig(
            chunk_size=C, coordinator_url=url, event_reporting=True, blend_timeout=10.0,
            event_flush_interval=0.05, instance_id=name, breaker_cooldown_s=30.0), self.host)

    def save(self, tokens, model) -> list[bytes]:
        key = LookupKey(f"store-{next(_ids)}", tokens, model)
        hashes = store(self.plugin, self.host, key, self.host.chunk_hashes(key))
        # A flush is one delivery attempt; on loaded cores a coordinator (LMCache's above
        # all) can miss the reporter's HTTP timeout, and the events stay queued for the next.
        deadline = time.monotonic() + DELIVERY_DEADLINE_S
        while not self.plugin.flush():
            assert time.monotonic() < deadline, "cache events not delivered"
            time.sleep(0.1)
        return hashes

    def lookup(self, tokens, model):
        key = LookupKey(f"req-{next(_ids)}", tokens, model)
        result, _, _ = poll_lookup(self.plugin, key)
        return result, self.plugin.trace(key.request_id)


@pytest.fixture
def servers():
    made = []

    def factory(name, url, l2):
        made.append(Server(name, url, l2))
        return made[-1]

    yield factory
    for server in made:
        server.plugin.close()


def overlapping_prompt(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, int, int, int]:
    """Fresh text, `y` cut 56 tokens short (only its first chunk whole), `x`, more text and
    `x` again, as overlapping retrieved passages give. Returns the prompt and where y, x
    (first) and x (second) start."""
    at_y, gap = 40, 90
    at_x1 = at_y + len(y) - 56
    at_x2 = at_x1 + C + gap
    prompt = np.concatenate([fresh(at_y), y[:len(y) - 56], x, fresh(gap), x, fresh(30)])
    return prompt, at_y, at_x1, at_x2


def test_a_repeated_document_is_reused_at_the_occurrence_the_selection_keeps(servers):
    with launch_coordinator("--enable-blend-lookup") as coordinator:
        l2: dict = {}
        a = servers("A", coordinator.url, l2)
        b = servers("B", coordinator.url, l2)
        x, y = fresh(C), fresh(2 * C)
        hx = a.save(x, "m")
        hy = a.save(y, "m")
        prompt, at_y, at_x1, at_x2 = overlapping_prompt(x, y)
        result, trace = b.lookup(prompt, "m")
        assert result.non_prefix_segments == [
            CBMatchResult(0, C, at_y, at_y + C, hy[0]),
            CBMatchResult(0, C, at_x1, at_x1 + C, hx[0])]
        assert trace.fleet_status == "ok" and trace.fleet_matches == 3  # y once, x twice

        # Now a match that shadows x's first occurrence: a chunk z stored at [at_x1 - 100, ..).
        z_start = at_x1 - 100
        z = prompt[z_start:z_start + C].copy()
        hz = a.save(z, "m")
        result, trace = b.lookup(prompt, "m")
        # LMCache's rule would give x's only chunk to at_x1 (dropped: it overlaps z) and
        # nothing to at_x2. Here x is reused at its second occurrence.
        assert [(s.cur_st, s.hash) for s in result.non_prefix_segments] == [
            (at_y, hy[0]), (z_start, hz[0]), (at_x2, hx[0])]
        assert len({s.hash for s in result.non_prefix_segments}) == 3


def test_candidates_reply_names_every_position_and_where_chunks_are_held(servers):
    with launch_coordinator("--enable-blend-lookup") as coordinator:
        a = servers("A", coordinator.url, {})
        x = fresh(C)
        hx = a.save(x, "m")
        query = np.concatenate([fresh(10), x, fresh(5), x])
        body = {"tokens_b64": encode_tokens(query), "model_name": "m"}
        with httpx.Client(base_url=coordinator.url, timeout=10) as http:
            default = http.post(BLEND_LOOKUP_PATH, json=body)
            candidates = http.post(BLEND_LOOKUP_PATH, json={**body, "candidates": True})
            other_tenant = http.post(BLEND_LOOKUP_PATH,
                                     json={**body, "cache_salt": "t2", "candidates": True})
        # The default form is LMCache's, byte for byte: one chunk, named once.
        assert default.content == (b'{"matches":[{"chunk_hash":"' + hx[0].hex().encode()
                                   + b'","old_st":0,"cur_st":10}]}')
        assert candidates.json() == {"chunk_size": C, "candidates": [
            {"positions": [10, 10 + C + 5], "chunks": [
                {"chunk_hash": hx[0].hex(), "old_st": 0, "l1": ["A"]}]}]}
        assert other_tenant.json() == {"chunk_size": C, "candidates": []}


def test_the_columns_reply_says_what_the_objects_reply_says(servers):
    with launch_coordinator("--enable-blend-lookup") as coordinator:
        l2: dict = {}
        a = servers("A", coordinator.url, l2)
        b = servers("B", coordinator.url, l2)
        x, y = fresh(2 * C), fresh(C)
        hx, hy = a.save(x, "m"), b.save(y, "m")
        query = np.concatenate([fresh(10), x, fresh(5), y, x[:C], fresh(20)])
        body = {"tokens_b64": encode_tokens(query), "model_name": "m", "candidates": True}
        with httpx.Client(base_url=coordinator.url, timeout=10) as http:
            objects = http.post(BLEND_LOOKUP_PATH, json=body)
            columns = http.post(BLEND_LOOKUP_PATH, json={**body, "columns": True})
        assert set(columns.json()) == {"chunk_size", "columns"}
        assert len(columns.content) < len(objects.content)
        read = [found_in(reply.content, coordinator.url, chunk_size=C, instance_id="A",
                         num_tokens=len(query)) for reply in (objects, columns)]
        assert read[1].contents == read[0].contents and read[1].dropped == 0
        assert read[1].contents.chunk_hashes == [hx[0], hx[1], hy[0]]
        assert read[1].contents.chunk_place.tolist() == [Place.THIS_SERVER, Place.THIS_SERVER,
                                                         Place.PEER]
        # The plugin asks for columns: B reuses x's chunks (twice its first) and its own y.
        result, trace = b.lookup(query, "m")
        assert [(s.cur_st, s.hash) for s in result.non_prefix_segments] == [
            (10, hx[0]), (10 + C, hx[1]), (10 + 2 * C + 5, hy[0])]
        assert trace.fleet_status == "ok"


@pytest.mark.lmcache
@pytest.mark.lmcache  # LMCache 0.5.6's own coordinator process
def test_against_lmcache_coordinator_the_default_form_is_detected_once(servers, caplog):
    reference = pytest.importorskip("benchmarks.lmcache_reference")
    if reference.lmcache_version() is None:
        pytest.fail("LMCache 0.5.6 is installed by `make test`; this test needs its coordinator")
    caplog.set_level(logging.INFO, logger="plugin.client")
    coordinator = reference.start_lmcache_coordinator(C)
    try:
        l2: dict = {}
        a = servers("A", coordinator.url, l2)
        b = servers("B", coordinator.url, l2)
        docs = [fresh(C) for _ in range(3)]
        hashes = [a.save(doc, "m")[0] for doc in docs]
        for i in range(3):
            prompt = np.concatenate([fresh(7), docs[i], fresh(3)])
            result, trace = b.lookup(prompt, "m")
            assert trace.fleet_status == "ok"
            assert result.non_prefix_segments == [CBMatchResult(0, C, 7, 7 + C, hashes[i])]
        detected = [r for r in caplog.records if "default form" in r.getMessage()]
        assert len(detected) == 1, [r.getMessage() for r in detected]
    finally:
        coordinator.stop()
