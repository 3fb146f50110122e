"""Directory queries over HTTP (WIRE.md: `/directory/lookup`, `/directory/keys`,
`/directory/stats`, `/healthz`, validation errors), against an in-process coordinator."""

from __future__ import annotations

import pytest

from blend_wire import HEALTH_PATH, encode, pack_kv_rank, prefix_chunk_hashes
from coordinator_client import C, batch, entry, key, refusal

LANE = "unit"

A = [11, 12, 13, 14]
B = [21, 22, 23, 24]



def placement(instance="i0", incarnation=0, tier="l1", backend="dram", size=64,
              shared=False) -> dict:
    return {"instance_id": instance, "incarnation": incarnation, "tier": tier,
            "backend": backend, "size_bytes": size, "shared": shared}


def full_key(chunk_hash: str, **fields) -> dict:
    return key(chunk_hash, **fields)


# --- keys form -----------------------------------------------------------------------------


async def test_keys_form_answers_in_request_order_with_placements_tokens_and_accesses(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0, size=1000), incarnation=3),
                            batch(entry("aa01", size=500), seq=2, tier="l2", backend="disk",
                                  incarnation=3),
                            batch(entry("aa01"), entry("aa01"), seq=3, event_type="access",
                                  incarnation=3))
    reply = await coord.directory_lookup(keys=[key("ff09"), key("aa01")])
    assert reply == {"chunks": 2, "results": [
        {"key": full_key("ff09"), "placements": [], "token_ids": [], "access_count": 0},
        {"key": full_key("aa01"), "placements": [
            placement(incarnation=3, size=1000),
            placement(incarnation=3, tier="l2", backend="disk", size=500)],
         "token_ids": A, "access_count": 2}]}


async def test_placements_sort_by_instance_tier_backend(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0), instance="i2", tier="l2",
                                  backend="s3"),
                            batch(entry("aa01"), instance="i1", tier="l2", backend="fs"),
                            batch(entry("aa01"), instance="i2", backend="dram", seq=2),
                            batch(entry("aa01"), instance="i1", tier="l2", backend="disk",
                                  seq=2))
    [result] = (await coord.directory_lookup(keys=[key("aa01")]))["results"]
    assert [(p["instance_id"], p["tier"], p["backend"]) for p in result["placements"]] == [
        ("i1", "l2", "disk"), ("i1", "l2", "fs"), ("i2", "l1", "dram"), ("i2", "l2", "s3")]


async def test_restoring_a_placement_updates_its_size_and_incarnation_in_the_totals(coord):
    await coord.post_events(batch(entry("aa01", size=10)))
    await coord.post_events(batch(entry("aa01", size=30), seq=2))
    [result] = (await coord.directory_lookup(keys=[key("aa01")]))["results"]
    assert result["placements"] == [placement(size=30)]
    stats = await coord.stats()
    assert (stats["l1_count"], stats["l1_size_bytes"], stats["num_placements"]) == (1, 30, 1)


async def test_a_shared_placement_is_one_per_tier_and_backend_fleet_wide(coord):
    await coord.post_events(batch(entry("aa01", size=10), instance="i1", tier="l2",
                                  backend="nfs", shared=True),
                            batch(entry("aa01", size=12), instance="i2", tier="l2",
                                  backend="nfs", shared=True, incarnation=4))
    [result] = (await coord.directory_lookup(keys=[key("aa01")]))["results"]
    assert result["placements"] == [placement(instance="i2", incarnation=4, tier="l2",
                                              backend="nfs", size=12, shared=True)]
    assert (await coord.stats())["l2_size_bytes"] == 12
    # Any instance may delete the shared copy.
    await coord.post_events(batch(entry("aa01"), instance="i3", tier="l2", backend="nfs",
                                  shared=True, event_type="delete"))
    assert (await coord.directory_lookup(keys=[key("aa01")]))["results"][0]["placements"] == []


async def test_tokens_of_a_chunk_show_for_each_of_its_keys(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0, salt="t0")))
    [other] = (await coord.directory_lookup(keys=[key("aa01", salt="t1")]))["results"]
    assert (other["placements"], other["token_ids"]) == ([], A)


async def test_access_count_restarts_when_the_key_is_gone_and_stored_again(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0)),
                            batch(entry("aa01"), seq=2, event_type="access"),
                            batch(entry("aa01"), seq=3, event_type="delete"),
                            batch(entry("aa01", A, offset=0), seq=4))
    [result] = (await coord.directory_lookup(keys=[key("aa01")]))["results"]
    assert result["access_count"] == 0


async def test_an_access_batch_needs_no_backend_and_leaves_placements_alone(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0, size=100)))
    await coord.post_events(batch(entry("aa01"), seq=2, event_type="access", backend="",
                                  tier="l2"))
    [result] = (await coord.directory_lookup(keys=[key("aa01")]))["results"]
    assert (result["placements"], result["access_count"]) == ([placement(size=100)], 1)


async def test_accesses_of_unknown_keys_count_nothing(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0)))
    await coord.post_events(batch(entry("bb02"), entry("aa01", salt="t9"), seq=2,
                                  event_type="access"))
    [known] = (await coord.directory_lookup(keys=[key("aa01")]))["results"]
    assert known["access_count"] == 0
    reply = await coord.directory_lookup(keys=[key("bb02")])
    assert reply["results"][0]["access_count"] == 0


# --- tokens form -------------------------------------------------------------------------------


def tokens_body(tokens, model="m", world_size=1, salt="") -> dict:
    return {"token_ids": list(tokens), "model_name": model, "world_size": world_size,
            "cache_salt": salt}


async def test_tokens_form_resolves_lmcaches_chained_hashes_and_finds_placements(coord):
    sequence = A + B + [1, 2]  # two complete chunks and a partial one, ignored
    h0, h1 = (h.hex() for h in prefix_chunk_hashes(sequence, C))
    await coord.post_events(batch(entry(h1, B, offset=4)))
    reply = await coord.directory_lookup(**tokens_body(sequence))
    assert reply["chunks"] == 2
    assert [r["key"] for r in reply["results"]] == [full_key(h0), full_key(h1)]
    assert reply["results"][0]["placements"] == []
    assert reply["results"][1]["placements"] == [placement()]
    assert reply["results"][1]["token_ids"] == B


async def test_tokens_form_fans_out_per_rank_chunk_major(coord):
    sequence = A + B
    hashes = [h.hex() for h in prefix_chunk_hashes(sequence, C)]
    reply = await coord.directory_lookup(**tokens_body(sequence, world_size=2, salt="t0"))
    assert reply["chunks"] == 2
    assert [(r["key"]["chunk_hash_hex"], r["key"]["kv_rank"]) for r in reply["results"]] == [
        (h, pack_kv_rank(2, r, 2, r)) for h in hashes for r in (0, 1)]
    assert all(r["key"]["cache_salt"] == "t0" for r in reply["results"])


async def test_tokens_form_follows_copies_in_other_object_groups(coord):
    [h0] = (h.hex() for h in prefix_chunk_hashes(A, C))
    await coord.post_events(batch(entry(h0, group=2), entry(h0, group=1)))
    reply = await coord.directory_lookup(**tokens_body(A))
    assert reply["chunks"] == 1
    assert [r["key"]["object_group_id"] for r in reply["results"]] == [0, 1, 2]
    assert [len(r["placements"]) for r in reply["results"]] == [0, 1, 1]


async def test_a_sequence_shorter_than_a_chunk_resolves_nothing(coord):
    assert await coord.directory_lookup(**tokens_body(A[:3])) == {"chunks": 0, "results": []}


@pytest.mark.parametrize("fields, reason", [
    ({"model": "a@b"}, "model_name"),
    ({"salt": "a/b"}, "cache_salt"),
    ({"salt": "a\\b"}, "cache_salt"),
    ({"salt": "a\x00b"}, "cache_salt"),
    ({"salt": "s" * 129}, "cache_salt"),
], ids=["model with @", "salt with /", "salt with backslash", "salt with NUL",
        "salt of 129"])
async def test_names_no_key_can_carry_are_400(coord, fields, reason):
    reply = await coord.directory_lookup(expect=400, **tokens_body(A, **fields))
    assert isinstance(reply["detail"], str) and reason in reply["detail"]


async def test_a_salt_of_128_is_fine(coord):
    assert (await coord.directory_lookup(**tokens_body(A, salt="s" * 128)))["chunks"] == 1


async def test_more_than_a_million_tokens_is_400(coord):
    reply = await coord.directory_lookup(expect=400, **tokens_body([1] * 1_000_001))
    assert "1000000" in reply["detail"]


BAD_LOOKUPS = {
    "neither form": ({}, "exactly one"),
    "both forms": ({"keys": [key("aa01")], "token_ids": [1], "model_name": "m"},
                   "exactly one"),
    "tokens without model": ({"token_ids": [1, 2]}, "model_name"),
    "world size 0": ({"token_ids": [1], "model_name": "m", "world_size": 0}, "world_size"),
    "bad key hex": ({"keys": [key("zz")]}, "chunk_hash_hex"),
    "key model with @": ({"keys": [key("aa", model="a@b")]}, "model_name"),
    "key salt with NUL": ({"keys": [key("aa", salt="\x00")]}, "cache_salt"),
    "token beyond uint32": ({"token_ids": [2**32], "model_name": "m"}, "token_ids"),
}


@pytest.mark.parametrize("body,reason", BAD_LOOKUPS.values(), ids=BAD_LOOKUPS.keys())
async def test_malformed_lookups_are_422(coord, body, reason):
    assert reason in refusal(await coord.directory_lookup(expect=422, **body))


# --- /directory/keys ------------------------------------------------------------------------------


async def _three_keys(coord) -> None:
    await coord.post_events(
        batch(entry("aa01", A, offset=0), entry("bb02"), instance="i1"),
        batch(entry("aa01"), instance="i1", tier="l2", backend="fs", seq=2),
        batch(entry("cc03"), instance="i2", tier="l2", backend="s3"))


async def test_keys_lists_every_key_with_its_placements_in_insertion_order(coord):
    await _three_keys(coord)
    reply = await coord.keys()
    assert reply["total"] == 3
    rows = reply["keys"]
    assert [r["key"] for r in rows] == [full_key("aa01"), full_key("bb02"), full_key("cc03")]
    assert [len(r["placements"]) for r in rows] == [2, 1, 1]
    assert [r["num_tokens"] for r in rows] == [C, 0, 0]
    assert [r["access_count"] for r in rows] == [0, 0, 0]


@pytest.mark.parametrize("params, expected", [
    ({"tier": "l2"}, {"aa01": ["fs"], "cc03": ["s3"]}),
    ({"tier": "l1"}, {"aa01": ["dram"], "bb02": ["dram"]}),
    ({"instance_id": "i2"}, {"cc03": ["s3"]}),
    ({"backend": "fs"}, {"aa01": ["fs"]}),
    ({"tier": "l2", "instance_id": "i1"}, {"aa01": ["fs"]}),
    ({"instance_id": "nobody"}, {}),
])
async def test_keys_filters_keep_only_matching_placements(coord, params, expected):
    await _three_keys(coord)
    reply = await coord.keys(**params)
    assert reply["total"] == len(expected)
    assert {r["key"]["chunk_hash_hex"]: [p["backend"] for p in r["placements"]]
            for r in reply["keys"]} == expected


async def test_keys_pages(coord):
    await _three_keys(coord)
    page = await coord.keys(offset=1, limit=1)
    assert page["total"] == 3
    assert [r["key"]["chunk_hash_hex"] for r in page["keys"]] == ["bb02"]
    assert (await coord.keys(offset=5))["keys"] == []


@pytest.mark.parametrize("params, field", [
    ({"offset": -1}, "offset"), ({"limit": 0}, "limit"), ({"limit": 10001}, "limit"),
    ({"tier": "all2"}, "tier"), ({"limit": "ten"}, "limit")])
async def test_bad_keys_queries_are_422(coord, params, field):
    reason = refusal(await coord.keys(expect=422, **params))
    assert field in reason and "query" in reason


# --- stats and health ------------------------------------------------------------------------------


async def test_stats_carry_every_lmcache_field_first(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0, size=100), instance="i1"),
                            batch(entry("bb02", size=5), instance="i1", tier="l2",
                                  backend="fs", seq=2),
                            batch(entry("bb02", size=6), instance="i2"),
                            batch(instance="i3", event_type="config", backend="dram"))
    stats = await coord.stats()
    assert list(stats)[:8] == ["num_keys", "num_placements", "l1_keys_by_instance", "blend",
                               "l1_count", "l1_size_bytes", "l2_count", "l2_size_bytes"]
    assert (stats["num_keys"], stats["num_placements"]) == (2, 3)
    # An instance gets an entry (possibly 0) once the gate admits its first batch.
    assert stats["l1_keys_by_instance"] == {"i1": 1, "i2": 1, "i3": 0}
    assert (stats["l1_count"], stats["l1_size_bytes"]) == (2, 106)
    assert (stats["l2_count"], stats["l2_size_bytes"]) == (1, 5)
    assert list(stats["blend"]) == ["num_contents", "num_chunks", "num_claims",
                                    "num_namespaces", "table_size"]
    assert stats["blend"]["num_chunks"] == 1


async def test_a_restart_fences_the_instances_entry_and_placements(coord):
    await coord.post_events(batch(entry("aa01", size=100), instance="i1"),
                            batch(entry("bb02", size=5), instance="i1", seq=2, tier="l2",
                                  backend="fs"))
    await coord.post_events(batch(instance="i1", incarnation=1, event_type="access"))
    stats = await coord.stats()
    assert stats["l1_keys_by_instance"] == {"i1": 0}
    assert (stats["num_placements"], stats["l1_size_bytes"], stats["l2_size_bytes"]) == (0, 0, 0)


async def test_health_is_healthy(coord):
    response = await coord.call("GET", HEALTH_PATH)
    assert await response.json() == {"status": "healthy"}


# --- validation errors in FastAPI's shape ------------------------------------------------------------


async def test_a_422_names_the_location_the_type_and_the_input(coord):
    body = {"batches": [batch(entry("aa01", A, offset=0)), {**batch(), "seq": 0}]}
    response = await coord.call("POST", "/events", expect=422, data=encode(body))
    [error] = (await response.json())["detail"]
    assert error["loc"] == ["body", "batches", 1, "seq"]
    assert error["type"] == "greater_than_equal"
    assert error["input"] == 0
    assert "seq" in error["msg"]


async def test_a_missing_field_is_type_missing_at_its_location(coord):
    body = {"batches": [{k: v for k, v in batch().items() if k != "tier"}]}
    response = await coord.call("POST", "/events", expect=422, data=encode(body))
    [error] = (await response.json())["detail"]
    assert (error["type"], error["loc"]) == ("missing", ["body", "batches", 0, "tier"])


async def test_invalid_json_is_422_json_invalid(coord):
    response = await coord.call("POST", "/events", expect=422, data=b"{not json")
    [error] = (await response.json())["detail"]
    assert error["type"] == "json_invalid" and error["loc"][0] == "body"
