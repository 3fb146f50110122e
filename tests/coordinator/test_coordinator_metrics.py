"""`GET /metrics` over HTTP: Prometheus text with LMCache's key-directory gauges and ours,
read from running totals; 404 with metrics off."""

from __future__ import annotations

import asyncio
import threading

from blend_wire import DIRECTORY_LOOKUP_PATH, METRICS_PATH, encode
from coordinator_client import batch, entry, key, scrape

LANE = "unit"

A = [11, 12, 13, 14]


async def test_lmcache_directory_gauges_by_tier(start):
    coord = await start()
    await coord.post_events(batch(entry("aa01", A, offset=0, size=100), entry("bb02", size=5)),
                            batch(entry("aa01", size=7), seq=2, tier="l2", backend="fs"))
    samples = await scrape(coord)
    gauge = "lmcache_coordinator_key_directory_placements"
    assert samples[(gauge, (("tier", "l1"),))] == 2
    assert samples[(gauge, (("tier", "l2"),))] == 1
    gauge = "lmcache_coordinator_key_directory_placement_bytes"
    assert samples[(gauge, (("tier", "l1"),))] == 105
    assert samples[(gauge, (("tier", "l2"),))] == 7
    assert ("process_resident_memory_bytes", ()) in samples


async def test_our_series_count_events_lookups_matches_index_and_refusals(start):
    coord = await start()
    await coord.register("i0")
    await coord.post_events(batch(entry("aa01", A, offset=0), entry("bb02")),
                            batch(entry("aa01"), seq=2, event_type="delete"))
    await coord.post_events(batch(entry("cc03"), seq=2), batch(entry("cc03"), seq=1))  # dups
    await coord.post_events(batch(entry("aa01", A, offset=0), seq=3))
    await coord.lookup([7] + A)
    await coord.lookup(A + [7])
    await coord.directory_lookup(keys=[key("aa01")])
    await coord.call("POST", "/events", expect=422, data=b"{}")
    await coord.call("POST", DIRECTORY_LOOKUP_PATH, expect=400, data=encode(
        {"token_ids": [1], "model_name": "a@b"}))
    samples = await scrape(coord)
    assert samples[("blend_coordinator_event_batches_total", (("outcome", "applied"),))] == 3
    assert samples[("blend_coordinator_event_batches_total", (("outcome", "duplicate"),))] == 2
    assert samples[("blend_coordinator_event_entries_total", (("outcome", "applied"),))] == 4
    assert samples[("blend_coordinator_event_entries_total", (("outcome", "duplicate"),))] == 2
    assert samples[("blend_coordinator_entries_applied_total",
                    (("event_type", "delete"),))] == 1
    blend = (("endpoint", "blend-lookup"),)
    assert samples[("blend_coordinator_lookup_seconds_count", blend)] == 2
    assert samples[("blend_coordinator_lookup_seconds_bucket", (*blend, ("le", "+Inf")))] == 2
    assert samples[("blend_coordinator_lookup_seconds_count",
                    (("endpoint", "directory-lookup"),))] == 1
    assert samples[("blend_coordinator_matches_returned_total", ())] == 2
    assert samples[("blend_coordinator_index_chunks", ())] == 1
    assert samples[("blend_coordinator_index_contents", ())] == 1
    assert samples[("blend_coordinator_index_bytes", ())] > 0
    assert samples[("blend_coordinator_directory_keys", ())] == 2
    assert samples[("blend_coordinator_instances_registered", ())] == 1
    assert samples[("blend_coordinator_rejected_requests_total",
                    (("reason", "validation"),))] == 1
    assert samples[("blend_coordinator_rejected_requests_total",
                    (("reason", "bad_request"),))] == 1


async def test_disabled_metrics_are_404(start):
    coord = await start(enable_metrics=False)
    await coord.call("GET", METRICS_PATH, expect=404)
    assert await coord.lookup(A) == []  # and everything else works without them


async def test_a_scrape_does_not_wait_for_ingest(start):
    """While the ingest thread holds the directory lock, a scrape still answers: it
    reads running totals and never takes that lock."""
    coord = await start()
    await coord.post_events(batch(entry("aa01", A, offset=0)))
    directory = coord.directory
    entered, release = threading.Event(), threading.Event()
    real_ingest = directory.ingest

    def stuck_ingest(batches, speaks_for=None):
        with directory._lock:
            entered.set()
            release.wait(10)
        return real_ingest(batches, speaks_for)

    directory.ingest = stuck_ingest
    pending = asyncio.ensure_future(coord.post_events(batch(entry("bb02"), seq=2)))
    try:
        assert await asyncio.to_thread(entered.wait, 5)
        samples = await asyncio.wait_for(scrape(coord), 5)
        assert samples[("blend_coordinator_directory_keys", ())] == 1
        assert not pending.done()
    finally:
        release.set()
    assert (await pending)["applied"] == 1
