"""LMCache's own coordinator tests for the directory, ported to HTTP against ours.

From LMCache's `tests/v1/mp_coordinator/test_directory_api.py`, `test_key_directory.py`
and `test_health.py` (the behaviours a client can see over HTTP; what LMCache checks on
its Python objects is checked here through `/directory/lookup`, `/directory/keys` and
`/directory/stats`). LMCache's fixture runs with blend lookup off and chunk size 256, so
do these unless a test says otherwise; their chunk hashes are short hex strings.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from blend_wire import INSTANCES_PATH
from coordinator_client import batch, key

LANE = "unit"

CHUNK = 256


@pytest.fixture
async def directory(start):
    """LMCache's `_client()`: blend lookup off, production chunk size."""
    return await start(enable_blend_lookup=False, chunk_size=CHUNK)


def _batch(instance="node-a", incarnation=1, seq=1, event_type="store", tier="l1",
           backend="dram", entries=None) -> dict:
    entries = [{"key": key("aa"), "size_bytes": 1024}] if entries is None else entries
    return batch(*entries, instance=instance, incarnation=incarnation, seq=seq,
                 event_type=event_type, tier=tier, backend=backend)


async def _results(coord, *keys) -> list[dict]:
    return (await coord.directory_lookup(keys=list(keys)))["results"]


# --- test_directory_api.py ------------------------------------------------------------------


async def test_store_events_then_lookup(directory):
    assert await directory.post_events(_batch()) == {"applied": 1, "duplicates": 0, "stale": 0}
    [result] = await _results(directory, key("aa"))
    assert result["key"]["chunk_hash_hex"] == "aa"
    [placement] = result["placements"]
    assert (placement["instance_id"], placement["incarnation"], placement["tier"],
            placement["backend"], placement["size_bytes"]) == ("node-a", 1, "l1", "dram", 1024)


async def test_delete_event_removes_placement(directory):
    await directory.post_events(_batch(seq=1))
    await directory.post_events(_batch(seq=2, event_type="delete",
                                       entries=[{"key": key("aa")}]))
    assert (await _results(directory, key("aa")))[0]["placements"] == []


async def test_duplicate_and_stale_batches_are_counted(directory):
    await directory.post_events(_batch(incarnation=2, seq=1))
    reply = await directory.post_events(_batch(incarnation=2, seq=1),
                                        _batch(incarnation=1, seq=9),
                                        _batch(incarnation=2, seq=2))
    assert reply == {"applied": 1, "duplicates": 1, "stale": 1}


async def test_lookup_tokens_roundtrip(directory):
    body = {"model_name": "m", "world_size": 1, "token_ids": list(range(256)),
            "cache_salt": ""}
    first = await directory.directory_lookup(**body)
    assert first["chunks"] == 1 and first["results"][0]["placements"] == []
    resolved = first["results"][0]["key"]
    await directory.post_events(_batch(entries=[{"key": resolved, "size_bytes": 64}]))
    second = await directory.directory_lookup(**body)
    [placement] = second["results"][0]["placements"]
    assert (placement["instance_id"], placement["size_bytes"]) == ("node-a", 64)


async def test_stats_reports_counts_and_per_instance_l1_keys(directory):
    await directory.post_events(_batch(seq=1))
    await directory.post_events(_batch(seq=5, entries=[{"key": key("bb")}]))
    await directory.post_events(_batch(seq=6, tier="l2", backend="fs",
                                       entries=[{"key": key("bb")}]))
    stats = await directory.stats()
    assert (stats["num_keys"], stats["num_placements"]) == (2, 3)
    assert stats["l1_keys_by_instance"]["node-a"] == 2
    assert "instances" not in stats


async def test_lookup_returns_the_chunks_token_ids(directory):
    entry = {"key": key("aa"), "size_bytes": 1024, "token_ids": [1, 2, 3]}
    await directory.post_events(_batch(entries=[entry]))
    [result] = await _results(directory, key("aa"))
    assert result["token_ids"] == [1, 2, 3]
    assert "token_offset" not in result


async def test_list_keys_endpoint_filters_and_paginates(directory):
    await directory.post_events(
        _batch(seq=1, entries=[{"key": key("aa"), "size_bytes": 1, "token_ids": [1, 2]},
                               {"key": key("bb"), "size_bytes": 2}]),
        _batch(seq=2, tier="l2", backend="fs", entries=[{"key": key("aa")}]))
    data = await directory.keys()
    assert data["total"] == 2
    by_hash = {row["key"]["chunk_hash_hex"]: row for row in data["keys"]}
    assert by_hash["aa"]["num_tokens"] == 2 and len(by_hash["aa"]["placements"]) == 2
    assert by_hash["bb"]["num_tokens"] == 0
    l2 = await directory.keys(tier="l2")
    assert l2["total"] == 1 and [p["backend"] for p in l2["keys"][0]["placements"]] == ["fs"]
    page = await directory.keys(offset=1, limit=1)
    assert page["total"] == 2 and len(page["keys"]) == 1
    await directory.keys(expect=422, offset=-1)


async def test_lookup_keys_form_returns_placements_and_tokens(directory):
    await directory.post_events(_batch(entries=[{"key": key("aa"), "size_bytes": 1,
                                                 "token_ids": [1, 2, 3]}]))
    reply = await directory.directory_lookup(keys=[key("aa"), key("ff")])
    assert reply["chunks"] == 2
    known, unknown = reply["results"]
    assert known["token_ids"] == [1, 2, 3] and len(known["placements"]) == 1
    assert unknown["token_ids"] == [] and unknown["placements"] == []


async def test_lookup_malformed_key_and_forms_are_rejected(directory):
    await directory.directory_lookup(expect=422, keys=[key("zz")])
    await directory.directory_lookup(expect=422, keys=[key("aa")], token_ids=[1, 2],
                                     model_name="m")
    await directory.directory_lookup(expect=422)
    await directory.directory_lookup(expect=422, token_ids=[1, 2])


async def test_lookup_tokens_invalid_model_name_is_400(directory):
    await directory.directory_lookup(expect=400, model_name="a@b", world_size=1,
                                     token_ids=list(range(256)))


# --- test_key_directory.py ---------------------------------------------------------------------


async def test_restore_updates_size_without_duplicating_placement(directory):
    await directory.post_events(_batch(seq=1, entries=[{"key": key("01"), "size_bytes": 100}]))
    await directory.post_events(_batch(seq=2, entries=[{"key": key("01"), "size_bytes": 200}]))
    [placement] = (await _results(directory, key("01")))[0]["placements"]
    assert placement["size_bytes"] == 200


async def test_same_key_on_two_instances_sorted_by_instance(directory):
    await directory.post_events(_batch(instance="node-b"), _batch(instance="node-a"))
    placements = (await _results(directory, key("aa")))[0]["placements"]
    assert [p["instance_id"] for p in placements] == ["node-a", "node-b"]


async def test_removal_of_one_tier_keeps_the_other(directory):
    await directory.post_events(_batch(seq=1), _batch(seq=2, tier="l2", backend="fs"),
                                _batch(seq=3, event_type="delete",
                                       entries=[{"key": key("aa")}]))
    placements = (await _results(directory, key("aa")))[0]["placements"]
    assert [(p["tier"], p["backend"]) for p in placements] == [("l2", "fs")]
    assert (await directory.stats())["l1_keys_by_instance"]["node-a"] == 0


async def test_access_does_not_create_records(directory):
    await directory.post_events(_batch(event_type="access"))
    assert (await directory.stats())["num_keys"] == 0


async def test_binding_survives_until_last_record_of_the_chunk(directory):
    rank_1 = key("01", world_size=2, rank=1)
    await directory.post_events(_batch(seq=1, entries=[
        {"key": key("01"), "token_ids": [1, 2]}, {"key": rank_1, "token_ids": [1, 2]}]))
    await directory.post_events(_batch(seq=2, event_type="delete",
                                       entries=[{"key": key("01")}]))
    assert (await _results(directory, key("01")))[0]["token_ids"] == [1, 2]
    await directory.post_events(_batch(seq=3, event_type="delete", entries=[{"key": rank_1}]))
    assert (await _results(directory, key("01")))[0]["token_ids"] == []


async def test_token_less_entry_links_and_the_next_stamped_one_fills(directory):
    rank_1 = key("01", world_size=2, rank=1)
    await directory.post_events(_batch(seq=1, entries=[{"key": rank_1}]))
    assert (await _results(directory, key("01")))[0]["token_ids"] == []
    await directory.post_events(_batch(seq=2, entries=[{"key": key("01"),
                                                        "token_ids": [1, 2]}]))
    await directory.post_events(_batch(seq=3, event_type="delete",
                                       entries=[{"key": key("01")}]))
    assert (await _results(directory, rank_1))[0]["token_ids"] == [1, 2]


async def test_restore_with_new_tokens_rebinds(directory):
    await directory.post_events(_batch(seq=1, entries=[{"key": key("01"), "token_ids": [1, 2]}]),
                                _batch(seq=2, entries=[{"key": key("01"), "token_ids": [3, 4]}]))
    assert (await _results(directory, key("01")))[0]["token_ids"] == [3, 4]


async def test_token_ids_outside_uint32_leave_the_binding_unfilled(directory):
    reply = await directory.post_events(_batch(seq=1, entries=[
        {"key": key("01"), "token_ids": [1, 2**32]}]))
    assert reply["applied"] == 1
    [result] = await _results(directory, key("01"))
    assert result["placements"] and result["token_ids"] == []
    await directory.post_events(_batch(seq=2, entries=[{"key": key("01"),
                                                        "token_ids": [1, 2]}]))
    assert (await _results(directory, key("01")))[0]["token_ids"] == [1, 2]


async def test_fencing_releases_bindings(directory):
    await directory.post_events(_batch(seq=1, entries=[{"key": key("01"), "token_ids": [1, 2]}]))
    await directory.call("DELETE", f"{INSTANCES_PATH}/node-a", expect=204)
    assert (await _results(directory, key("01")))[0]["token_ids"] == []
    assert "node-a" not in (await directory.stats())["l1_keys_by_instance"]


@pytest.mark.parametrize("blend", [False, True], ids=["blend-off", "blend-on"])
async def test_tokens_of_any_length_show_and_a_chunk_long_list_is_indexed(start, blend):
    coord = await start(enable_blend_lookup=blend, chunk_size=4)
    await coord.post_events(_batch(seq=1, entries=[
        {"key": key("01"), "token_ids": [1, 2, 3, 4], "token_offset": 0}]))
    await coord.post_events(_batch(seq=2, entries=[{"key": key("01"), "token_ids": [9, 9]}]))
    assert (await _results(coord, key("01")))[0]["token_ids"] == [9, 9]
    assert (await coord.keys())["keys"][0]["num_tokens"] == 2
    # The index follows chunk-long content only: the short list did not replace it.
    assert await coord.lookup([1, 2, 3, 4]) == ([("01", 0, 0)] if blend else [])


# --- test_health.py and test_integration.py ------------------------------------------------------


async def test_reaped_instance_loses_its_l1_but_not_its_l2(start):
    coord = await start(enable_blend_lookup=False, health_check_interval=0.05,
                        instance_timeout=0.1)
    await coord.register("node-a")
    await coord.post_events(_batch(seq=1, entries=[{"key": key("aa"), "size_bytes": 1000}]),
                            _batch(seq=2, tier="l2", backend="fs",
                                   entries=[{"key": key("bb"), "size_bytes": 1000}]))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (await coord.stats())["l1_size_bytes"]:
        await asyncio.sleep(0.05)
    stats = await coord.stats()
    assert (stats["l1_size_bytes"], stats["l2_size_bytes"]) == (0, 1000)
    assert await coord.instances() == []


async def test_register_heartbeat_deregister_over_real_http(directory):
    await directory.register("i1", http_port=9999)
    assert [i["instance_id"] for i in await directory.instances()] == ["i1"]
    await directory.call("PUT", f"{INSTANCES_PATH}/i1/heartbeat")
    await directory.call("DELETE", f"{INSTANCES_PATH}/i1", expect=204)
    assert await directory.instances() == []
