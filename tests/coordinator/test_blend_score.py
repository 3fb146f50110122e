"""`POST /directory/blend-score` (issue 23): which instance should serve a request.

What a router relies on: every registered instance is scored by what its unified lookup
would reuse (its prefix leg, then the plugin's selection with this instance's L1 first,
shared tiers next, peers last), best first; the score is namespaced; instances that left are
not listed; bad input is refused with a reason. The per-instance figures are checked against
an independent path: the candidates form of the blend lookup, `/directory/lookup`'s tokens
form and the plugin's own selection (`plugin.lookup.select`), over random workloads.
"""

from __future__ import annotations

import numpy as np
import pytest

from blend_wire import (
    BLEND_LOOKUP_PATH,
    BLEND_SCORE_PATH,
    INSTANCES_PATH,
    encode,
    encode_tokens,
    prefix_chunk_hashes,
)
from coordinator_client import C, batch
from coordinator_client import entry as wire_entry
from plugin.lookup import select
from plugin.types import FoundContent, Place

LANE = "unit"

rng = np.random.default_rng(23)


def entry(chunk_hash: str, tokens, **fields) -> dict:
    return wire_entry(chunk_hash, np.asarray(tokens).tolist(), **fields)


def fresh(n: int) -> np.ndarray:
    return rng.integers(1000, 60000, n, dtype=np.uint32)


async def score(coord, tokens, model="m", salt="", expect=200, **extra) -> dict:
    body = {"tokens_b64": encode_tokens(np.asarray(tokens, dtype=np.uint32)),
            "model_name": model, "cache_salt": salt, **extra}
    response = await coord.call("POST", BLEND_SCORE_PATH, expect, data=encode(body))
    return await response.json()


def table(reply) -> list[tuple]:
    return [(s["instance_id"], s["prefix_tokens"], s["l1_tokens"], s["shared_tokens"],
             s["peer_tokens"], s["score"]) for s in reply["instances"]]


async def register(coord, *ids):
    for instance_id in ids:
        await coord.register(instance_id)


async def fleet(coord, model="m"):
    """Instances A-D; a request whose first two chunks A stored as a prefix, then a chunk
    in B's L1, one in a shared L2, one only in C's L1, and a tail nobody holds."""
    await register(coord, "A", "B", "C", "D")
    prefix = fresh(2 * C)
    x, y, z = fresh(C), fresh(C), fresh(C)
    request = np.concatenate([prefix, x, fresh(2), y, fresh(1), z, fresh(3)])
    names = prefix_chunk_hashes(prefix, C)
    await coord.post_events(
        batch(*[entry(h.hex(), prefix[i * C:(i + 1) * C], offset=i * C, model=model)
                for i, h in enumerate(names)], instance="A"),
        batch(entry("b1", x, offset=40, model=model), instance="B"),
        batch(entry("5a", y, offset=0, model=model), instance="B", tier="l2", backend="fs",
              shared=True, seq=2),
        batch(entry("c1", z, offset=8, model=model), instance="C"))
    return request


async def test_every_instance_is_scored_by_where_its_reuse_comes_from_best_first(coord):
    request = await fleet(coord)
    reply = await score(coord, request)
    assert reply["chunk_size"] == C
    # A: its prefix (8), then y shared, x and z at peers. B, C: x / z in their own L1, the
    # prefix chunks (A's) at a peer. D holds nothing: shared and peers only.
    assert table(reply) == [
        ("A", 8, 0, 4, 8, 8 + 0.5 * 4 + 0.25 * 8),
        ("B", 0, 4, 4, 12, 4 + 0.5 * 4 + 0.25 * 12),
        ("C", 0, 4, 4, 12, 4 + 0.5 * 4 + 0.25 * 12),   # a tie: by instance_id
        ("D", 0, 0, 4, 16, 0.5 * 4 + 0.25 * 16),
    ]


async def test_a_long_prefix_is_served_as_far_as_each_instance_holds_it(coord):
    """The prefix chain is hashed in steps (64 chunks, then 4x): a prefix held past the
    first steps counts whole, and stops at each instance's first chunk it cannot serve."""
    await register(coord, "P", "Q", "R")
    request = fresh(400 * C)
    names = prefix_chunk_hashes(request, C)

    def held(first: int, stop: int) -> list[dict]:
        return [entry(names[i].hex(), request[i * C:(i + 1) * C], offset=i * C)
                for i in range(first, stop)]

    await coord.post_events(batch(*held(0, 300), instance="P"),
                            batch(*held(200, 350), instance="Q"),
                            batch(*held(0, 10), instance="R", tier="l2", backend="fs",
                                  shared=True))
    prefixes = {s["instance_id"]: s["prefix_tokens"]
                for s in (await score(coord, request))["instances"]}
    # P: its 300 chunks; Q: the 10 shared ones, then chunk 10 is nobody's but P's; R holds
    # nothing in L1: the shared ones.
    assert prefixes == {"P": 300 * C, "Q": 10 * C, "R": 10 * C}


async def test_weights_are_the_coordinators_flags(start):
    coord = await start(score_shared_weight=1.0, score_peer_weight=0.0)
    reply = await score(coord, await fleet(coord))
    assert [(s["instance_id"], s["score"]) for s in reply["instances"]] == [
        ("A", 12.0), ("B", 8.0), ("C", 8.0), ("D", 4.0)]


async def test_only_registered_instances_asked_for_are_listed(coord):
    request = await fleet(coord)
    reply = await score(coord, request, instance_ids=["D", "C", "nobody"])
    assert [s["instance_id"] for s in reply["instances"]] == ["C", "D"]
    await coord.call("DELETE", f"{INSTANCES_PATH}/C", 204)
    reply = await score(coord, request)
    # C left: not listed, and its L1 is fenced, so z is nobody's any more.
    assert [(s["instance_id"], s["peer_tokens"]) for s in reply["instances"]] == [
        ("A", 4), ("B", 8), ("D", 12)]
    assert (await score(coord, request, instance_ids=[]))["instances"] == []


async def test_another_namespace_scores_nothing(coord):
    request = await fleet(coord)
    for other in ({"salt": "tenant-b"}, {"model": "other"}):
        reply = await score(coord, request, **other)
        assert [row[1:] for row in table(reply)] == [(0, 0, 0, 0, 0.0)] * 4
    reply = await score(coord, request, world_size=2)
    assert all(s["score"] == 0 for s in reply["instances"])


async def test_a_short_request_or_an_empty_fleet(coord):
    assert (await score(coord, fresh(C)))["instances"] == []
    await register(coord, "A")
    assert table(await score(coord, fresh(C - 1))) == [("A", 0, 0, 0, 0, 0.0)]
    assert table(await score(coord, [])) == [("A", 0, 0, 0, 0, 0.0)]


@pytest.mark.parametrize("body, field", [
    ({"tokens_b64": "%%%", "model_name": "m"}, "tokens_b64"),
    ({"tokens_b64": encode_tokens(np.arange(8, dtype=np.uint32))}, "model_name"),
    ({"tokens_b64": "", "model_name": "m", "cache_salt": "a/b"}, "cache_salt"),
    ({"model_name": "m", "instance_ids": "A"}, "instance_ids"),
    ({"model_name": "m", "instance_ids": [1]}, "instance_ids"),
    ({"model_name": "m", "world_size": 0}, "world_size"),
])
async def test_malformed_requests_are_refused_with_a_reason(coord, body, field):
    await register(coord, "A")
    response = await coord.call("POST", BLEND_SCORE_PATH, 422, data=encode(body))
    detail = (await response.json())["detail"]
    assert field in str(detail) or field.split("_")[0] in str(detail), detail


async def test_an_oversized_request_is_refused(start):
    coord = await start(max_query_tokens=64)
    await coord.call("POST", BLEND_SCORE_PATH, 413, data=encode(
        {"tokens_b64": encode_tokens(fresh(200)), "model_name": "m"}))


# --- against an independent path: the candidates form, the directory, the plugin's rule -------


async def expected_scores(coord, tokens, instances, model) -> dict[str, tuple]:
    """Per instance: (prefix, l1, shared, peer) as a plugin on it would reuse, computed from
    the candidates reply, `/directory/lookup` and `plugin.lookup.select`."""
    body = {"tokens_b64": encode_tokens(tokens), "model_name": model, "candidates": True}
    candidates = (await (await coord.call("POST", BLEND_LOOKUP_PATH, data=encode(body)))
                  .json())["candidates"]
    results = (await coord.directory_lookup(token_ids=tokens.tolist(), model_name=model)
               )["results"]
    expected = {}
    for me in instances:
        prefix = 0
        for result in results:
            if not any(p["shared"] or (p["tier"] == "l1" and p["instance_id"] == me)
                       for p in result["placements"]):
                break
            prefix += C
        found = []
        for c in candidates:  # one group per content and place, as the plugin's client
            by_place: dict[Place, list] = {}
            for o in c["chunks"]:
                place = (Place.THIS_SERVER if me in o.get("l1", []) else
                         Place.SHARED if o.get("shared") else Place.PEER)
                by_place.setdefault(place, []).append((bytes.fromhex(o["chunk_hash"]),
                                                       o["old_st"]))
            found += [FoundContent(tuple(c["positions"]), place, tuple(chunks))
                      for place, chunks in by_place.items()]
        place_of = {h: f.place for f in found for h, _ in f.chunks}
        tokens_at = {place: 0 for place in Place}
        for kept in select([], found, prefix, C):
            tokens_at[place_of[kept.segment.hash]] += C
        expected[me] = (prefix, tokens_at[Place.THIS_SERVER], tokens_at[Place.SHARED],
                        tokens_at[Place.PEER])
    return expected


@pytest.mark.parametrize("seed", range(6))
async def test_scores_are_what_the_plugins_selection_gives_each_instance(coord, seed):
    """Random fleets: contents stored by several instances, in L1 and a shared L2, some as
    LMCache prefixes; requests with repeats, overlaps and prefixes."""
    local = np.random.default_rng(seed)
    model = f"m{seed}"
    instances = ["A", "B", "C", "D"]
    await register(coord, *instances)
    contents = [local.integers(0, 3, C, dtype=np.uint32) for _ in range(6)]
    seq = {i: 0 for i in instances}
    for n, content in enumerate(contents):
        for instance in local.choice(instances, local.integers(1, 3), replace=False):
            shared = bool(local.random() < 0.3)
            seq[instance] += 1
            await coord.post_events(batch(
                entry(f"{n:02x}{seq[instance]:02x}{instance.encode().hex()}", content,
                      offset=int(local.integers(0, 64)), model=model),
                instance=str(instance), seq=seq[instance], tier="l2" if shared else "l1",
                backend="fs" if shared else "dram", shared=shared))
    for _ in range(8):
        pieces = [contents[k] if local.random() < 0.7 else contents[k][1:]
                  for k in local.integers(0, len(contents), local.integers(1, 8))]
        tokens = np.concatenate(pieces + [local.integers(0, 3, local.integers(0, 5),
                                                         dtype=np.uint32)])
        if local.random() < 0.5:  # A stored this request's head as LMCache names it
            head = tokens[:C * int(local.integers(1, max(2, len(tokens) // C)))]
            seq["A"] += 1
            await coord.post_events(batch(
                *[entry(h.hex(), head[i * C:(i + 1) * C], offset=i * C, model=model)
                  for i, h in enumerate(prefix_chunk_hashes(head, C))],
                instance="A", seq=seq["A"]))
        reply = await score(coord, tokens, model=model)
        got = {s["instance_id"]: (s["prefix_tokens"], s["l1_tokens"], s["shared_tokens"],
                                  s["peer_tokens"]) for s in reply["instances"]}
        assert got == await expected_scores(coord, tokens, instances, model)
        ranked = [(-s["score"], s["instance_id"]) for s in reply["instances"]]
        assert ranked == sorted(ranked)


def test_weights_are_flags_in_zero_to_one():
    from coordinator_stub.config import CoordinatorConfig, parse_args
    config = parse_args(["--score-shared-weight", "0.8", "--score-peer-weight", "0.1"],
                        environ={})
    assert (config.score_shared_weight, config.score_peer_weight) == (0.8, 0.1)
    assert (parse_args([], environ={}).score_shared_weight,
            parse_args([], environ={}).score_peer_weight) == (0.5, 0.25)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="score_peer_weight"):
            CoordinatorConfig(score_peer_weight=bad)
