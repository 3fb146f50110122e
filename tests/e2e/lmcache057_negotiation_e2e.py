"""LMCache 0.5.7rc2 only: a chunk size negotiated at registration, end to end.

Run by tests/e2e/test_lmcache057.py in its 0.5.7 child (the file name keeps the suite's own
0.5.6 run from collecting it: 0.5.6 has no negotiation). Two `lmcache server`s with
`--chunk-size 256` whose engines register a model with 48-token blocks: LMCache rounds the
size up to 288 and binds it at the coordinator (`--chunk-size 256` there, the minimum);
the adapter's listener rebuilds each plugin at 288. Then B finds A's document through the
fleet and its own through its local matcher, in 288-token chunks. A third server, C, is
given two coordinator URLs: its registration carries the size to the first.
"""

from __future__ import annotations

import functools

import httpx
import lmcache
import numpy as np
import pytest

from blend_wire import BLEND_LOOKUP_PATH, STATS_PATH, encode_tokens
from coordinator_stub.launch.process import start_coordinator
from helpers import HTTP_TIMEOUT, found, tokens, wait_until
from plugin.harness.lmcache_process import ServerFleet

LANE = "lmcache"

NEGOTIATED = 288  # 256 rounded up to a multiple of 48
settled = functools.partial(wait_until, timeout=60.0, interval=0.05)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    assert lmcache.__version__ == "0.5.7rc2", "run by tests/e2e/test_lmcache057.py on 0.5.7"
    coordinator = start_coordinator("--enable-blend-lookup", "--chunk-size", "256")
    # C is given two URLs, this one first: LMCache's own bind takes one URL, so the
    # plugin's registrar carries the size (issue 32, item 8).
    try:
        other = start_coordinator("--enable-blend-lookup", "--chunk-size", "256")
    except BaseException:
        coordinator.stop()
        raise
    servers = ServerFleet(coordinator_url=coordinator.url, chunk_size=256,
                          l2_dir=str(tmp_path_factory.mktemp("l2")),
                          log_dir=str(tmp_path_factory.mktemp("logs")),
                          module_config={"blend_timeout": 0.5},
                          client_options={"block_size": 48, "chunk_alignment": 48,
                                          "num_blocks": 768})
    try:
        servers.start_many({
            **{name: dict(instance_id=f"server-{name}") for name in ("A", "B")},
            "C": dict(instance_id="server-C",
                      coordinator_url=f"{other.url},{coordinator.url}")})
        servers.url, servers.other_url = coordinator.url, other.url
        yield servers
    finally:
        servers.close()
        coordinator.stop()
        other.stop()


def test_the_negotiated_size_is_bound_everywhere(fleet):
    a, b = fleet.clients["A"], fleet.clients["B"]
    assert a.chunk_size == b.chunk_size == NEGOTIATED
    assert a.status()["chunk_size"] == b.status()["chunk_size"] == NEGOTIATED
    stats = httpx.get(f"{fleet.url}{STATS_PATH}", timeout=HTTP_TIMEOUT).json()
    assert stats["chunk_size"] == NEGOTIATED
    reply = httpx.put(f"{fleet.url}/config/chunk-size", json={"chunk_size": 256},
                      timeout=HTTP_TIMEOUT)
    assert reply.status_code == 409


def test_with_several_urls_the_registration_carries_the_negotiated_size(fleet):
    """Only C speaks to the other coordinator, through the plugin's registrar: its
    registration bound the size LMCache negotiated there."""
    assert fleet.clients["C"].chunk_size == NEGOTIATED
    stats = httpx.get(f"{fleet.other_url}{STATS_PATH}", timeout=HTTP_TIMEOUT).json()
    assert stats["chunk_size"] == NEGOTIATED
    listed = httpx.get(f"{fleet.other_url}/instances", timeout=HTTP_TIMEOUT).json()
    assert [i["instance_id"] for i in listed["instances"]] == ["server-C"]


def test_fleet_and_local_legs_work_at_the_negotiated_size(fleet):
    a, b = fleet.clients["A"], fleet.clients["B"]
    C = NEGOTIATED
    doc_a, doc_b = tokens(2 * C), tokens(C)
    assert a.store(tokens(C) + doc_a, "a-doc")
    assert b.store(tokens(C) + doc_b, "b-doc")

    def fleet_matches(sequence):
        body = {"tokens_b64": encode_tokens(np.asarray(sequence, dtype=np.uint32)),
                "model_name": a.model, "world_size": 1, "cache_salt": ""}
        reply = httpx.post(f"{fleet.url}{BLEND_LOOKUP_PATH}", json=body, timeout=HTTP_TIMEOUT)
        return len(reply.json()["matches"])

    assert settled(lambda: fleet_matches(doc_a) == 2)
    query = tokens(100) + doc_a + tokens(20) + doc_b + tokens(10)
    result, _, _ = b.lookup(query, "b-asks")
    assert found(result) == [(C, 100), (2 * C, 100 + C), (C, 100 + 2 * C + 20)]
    b.end_session("b-asks")
    stats = httpx.get(f"{fleet.url}{STATS_PATH}", timeout=HTTP_TIMEOUT).json()
    assert stats["counters"]["token_lists_wrong_length"] == 0  # every STORE was indexed
