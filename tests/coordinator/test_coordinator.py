"""The bundled coordinator over real HTTP (in-process app on a free loopback port).

Chunk size 4 throughout, so a chunk is four token ids. Each test is one behaviour of
DESIGN.md's "Coordinator" section or WIRE.md's contract.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from blend_wire import BLEND_LOOKUP_PATH, EVENTS_PATH, HEALTH_PATH, encode, encode_tokens
from coordinator_client import C, batch, entry, refusal

LANE = "unit"

A = [11, 12, 13, 14]
B = [21, 22, 23, 24]
D = [31, 32, 33, 34]
FILL = [7, 7, 7]  # never a chunk: pads queries so matches sit at non-zero offsets



# --- storing and matching -------------------------------------------------------------


async def test_stored_chunk_matches_at_query_offset_with_stored_offset(coord):
    reply = await coord.post_events(batch(entry("aa01", A, offset=8)))
    assert reply == {"applied": 1, "duplicates": 0, "stale": 0}
    assert await coord.lookup(FILL + A + FILL) == [("aa01", 8, 3)]


async def test_matches_ascend_by_query_offset_once_per_chunk_at_first_occurrence(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0), entry("bb02", B, offset=4)))
    query = FILL + B + A + FILL + B + A
    assert await coord.lookup(query) == [("bb02", 4, 3), ("aa01", 0, 7)]


async def test_repeated_content_offers_a_second_chunk_of_the_same_namespace(coord):
    # LMCache's example (WIRE.md, blend-lookup): T stored as aa (offset 0) and bb (512).
    await coord.post_events(batch(entry("aa", A, offset=0), entry("bb", A, offset=512)))
    assert await coord.lookup(A + A) == [("aa", 0, 0), ("bb", 512, C)]
    assert await coord.lookup(A + FILL + A + A) == [("aa", 0, 0), ("bb", 512, 7)]


async def test_a_document_behind_many_prefixes_costs_one_match_per_occurrence(coord):
    await coord.post_events(batch(*(entry(f"{i:04x}", A, offset=C * i) for i in range(300))))
    assert await coord.lookup(A + A) == [("0000", 0, 0), ("0001", C, C)]
    assert await coord.lookup(A, salt="other") == []


async def test_query_shorter_than_a_chunk_answers_empty(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0)))
    assert await coord.lookup(A[:3]) == []
    assert await coord.lookup([]) == []


async def test_reply_hex_is_lowercase_hex_of_the_stored_hash(coord):
    await coord.post_events(batch(entry("ABCDEF", A, offset=0)))
    assert await coord.lookup(A) == [("abcdef", 0, 0)]


async def test_stats_report_keys_placements_and_blend_index(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0), entry("bb02", B, offset=4)))
    stats = await coord.stats()
    assert stats["num_keys"] == 2 and stats["num_placements"] == 2
    blend = stats["blend"]
    assert (blend["num_contents"], blend["num_chunks"], blend["num_claims"],
            blend["num_namespaces"]) == (2, 2, 2, 1)
    assert blend["table_size"] > 0


# --- deleting ---------------------------------------------------------------------------


async def test_deleting_the_last_placement_removes_the_chunk(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0)))
    await coord.post_events(batch(entry("aa01"), seq=2, event_type="delete"))
    assert await coord.lookup(A) == []
    stats = await coord.stats()
    assert (stats["num_keys"], stats["num_placements"]) == (0, 0)
    assert stats["blend"]["num_contents"] == 0 and stats["blend"]["num_chunks"] == 0


async def test_world_size_2_chunk_matches_until_the_last_rank_key_is_deleted(coord):
    ranks = [entry("aa01", A, offset=0, world_size=2, rank=r) for r in (0, 1)]
    await coord.post_events(batch(*ranks))
    assert (await coord.stats())["num_keys"] == 2
    await coord.post_events(batch(ranks[0], seq=2, event_type="delete"))
    assert await coord.lookup(A, world_size=2) == [("aa01", 0, 0)]
    await coord.post_events(batch(ranks[1], seq=3, event_type="delete"))
    assert await coord.lookup(A, world_size=2) == []
    assert (await coord.stats())["blend"]["num_chunks"] == 0


async def test_a_key_in_two_tiers_matches_until_both_placements_are_deleted(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0), tier="l1"),
                            batch(entry("aa01", A, offset=0), seq=2, tier="l2", backend="disk"))
    stats = await coord.stats()
    assert (stats["num_keys"], stats["num_placements"]) == (1, 2)
    await coord.post_events(batch(entry("aa01"), seq=3, event_type="delete", tier="l1"))
    assert await coord.lookup(A) == [("aa01", 0, 0)]
    await coord.post_events(batch(entry("aa01"), seq=4, event_type="delete", tier="l2",
                                  backend="disk"))
    assert await coord.lookup(A) == []


async def test_delete_from_another_instance_leaves_this_instances_placement(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0), instance="i0"))
    reply = await coord.post_events(batch(entry("aa01"), instance="i1", event_type="delete"))
    assert reply["applied"] == 1
    assert await coord.lookup(A) == [("aa01", 0, 0)]
    assert (await coord.stats())["num_placements"] == 1


# --- content changes and token-less stores ---------------------------------------------


async def test_restoring_a_hash_with_new_content_retires_the_old_content(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0)))
    await coord.post_events(batch(entry("aa01", B, offset=0), seq=2))
    assert await coord.lookup(A) == []
    assert await coord.lookup(B) == [("aa01", 0, 0)]
    blend = (await coord.stats())["blend"]
    assert (blend["num_contents"], blend["num_chunks"]) == (1, 1)


@pytest.fixture
async def trusting(start):
    """A coordinator with `--trust-shared-hashes`: LMCache's cross-namespace rules."""
    return await start(trust_shared_hashes=True)


async def test_new_content_from_one_namespace_leaves_the_others_as_they_were(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0, salt="t0"),
                                  entry("aa01", A, offset=0, salt="t1")))
    await coord.post_events(batch(entry("aa01", B, offset=4, salt="t0"), seq=2))
    assert await coord.lookup(A, salt="t0") == []
    assert await coord.lookup(B, salt="t0") == [("aa01", 4, 0)]
    assert await coord.lookup(A, salt="t1") == [("aa01", 0, 0)]
    assert await coord.lookup(B, salt="t1") == []
    blend = (await coord.stats())["blend"]
    assert (blend["num_contents"], blend["num_chunks"], blend["num_claims"]) == (2, 2, 2)
    # Within one namespace the latest STORE with tokens wins (t1 agrees with t0 again).
    await coord.post_events(batch(entry("aa01", B, offset=4, salt="t1"), seq=3))
    assert await coord.lookup(B, salt="t1") == [("aa01", 4, 0)]
    blend = (await coord.stats())["blend"]
    assert (blend["num_contents"], blend["num_chunks"], blend["num_claims"]) == (1, 1, 2)


async def test_remove_chunk_retires_every_namespace_at_once(trusting):
    # LMCache's rule (trusted hashes): new content under a hash retires every claim on the
    # old one, and every namespace on the chunk claims the new one.
    await trusting.post_events(batch(entry("aa01", A, offset=0, salt="t0"),
                                     entry("aa01", offset=0, salt="t1")))
    await trusting.post_events(batch(entry("aa01", B, offset=0, salt="t0"), seq=2))
    for salt in ("t0", "t1"):
        assert await trusting.lookup(A, salt=salt) == []
        assert await trusting.lookup(B, salt=salt) == [("aa01", 0, 0)]


async def test_tokenless_store_indexes_nothing(coord):
    await coord.post_events(batch(entry("aa01", offset=0)))
    stats = await coord.stats()
    assert stats["num_keys"] == 1
    assert stats["blend"]["num_chunks"] == 0 and stats["blend"]["num_contents"] == 0
    assert await coord.lookup(A) == []


async def test_a_namespace_moving_its_own_chunk_keeps_its_place_in_the_order(coord):
    await coord.post_events(batch(entry("aa01", B, offset=0, salt="t0")))
    await coord.post_events(batch(entry("aa01", A, offset=8, salt="t1"),  # its own content
                                  entry("bb02", A, offset=4, salt="t1"), seq=2))
    assert await coord.lookup(A + A, salt="t1") == [("aa01", 8, 0), ("bb02", 4, C)]
    await coord.post_events(batch(entry("aa01", A, offset=20, salt="t1"), seq=3))
    assert await coord.lookup(A + A, salt="t1") == [("aa01", 20, 0), ("bb02", 4, C)]
    assert await coord.lookup(B, salt="t0") == [("aa01", 0, 0)]


async def test_a_stamped_store_fills_content_for_its_own_namespace_only(coord):
    await coord.post_events(batch(entry("aa01", offset=0, salt="t1")))
    await coord.post_events(batch(entry("aa01", A, offset=0, salt="t0"), seq=2))
    assert await coord.lookup(A, salt="t0") == [("aa01", 0, 0)]
    assert await coord.lookup(A, salt="t1") == []  # t1 reported no tokens of its own
    await coord.post_events(batch(entry("aa01", A, offset=8, salt="t1"), seq=3))
    assert await coord.lookup(A, salt="t1") == [("aa01", 8, 0)]
    assert await coord.lookup(A, salt="t0") == [("aa01", 0, 0)]


async def test_later_stamped_store_fills_content_for_namespaces_already_on_the_binding(
        trusting):
    await trusting.post_events(batch(entry("aa01", offset=0, salt="t1")))
    await trusting.post_events(batch(entry("aa01", A, offset=0, salt="t0"), seq=2))
    assert await trusting.lookup(A, salt="t1") == [("aa01", 0, 0)]
    assert await trusting.lookup(A, salt="t0") == [("aa01", 0, 0)]


async def test_tokenless_store_of_another_namespaces_content_claims_nothing(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0, salt="t0")))
    await coord.post_events(batch(entry("aa01", offset=0, salt="t1"), seq=2))
    assert await coord.lookup(A, salt="t1") == []
    blend = (await coord.stats())["blend"]
    assert (blend["num_contents"], blend["num_claims"]) == (1, 1)
    # ... while one of its own reports' content it claims (another key, token-less).
    await coord.post_events(batch(entry("aa01", A, offset=4, salt="t1"),
                                  entry("aa01", offset=0, salt="t1", group=1), seq=3))
    assert await coord.lookup(A, salt="t1") == [("aa01", 4, 0)]


async def test_a_namespace_joining_a_bound_chunk_without_tokens_still_claims_it(trusting):
    await trusting.post_events(batch(entry("aa01", A, offset=0, salt="t0")))
    assert await trusting.lookup(A, salt="t1") == []
    await trusting.post_events(batch(entry("aa01", offset=0, salt="t1"), seq=2))
    assert await trusting.lookup(A, salt="t1") == [("aa01", 0, 0)]
    blend = (await trusting.stats())["blend"]
    assert (blend["num_contents"], blend["num_claims"]) == (1, 2)


async def test_token_list_of_the_wrong_length_is_not_indexed(coord):
    reply = await coord.post_events(batch(entry("aa01", A + [15], offset=0)))
    assert reply["applied"] == 1
    assert await coord.lookup(A + [15]) == []
    stats = await coord.stats()
    assert stats["num_keys"] == 1 and stats["blend"]["num_chunks"] == 0


# --- unknown offsets -------------------------------------------------------------------


async def test_unknown_offset_fills_the_binding_but_is_not_matchable(coord):
    await coord.post_events(batch(entry("aa01", A, offset=-1)))
    assert await coord.lookup(A) == []
    assert (await coord.stats())["blend"]["num_chunks"] == 0


@pytest.mark.parametrize("with_tokens", [True, False], ids=["stamped", "tokenless"])
async def test_only_a_later_store_with_tokens_and_an_offset_makes_it_matchable(
        coord, with_tokens):
    await coord.post_events(batch(entry("aa01", A, offset=-1)))
    later = entry("aa01", A if with_tokens else (), offset=12, salt="")
    await coord.post_events(batch(later, seq=2, tier="l2", backend="disk"))
    assert await coord.lookup(FILL + A) == ([("aa01", 12, 3)] if with_tokens else [])


async def test_the_offset_is_the_one_of_the_latest_store_with_tokens(trusting):
    coord = trusting
    await coord.post_events(batch(entry("aa01", A, offset=12)))
    await coord.post_events(batch(entry("aa01", (), offset=40, salt="t1"), seq=2))
    assert await coord.lookup(A) == [("aa01", 12, 0)]  # token-less: offset unchanged
    assert await coord.lookup(A, salt="t1") == [("aa01", 12, 0)]  # ... but claimed
    await coord.post_events(batch(entry("aa01", A, offset=20), seq=3, tier="l2"))
    assert await coord.lookup(A) == [("aa01", 20, 0)]
    assert await coord.lookup(A, salt="t1") == [("aa01", 20, 0)]
    await coord.post_events(batch(entry("aa01", A, offset=-1), seq=4))
    assert await coord.lookup(A) == [] and await coord.lookup(A, salt="t1") == []
    assert (await coord.stats())["blend"]["num_chunks"] == 0
    await coord.post_events(batch(entry("aa01", A, offset=4), seq=5))
    assert await coord.lookup(A, salt="t1") == [("aa01", 4, 0)]


async def test_the_offset_is_each_namespaces_latest_store_with_tokens(coord):
    await coord.post_events(batch(entry("aa01", A, offset=12)))
    await coord.post_events(batch(entry("aa01", A, offset=40, salt="t1"), seq=2))
    await coord.post_events(batch(entry("aa01", (), offset=8), seq=3))  # token-less
    assert await coord.lookup(A) == [("aa01", 12, 0)]
    assert await coord.lookup(A, salt="t1") == [("aa01", 40, 0)]
    await coord.post_events(batch(entry("aa01", A, offset=-1), seq=4))
    assert await coord.lookup(A) == []  # unknown position: not matchable, for "" only
    assert await coord.lookup(A, salt="t1") == [("aa01", 40, 0)]
    await coord.post_events(batch(entry("aa01", A, offset=20, salt="t1"), seq=5, tier="l2"))
    assert await coord.lookup(A, salt="t1") == [("aa01", 20, 0)]
    assert await coord.lookup(A) == []


async def test_tokenless_at_0_then_tokens_at_minus_1_is_not_indexed(coord):
    await coord.post_events(batch(entry("aa01", (), offset=0)))
    await coord.post_events(batch(entry("aa01", A, offset=-1), seq=2))
    assert await coord.lookup(A) == []
    stats = await coord.stats()
    assert stats["num_keys"] == 1 and stats["blend"]["num_chunks"] == 0


# --- token ids outside uint32: a miss, not a failed batch ----------------------------------


@pytest.mark.parametrize("bad", [2**32, -1, 10**30], ids=["2^32", "negative", "huge"])
async def test_a_token_id_outside_uint32_records_the_placement_as_unknown_content(coord, bad):
    reply = await coord.post_events(batch(entry("aa01", [1, 2, 3, bad], offset=0),
                                          entry("bb02", B, offset=4)))
    assert reply == {"applied": 1, "duplicates": 0, "stale": 0}
    stats = await coord.stats()
    assert (stats["num_keys"], stats["num_placements"]) == (2, 2)
    assert stats["blend"]["num_chunks"] == 1
    assert await coord.lookup(B) == [("bb02", 4, 0)]
    # A later good STORE fills the content in.
    await coord.post_events(batch(entry("aa01", A, offset=8), seq=2))
    assert await coord.lookup(A) == [("aa01", 8, 0)]


async def test_a_token_id_outside_uint32_leaves_a_known_binding_as_it_was(start):
    coord = await start(trust_shared_hashes=True)
    await coord.post_events(batch(entry("aa01", A, offset=8)))
    await coord.post_events(batch(entry("aa01", [1, 2, 3, 2**32], offset=0, salt="t1"),
                                  seq=2))
    # Like a token-less store: content and offset unchanged, the new namespace claims it.
    assert await coord.lookup(A) == [("aa01", 8, 0)]
    assert await coord.lookup(A, salt="t1") == [("aa01", 8, 0)]
    assert (await coord.stats())["counters"]["token_lists_out_of_range"] == 1


async def test_a_token_id_outside_uint32_claims_no_other_namespaces_content(coord):
    await coord.post_events(batch(entry("aa01", A, offset=8)))
    await coord.post_events(batch(entry("aa01", [1, 2, 3, 2**32], offset=0, salt="t1"),
                                  seq=2))
    assert await coord.lookup(A) == [("aa01", 8, 0)]
    assert await coord.lookup(A, salt="t1") == []


# --- the ingest gate ------------------------------------------------------------------


async def test_higher_incarnation_fences_the_instances_earlier_chunks(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0), entry("bb02", B, offset=4)))
    reply = await coord.post_events(batch(entry("dd03", D, offset=0), incarnation=1, seq=1))
    assert reply["applied"] == 1
    assert await coord.lookup(A + B) == []
    assert await coord.lookup(D) == [("dd03", 0, 0)]
    stats = await coord.stats()
    assert (stats["num_keys"], stats["blend"]["num_chunks"]) == (1, 1)


async def test_fencing_one_instance_keeps_another_instances_placement_of_the_same_key(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0), instance="i0"),
                            batch(entry("aa01", A, offset=0), instance="i1"))
    await coord.post_events(batch(incarnation=1, instance="i0", event_type="access"))
    assert await coord.lookup(A) == [("aa01", 0, 0)]
    assert (await coord.stats())["num_placements"] == 1


async def test_lower_incarnation_is_counted_stale_and_changes_nothing(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0), incarnation=2, seq=5))
    before = await coord.stats()
    reply = await coord.post_events(batch(entry("bb02", B, offset=0), incarnation=1, seq=9),
                                    batch(entry("aa01"), incarnation=1, seq=10,
                                          event_type="delete"))
    assert reply == {"applied": 0, "duplicates": 0, "stale": 2}
    assert await coord.lookup(B) == []
    assert await coord.lookup(A) == [("aa01", 0, 0)]
    assert _without_counters(await coord.stats()) == _without_counters(before)


async def test_replayed_seq_is_counted_duplicate_and_changes_nothing(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0), seq=1),
                            batch(entry("bb02", B, offset=0), seq=2))
    before = await coord.stats()
    reply = await coord.post_events(batch(entry("dd03", D, offset=0), seq=2),
                                    batch(entry("aa01"), seq=1, event_type="delete"))
    assert reply == {"applied": 0, "duplicates": 2, "stale": 0}
    assert await coord.lookup(D) == []
    assert await coord.lookup(A) == [("aa01", 0, 0)]
    assert _without_counters(await coord.stats()) == _without_counters(before)


async def test_batches_of_one_body_apply_in_order(coord):
    reply = await coord.post_events(batch(entry("aa01", A, offset=0), seq=1),
                                    batch(entry("aa01"), seq=2, event_type="delete"),
                                    batch(entry("bb02", B, offset=0), seq=3))
    assert reply["applied"] == 3
    assert await coord.lookup(A + B) == [("bb02", 0, 4)]


async def test_each_instance_has_its_own_cursor(coord):
    reply = await coord.post_events(batch(entry("aa01", A, offset=0), instance="i0", seq=7),
                                    batch(entry("bb02", B, offset=0), instance="i1", seq=1))
    assert reply == {"applied": 2, "duplicates": 0, "stale": 0}


def _without_counters(stats: dict) -> dict:
    # The gate's per-emitter figures move with every applied batch, as counters do.
    return {k: v for k, v in stats.items() if k not in ("counters", "ingest_streams")}


# --- blend lookup switch ----------------------------------------------------------------


async def test_without_blend_lookup_nothing_is_indexed_or_matched(start):
    coord = await start(enable_blend_lookup=False)
    await coord.post_events(batch(entry("aa01", A, offset=0)))
    assert await coord.lookup(A) == []
    stats = await coord.stats()
    assert stats["num_keys"] == 1 and stats["blend_enabled"] is False
    assert stats["blend"]["num_chunks"] == 0 and stats["blend"]["num_contents"] == 0


async def test_chunks_stored_before_enabling_are_not_backfilled(start):
    coord = await start(enable_blend_lookup=False)
    await coord.post_events(batch(entry("aa01", A, offset=0)))
    await asyncio.to_thread(coord.directory.enable_blend_lookup)
    assert await coord.lookup(A) == []
    # A token-less store cannot revive it either: its content was never recorded.
    await coord.post_events(batch(entry("aa01", offset=0, salt="t1"), seq=2))
    assert await coord.lookup(A, salt="t1") == []
    # ...while what is stored from now on is indexed.
    await coord.post_events(batch(entry("bb02", B, offset=4), seq=3))
    assert await coord.lookup(A + B) == [("bb02", 4, 4)]


# --- namespaces -------------------------------------------------------------------------


@pytest.mark.parametrize("requester", [
    {"model": "other-model"}, {"salt": "t1"}, {"world_size": 2}],
    ids=["model", "salt", "world_size"])
async def test_no_match_across_namespaces(coord, requester):
    await coord.post_events(batch(entry("aa01", A, offset=0, model="m", salt="t0")))
    assert await coord.lookup(A, **{"model": "m", "salt": "t0", **requester}) == []
    assert await coord.lookup(A, model="m", salt="t0") == [("aa01", 0, 0)]


async def test_object_group_id_is_not_part_of_the_namespace(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0, group=3)))
    assert await coord.lookup(A) == [("aa01", 0, 0)]


async def test_a_chunk_two_tenants_stored_serves_both_until_one_tenants_key_goes(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0, salt="t0"),
                                  entry("aa01", A, offset=0, salt="t1")))
    for salt in ("t0", "t1"):
        assert await coord.lookup(A, salt=salt) == [("aa01", 0, 0)]
    blend = (await coord.stats())["blend"]
    assert (blend["num_contents"], blend["num_chunks"], blend["num_claims"]) == (1, 1, 2)
    await coord.post_events(batch(entry("aa01", salt="t0"), seq=2, event_type="delete"))
    assert await coord.lookup(A, salt="t0") == []
    assert await coord.lookup(A, salt="t1") == [("aa01", 0, 0)]
    assert (await coord.stats())["blend"]["num_claims"] == 1


async def test_same_content_under_two_tenants_hashes_is_stored_once(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0, salt="t0"),
                                  entry("ab01", A, offset=8, salt="t1")))
    assert await coord.lookup(A, salt="t0") == [("aa01", 0, 0)]
    assert await coord.lookup(A, salt="t1") == [("ab01", 8, 0)]
    blend = (await coord.stats())["blend"]
    assert (blend["num_contents"], blend["num_chunks"], blend["num_claims"]) == (1, 2, 2)
    await coord.post_events(batch(entry("ab01", salt="t1"), seq=2, event_type="delete"))
    assert await coord.lookup(A, salt="t1") == []
    assert await coord.lookup(A, salt="t0") == [("aa01", 0, 0)]


# --- malformed input: 422 naming the field, nothing applied --------------------------------

GOOD = entry("aa01", A, offset=0)


def _with(base: dict, **changes) -> dict:
    return {**base, **changes}


BAD_EVENTS = {
    "negative offset other than -1": (
        [batch(entry("bb02", B, offset=-2))], "token_offset"),
    "bad hex": ([batch(entry("zz01", B, offset=0))], "chunk_hash_hex"),
    "odd-length hex": ([batch(entry("abc", B, offset=0))], "chunk_hash_hex"),
    "tier all": ([batch(GOOD, tier="all")], "tier"),
    "empty instance id": ([batch(GOOD, instance="")], "instance_id"),
    "seq 0": ([batch(GOOD, seq=0)], "seq"),
    "negative incarnation": ([batch(GOOD, incarnation=-1)], "incarnation"),
    "unknown event type": ([batch(GOOD, event_type="evict")], "event_type"),
    "store without backend": ([batch(GOOD, backend="")], "backend"),
    "token ids of the wrong JSON type": ([batch(_with(GOOD, token_ids="1,2,3,4"))],
                                         "token_ids"),
    "a float token id": ([batch(GOOD, entry("bb02", [21, 22, 2.5, 24], offset=4))],
                         "$.batches[0].entries[1].token_ids[2]"),
    "a bool token id in the last batch": (
        [batch(GOOD, seq=1), batch(entry("bb02", [21, True, 23, 24], offset=4), seq=2)],
        "$.batches[1].entries[0].token_ids[1]"),
    "only the last entry is bad": (
        [batch(GOOD, entry("bb02", B, offset=4), entry("dd03", D, offset=-5))],
        "entries[2]"),
    "only the last batch is bad": (
        [batch(GOOD, seq=1), batch(entry("bb02", B, offset=0), seq=2, tier="all")],
        "batches[1]"),
}


@pytest.mark.parametrize("batches,field", BAD_EVENTS.values(), ids=BAD_EVENTS.keys())
async def test_malformed_events_are_422_naming_the_field_and_apply_nothing(
        coord, batches, field):
    await coord.post_events(batch(entry("ee04", D, offset=0), instance="seed"))
    before = await coord.stats()
    response = await coord.client.post(EVENTS_PATH, data=encode({"batches": batches}))
    assert response.status == 422
    assert field in refusal(await response.json())
    assert await coord.stats() == before
    assert await coord.lookup(A + B + D) == [("ee04", 0, 8)]
    # Nothing of the body moved the gate either: its seq 1 is still fresh.
    assert (await coord.post_events(batch(GOOD)))["applied"] == 1


@pytest.mark.parametrize("raw", [b"{not json", b"[]", b'{"batches": {}}', b"{}"],
                         ids=["not json", "array", "batches not a list", "no batches"])
async def test_events_body_of_the_wrong_shape_is_422(coord, raw):
    response = await coord.client.post(EVENTS_PATH, data=raw)
    assert response.status == 422
    assert refusal(await response.json())
    assert (await coord.stats())["num_keys"] == 0


BAD_LOOKUPS = {
    "bad base64": ({"tokens_b64": "AQAAAA!!", "model_name": "m"}, "tokens_b64"),
    "bad padding": ({"tokens_b64": "AQAAAAIAAAA", "model_name": "m"}, "tokens_b64"),
    "length not a multiple of 4": ({"tokens_b64": "AQAAAAI=", "model_name": "m"},
                                   "tokens_b64"),
    "tokens without model name": ({"tokens_b64": encode_tokens(A)}, "model_name"),
    "world size 0": ({"tokens_b64": encode_tokens(A), "model_name": "m", "world_size": 0},
                     "world_size"),
    "world size of the wrong JSON type": (
        {"tokens_b64": encode_tokens(A), "model_name": "m", "world_size": "1"}, "world_size"),
    "tokens of the wrong JSON type": ({"tokens_b64": [1, 2], "model_name": "m"},
                                      "tokens_b64"),
}


@pytest.mark.parametrize("body,field", BAD_LOOKUPS.values(), ids=BAD_LOOKUPS.keys())
async def test_malformed_lookups_are_422_naming_the_field(coord, body, field):
    await coord.post_events(batch(GOOD))
    before = await coord.stats()
    response = await coord.client.post(BLEND_LOOKUP_PATH, data=encode(body))
    assert response.status == 422
    assert field in refusal(await response.json())
    assert await coord.stats() == before
    assert await coord.lookup(A) == [("aa01", 0, 0)]


async def test_lookup_defaults_ask_for_nothing_and_get_nothing(coord):
    response = await coord.client.post(BLEND_LOOKUP_PATH, data=b"{}")
    assert response.status == 200
    assert await response.json() == {"matches": []}


# --- limits -------------------------------------------------------------------------------


async def test_body_over_the_cap_is_413_and_the_next_request_is_served(start):
    coord = await start(max_body_bytes=2048)
    big = batch(*[entry(f"{i:04x}", [i, i, i, i], offset=0) for i in range(40)])
    response = await coord.client.post(EVENTS_PATH, data=encode({"batches": [big]}))
    assert response.status == 413
    assert "max-body-bytes" in (await response.json())["detail"]
    assert (await coord.stats())["num_keys"] == 0
    assert (await coord.post_events(batch(GOOD)))["applied"] == 1
    assert await coord.lookup(A) == [("aa01", 0, 0)]


async def test_chunked_body_over_the_cap_is_413(start):
    coord = await start(max_body_bytes=2048)

    async def chunks():  # no Content-Length: the cap must hold while reading
        for _ in range(10):
            yield b" " * 512
    response = await coord.client.post(EVENTS_PATH, data=chunks())
    assert response.status == 413
    assert (await coord.post_events(batch(GOOD)))["applied"] == 1


async def test_query_over_the_token_cap_is_413_and_others_are_served(start):
    coord = await start(max_query_tokens=16)
    await coord.post_events(batch(GOOD))
    for length in (17, 400):
        body = {"tokens_b64": encode_tokens([1] * (length - C) + A), "model_name": "m"}
        response = await coord.client.post(BLEND_LOOKUP_PATH, data=encode(body))
        assert response.status == 413, length
        assert "max-query-tokens" in (await response.json())["detail"]
    assert await coord.lookup([1] * 12 + A) == [("aa01", 0, 12)]


# --- the event loop stays free ------------------------------------------------------------


async def test_a_stalled_match_blocks_neither_health_nor_ingest(coord, monkeypatch):
    directory = coord.directory
    entered, release = threading.Event(), threading.Event()
    real_match = directory.match

    def slow_match(tokens, namespace, **kwargs):
        entered.set()
        release.wait(10)
        return real_match(tokens, namespace, **kwargs)

    monkeypatch.setattr(directory, "match", slow_match)
    await coord.post_events(batch(GOOD))
    filler = [7] * 30_000  # too large to be matched on the loop: the match pool runs it
    pending = asyncio.ensure_future(coord.lookup(filler + A))
    assert await asyncio.to_thread(entered.wait, 5)
    try:
        health = await asyncio.wait_for(coord.client.get(HEALTH_PATH), 2)
        assert health.status == 200
        reply = await asyncio.wait_for(
            coord.post_events(batch(entry("bb02", B, offset=0), seq=2)), 2)
        assert reply["applied"] == 1
        assert not pending.done()
    finally:
        release.set()
    assert await pending == [("aa01", 0, 30_000)]


async def test_a_small_lookup_never_holds_the_loop_while_ingest_writes_the_index(coord):
    """Small lookups are matched on the event loop while the match pool is idle; one that
    would wait for the index (ingest writing it) waits on the pool instead, so health
    checks and ingest bodies are still answered meanwhile."""
    await coord.post_events(batch(GOOD))
    held, release = threading.Event(), threading.Event()

    def ingest_writing_the_index():  # stuck for 5 s at most, so a blocked loop fails
        with coord.directory._index._lock:
            held.set()
            release.wait(5)

    writer = threading.Thread(target=ingest_writing_the_index)
    writer.start()
    try:
        assert await asyncio.to_thread(held.wait, 5)
        pending = asyncio.ensure_future(coord.lookup(A))
        asked = time.monotonic()
        health = await coord.client.get(HEALTH_PATH)
        assert health.status == 200 and time.monotonic() - asked < 2
        await asyncio.sleep(0.1)
        assert not pending.done()
    finally:
        release.set()
        writer.join()
    assert await asyncio.wait_for(pending, 10) == [("aa01", 0, 0)]


async def test_health(coord):
    response = await coord.client.get(HEALTH_PATH)
    assert response.status == 200


async def test_a_large_query_is_parsed_off_the_loop_and_matched(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0)))
    filler = [7] * 100_000  # ~530 KB of base64: parsed on the matcher thread
    assert await coord.lookup(filler + A) == [("aa01", 0, 100_000)]
    body = {"tokens_b64": encode_tokens(filler)[:-1], "model_name": "m"}
    response = await coord.client.post(BLEND_LOOKUP_PATH, data=encode(body))
    assert response.status == 422
    assert "tokens_b64" in refusal(await response.json())


async def test_config_batches_record_capacity_and_access_batches_change_nothing(coord):
    await coord.post_events(batch(GOOD))
    before = await coord.stats()
    config = {**batch(seq=2, event_type="config", tier="l2", backend="disk"),
              "capacity_bytes": 1 << 30, "capacity_revision": 3}
    reply = await coord.post_events(config, batch(GOOD, seq=3, event_type="access"))
    assert reply["applied"] == 2
    stats = await coord.stats()
    assert stats["capacity"] == [{"instance_id": "i0", "tier": "l2", "backend": "disk",
                                  "capacity_bytes": 1 << 30, "capacity_revision": 3}]
    assert (stats["num_keys"], stats["num_placements"], stats["blend"]) == (
        before["num_keys"], before["num_placements"], before["blend"])


async def test_a_config_batch_with_entries_is_422(coord):
    response = await coord.client.post(EVENTS_PATH, data=encode(
        {"batches": [batch(GOOD, event_type="config")]}))
    assert response.status == 422
    assert "config" in refusal(await response.json())
    assert (await coord.stats())["num_keys"] == 0


async def test_deleting_an_unknown_key_is_applied_and_changes_nothing(coord):
    await coord.post_events(batch(GOOD))
    before = await coord.stats()
    reply = await coord.post_events(batch(entry("ff09"), entry("aa01", salt="t9"), seq=2,
                                          event_type="delete"))
    assert reply["applied"] == 1
    assert _without_counters(await coord.stats()) == _without_counters(before)
    assert await coord.lookup(A) == [("aa01", 0, 0)]
