"""LMCache 0.5.7's coordinator contract, over HTTP against ours: chunk-size binding,
`dropped_events` and the gate's loss figures, departed-instance fencing, and the
chunk-size mismatch warning (on either version).

LMCache 0.5.7's own test files are not in its wheel (nor in the reference index this
project reads), so these port the behaviours its source states, rule by rule:
`http_apis/config_api.py` and `dependencies.py` (`bind_chunk_size`: the first binding at
or above the configured minimum fixes the size, the same again is idempotent, a different
one or one below the minimum is a 409), `http_apis/instances_api.py` (a registration's
`chunk_size` binds first, 409 registers nothing; a registration readmits the instance),
`ingest/event_gate.py` (`_admit`: missing batches counted only in a tracked stream,
`dropped_events` rises counted, a stream joined midway only remembered, a new
incarnation starts clean, totals never reset; a departed instance's L1 refused until it
registers, its L2 taken, a higher incarnation taken) and `observability.py` (the gate's
series). Each test names the 0.5.7 rule it ports. WIRE.md says where ours differs.
"""

from __future__ import annotations

import logging
import time

import pytest

from blend_wire import CHUNK_SIZE_PATH, INSTANCES_PATH, encode, pack_kv_rank
from coordinator_client import C, batch, entry, refusal, scrape

LANE = "unit"

A = [11, 12, 13, 14]
A8 = list(range(100, 108))  # one chunk at a bound size of 8


async def _bind(coord, chunk_size, expect: int = 200) -> dict:
    response = await coord.call("PUT", CHUNK_SIZE_PATH, expect,
                                data=encode({"chunk_size": chunk_size}))
    return await response.json()


def _with_drops(body: dict, dropped: int, ts: float = 0.0) -> dict:
    return {**body, "dropped_events": dropped, "ts": ts}


# --- chunk-size binding (config_api.py, dependencies.py) --------------------------------


async def test_binding_the_configured_size_is_idempotent(coord):
    """`bind_chunk_size`: the first binding fixes the size; repeating it answers it."""
    assert await _bind(coord, C) == {"chunk_size": C}
    assert await _bind(coord, C) == {"chunk_size": C}
    assert (await coord.stats())["chunk_size"] == C


async def test_a_binding_above_the_minimum_moves_hashing_and_the_index(coord):
    """A first binding above the configured minimum: the blend index is rebuilt at it."""
    assert await _bind(coord, 8) == {"chunk_size": 8}
    assert (await coord.stats())["chunk_size"] == 8
    await coord.post_events(batch(entry("aa01", A8, offset=0)))
    assert await coord.lookup([1, 2] + A8) == [("aa01", 0, 2)]
    # Token lookups hash at the bound size: 8 tokens are one chunk now, 4 are none.
    reply = await coord.directory_lookup(token_ids=A8, model_name="m")
    assert reply["chunks"] == 1
    reply = await coord.directory_lookup(token_ids=A, model_name="m")
    assert reply["chunks"] == 0


async def test_a_different_size_after_binding_is_a_conflict(coord):
    """`bind_chunk_size`: once bound, a different size raises (409), nothing changes."""
    await _bind(coord, 8)
    body = await _bind(coord, 12, expect=409)
    assert "already bound to chunk size 8" in body["detail"]
    assert "chunk size 12" in body["detail"]
    assert (await coord.stats())["chunk_size"] == 8
    assert await _bind(coord, 8) == {"chunk_size": 8}


async def test_a_size_below_the_configured_minimum_is_refused(coord):
    body = await _bind(coord, C - 1, expect=409)
    assert f"smaller than the coordinator's configured minimum {C}" in body["detail"]
    # Nothing was bound: a valid size still can be.
    assert await _bind(coord, 8) == {"chunk_size": 8}


@pytest.mark.parametrize("body", [{"chunk_size": 0}, {"chunk_size": "8"}, {}])
async def test_an_invalid_binding_is_a_422(coord, body):
    """`ChunkSizeBindRequest`: `chunk_size: int = Field(ge=1)`."""
    response = await coord.call("PUT", CHUNK_SIZE_PATH, 422, data=encode(body))
    assert "chunk_size" in refusal(await response.json())
    assert (await coord.stats())["chunk_size"] == C


async def test_rebinding_takes_indexed_chunks_out_of_the_index_and_keeps_placements(coord):
    """`KeyDirectory.bind_chunk_size`: contents of the old size are no chunks at the new
    one; the placements (and the tokens directory queries show) stay."""
    await coord.post_events(batch(entry("aa01", A, offset=0)))
    assert await coord.lookup(A) == [("aa01", 0, 0)]
    await _bind(coord, 8)
    assert await coord.lookup(A + A) == []
    keys = await coord.keys()
    assert keys["total"] == 1 and keys["keys"][0]["num_tokens"] == C  # shown, not indexed
    lookup = await coord.directory_lookup(keys=[{"chunk_hash_hex": "aa01", "model_name": "m",
                                                 "kv_rank": pack_kv_rank(1)}])
    assert lookup["results"][0]["token_ids"] == A
    assert len(lookup["results"][0]["placements"]) == 1


async def test_a_registration_carrying_a_chunk_size_binds_it(coord):
    """`register_instance`: `body.chunk_size` is bound before the instance registers."""
    await coord.register("s1", chunk_size=8)
    assert (await coord.stats())["chunk_size"] == 8
    await coord.register("s2", chunk_size=8)
    assert [i["instance_id"] for i in await coord.instances()] == ["s1", "s2"]


async def test_a_registration_with_a_conflicting_size_registers_nothing(coord):
    await coord.register("s1", chunk_size=8)
    body = await coord.register("s2", expect=409, chunk_size=12)
    assert "already bound to chunk size 8" in body["detail"]
    assert [i["instance_id"] for i in await coord.instances()] == ["s1"]
    await coord.register("s3")  # no chunk_size (LMCache 0.5.6 servers): as before
    assert [i["instance_id"] for i in await coord.instances()] == ["s1", "s3"]


async def test_replicas_keep_their_configured_size(coord):
    """Ours, not LMCache's: with an event log the size cannot move (WIRE.md)."""
    coord.coordinator.config = type(coord.coordinator.config)(
        **{**vars(coord.coordinator.config), "cluster": object()})
    body = await _bind(coord, 8, expect=409)
    assert "restart every replica with --chunk-size 8" in body["detail"]
    assert await _bind(coord, C) == {"chunk_size": C}


# --- dropped_events and the gate's loss figures (event_gate.py, observability.py) --------


async def test_rises_of_dropped_events_are_counted_per_emitter(coord):
    await coord.post_events(_with_drops(batch(entry("aa01", A, offset=0), seq=1), 0),
                            _with_drops(batch(entry("bb02"), seq=2), 5),
                            _with_drops(batch(entry("cc03"), seq=3), 5),
                            _with_drops(batch(entry("dd04"), seq=4, instance="i1"), 0))
    reply = await coord.post_events(_with_drops(batch(entry("ee05"), seq=4), 9))
    assert reply["applied"] == 1
    stats = await coord.stats()
    i0, i1 = stats["ingest_streams"]["i0"], stats["ingest_streams"]["i1"]
    assert (i0["events_dropped"], i0["gap_detected"], i0["missing_batches"]) == (9, True, 0)
    assert (i1["events_dropped"], i1["gap_detected"]) == (0, True)  # joined at seq 4
    assert stats["counters"]["events_dropped"] == 9
    samples = await scrape(coord)
    assert samples[("lmcache_coordinator_ingest_events_dropped_by_servers_total", ())] == 9
    assert samples[("lmcache_coordinator_ingest_server_events_dropped",
                    (("instance_id", "i0"),))] == 9
    assert samples[("lmcache_coordinator_ingest_server_view_incomplete",
                    (("instance_id", "i0"),))] == 1


async def test_a_stream_joined_midway_only_remembers_its_first_report(coord):
    """`last_dropped_events=0 if tracked or batch.seq == 1 else None`."""
    await coord.post_events(_with_drops(batch(entry("aa01"), seq=3), 7))
    assert (await coord.stats())["ingest_streams"]["i0"]["events_dropped"] == 0
    await coord.post_events(_with_drops(batch(entry("bb02"), seq=4), 9))
    assert (await coord.stats())["ingest_streams"]["i0"]["events_dropped"] == 2


async def test_missing_batches_count_only_in_a_tracked_stream(coord):
    await coord.post_events(batch(entry("aa01"), seq=5))  # first seen at 5: counts none
    stats = await coord.stats()
    assert stats["ingest_streams"]["i0"]["missing_batches"] == 0
    assert stats["ingest_streams"]["i0"]["gap_detected"] is True
    await coord.post_events(batch(entry("aa01"), seq=6), batch(entry("aa01"), seq=9))
    stats = await coord.stats()
    assert stats["ingest_streams"]["i0"]["missing_batches"] == 2
    assert stats["counters"]["batches_missing"] == 2
    samples = await scrape(coord)
    assert samples[("lmcache_coordinator_ingest_event_batches_missing_total", ())] == 2


async def test_a_contiguous_stream_with_no_drops_is_complete(coord):
    await coord.post_events(batch(entry("aa01"), seq=1), batch(entry("aa01"), seq=2))
    stream = (await coord.stats())["ingest_streams"]["i0"]
    assert (stream["gap_detected"], stream["missing_batches"], stream["events_dropped"]) \
        == (False, 0, 0)


async def test_a_new_incarnation_starts_clean_and_the_totals_stay(coord):
    await coord.post_events(_with_drops(batch(entry("aa01"), seq=1), 0),
                            _with_drops(batch(entry("aa01"), seq=3), 4))
    await coord.post_events(_with_drops(batch(entry("aa01"), seq=1, incarnation=1), 0))
    stats = await coord.stats()
    stream = stats["ingest_streams"]["i0"]
    assert (stream["incarnation"], stream["gap_detected"], stream["missing_batches"],
            stream["events_dropped"]) == (1, False, 0, 0)
    assert (stats["counters"]["batches_missing"], stats["counters"]["events_dropped"]) \
        == (1, 4)


async def test_duplicate_and_stale_batches_count_no_loss(coord):
    await coord.post_events(_with_drops(batch(entry("aa01"), seq=2, incarnation=1), 0),
                            _with_drops(batch(entry("aa01"), seq=3, incarnation=1), 0))
    reply = await coord.post_events(_with_drops(batch(entry("aa01"), seq=3, incarnation=1), 50),
                                    _with_drops(batch(entry("aa01"), seq=9), 70))
    assert reply == {"applied": 0, "duplicates": 1, "stale": 1}
    stats = await coord.stats()
    assert stats["counters"]["events_dropped"] == 0
    assert stats["ingest_streams"]["i0"]["last_seq"] == 3


async def test_delivery_delay_and_last_event_time(coord):
    sent = time.time() - 100
    before = time.time()
    await coord.post_events(_with_drops(batch(entry("aa01")), 0, ts=sent))
    stream = (await coord.stats())["ingest_streams"]["i0"]
    assert stream["event_delivery_delay_seconds"] >= 100
    assert stream["last_event_time"] >= before
    samples = await scrape(coord)
    assert samples[("lmcache_coordinator_ingest_server_event_delivery_delay_seconds",
                    (("instance_id", "i0"),))] >= 100
    assert samples[("lmcache_coordinator_ingest_server_seconds_since_last_event",
                    (("instance_id", "i0"),))] >= 0
    await coord.post_events(batch(entry("aa01"), seq=2))  # no ts: the last delay stays
    assert (await coord.stats())["ingest_streams"]["i0"]["event_delivery_delay_seconds"] >= 100


@pytest.mark.parametrize("dropped", [-1, "3", 2**63])
async def test_an_invalid_dropped_events_refuses_the_body(coord, dropped):
    """`CacheEventBatch.__post_init__`: `dropped_events must be >= 0`."""
    response = await coord.call("POST", "/events", 422, data=encode({"batches": [
        batch(entry("aa01", A, offset=0)),
        _with_drops(batch(entry("bb02"), seq=2), dropped)]}))
    assert "dropped_events" in refusal(await response.json())
    assert (await coord.stats())["num_keys"] == 0


# --- departed instances (event_gate.py `drop_instance` / `readmit_instance`) -------------


async def test_a_reaped_instance_is_readmitted_by_registering_again(start):
    coord = await start(health_check_interval=0.05, instance_timeout=0.2)
    await coord.register("slow")
    await coord.post_events(batch(entry("aa01", A, offset=0), instance="slow"))
    # Reaped = unlisted and fenced: the reaper deregisters first and fences just after (off
    # the loop), so a batch posted in between would still be taken; wait for both.
    deadline = time.monotonic() + 20
    while ((await coord.instances() or await coord.lookup(A))
           and time.monotonic() < deadline):
        await coord.call("GET", "/healthz")
    assert await coord.instances() == [] and await coord.lookup(A) == []
    # Still sending, same incarnation: L1 refused (its slice was fenced), L2 taken.
    reply = await coord.post_events(batch(entry("bb02", A, offset=0), instance="slow", seq=2),
                                    batch(entry("cc03"), instance="slow", seq=3, tier="l2",
                                          backend="fs"))
    assert reply == {"applied": 1, "duplicates": 0, "stale": 1}
    assert await coord.lookup(A) == []
    # Its next heartbeat is a 404; LMCache's registrar registers again and is taken again.
    await coord.call("PUT", f"{INSTANCES_PATH}/slow/heartbeat", 404)
    await coord.register("slow")
    reply = await coord.post_events(batch(entry("bb02", A, offset=0), instance="slow", seq=4))
    assert reply == {"applied": 1, "duplicates": 0, "stale": 0}
    assert await coord.lookup(A) == [("bb02", 0, 0)]


# --- a chunk-size mismatch is loud (either LMCache version) ------------------------------


async def test_a_chunk_size_mismatch_is_warned_once_per_emitter(coord, caplog):
    caplog.set_level(logging.WARNING, logger="coordinator_stub.directory")
    long = list(range(1, 2 * C + 1))
    await coord.post_events(batch(entry("aa01", long, offset=0), entry("bb02", long, offset=0)),
                            batch(entry("cc03", long, offset=0), seq=2))
    await coord.post_events(batch(entry("dd04", long, offset=0), instance="i1"))
    warnings = [r.getMessage() for r in caplog.records if "chunk size" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert "instance i0 stores chunks of 8 tokens but this coordinator's chunk size is 4" \
        in warnings[0]
    assert "--chunk-size 8" in warnings[0] and "instance i1" in warnings[1]
    assert await coord.lookup(long) == []
    samples = await scrape(coord)
    assert samples[("blend_coordinator_chunk_size_mismatch_entries_total", ())] == 4
    assert samples[("blend_coordinator_chunk_size_mismatched_emitters_total", ())] == 2
    # Once the fleet binds the size the servers use, their STOREs are indexed.
    await _bind(coord, 2 * C)
    await coord.post_events(batch(entry("aa01", long, offset=0), seq=3))
    assert await coord.lookup(long) == [("aa01", 0, 0)]
