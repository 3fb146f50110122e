"""Released state and bounded registrations (issue 19, item 3).

Before: 20,000 `config` batches from ids that never registered stayed in the gate and
capacity tables past the reaper window (`/directory/stats` grew to 10 MB, and to 338 MB
with 120k ids of 900 characters); registration `metadata` was unbounded and decoded on
the event loop, and `GET /instances` encoded there too (three 61 MB registrations stalled
`/healthz` 0.7 s). Now the reaper releases the cursor and capacity rows of ids that are
not registered, hold nothing and sent nothing for `--instance-timeout`; a registration
body is at most 64 KiB (413) with at most 16 Ki characters of metadata (422), decoded
off the loop, and the listing is encoded off the loop.
"""

from __future__ import annotations

import asyncio
import threading

from blend_wire import (INSTANCES_PATH, MAX_METADATA_CHARS, MAX_REGISTRATION_BODY_BYTES,
                        encode)
from hostile_helpers import A, batch, entry

LANE = "unit"

GHOSTS = 2000


def _config(instance: str, seq: int = 1) -> dict:
    return dict(batch(instance=instance, seq=seq, event_type="config", tier="l2",
                      backend="disk"), capacity_bytes=1 << 30, capacity_revision=1)


async def test_ids_that_never_register_are_released_by_the_reaper(coord):
    await coord.post_events(*[_config(f"ghost-{i:05d}") for i in range(GHOSTS)])
    await coord.register("registered")
    await coord.post_events(_config("registered"))
    await coord.post_events(batch(entry("aa01", A), instance="zmq-only"))  # holds a chunk
    await coord.post_events(_config("late"))
    stats = await coord.stats()
    assert stats["num_instances"] == GHOSTS + 3 and len(stats["capacity"]) == GHOSTS + 2
    service = coord.coordinator
    assert service.release_ghosts(30.0, now=0.0) == []  # the first sweep only notes them
    await coord.post_events(_config("late", seq=2))  # late speaks again
    released = service.release_ghosts(30.0, now=31.0)
    assert sorted(released) == [f"ghost-{i:05d}" for i in range(GHOSTS)]
    stats = await coord.stats()
    assert set(stats["l1_keys_by_instance"]) == {"registered", "zmq-only", "late"}
    assert {row["instance_id"] for row in stats["capacity"]} == {"registered", "late"}
    assert service.release_ghosts(30.0, now=62.0) == ["late"]
    # A released id that returns starts a fresh stream (it held nothing to fence).
    reply = await coord.post_events(_config("ghost-00001", seq=1))
    assert reply["applied"] == 1
    assert await coord.lookup(A) == [("aa01", 0, 0)]  # what others hold is untouched


async def test_the_running_reaper_releases_them(start):
    coord = await start(instance_timeout=0.2, health_check_interval=0.05)
    await coord.post_events(*[_config(f"ghost-{i}") for i in range(50)])
    assert (await coord.stats())["num_instances"] == 50
    for _ in range(600):  # the reaper runs on this loop: wait for it here, up to 30 s
        stats = await coord.stats()
        if stats["num_instances"] == 0:
            break
        await asyncio.sleep(0.05)
    assert stats["num_instances"] == 0 and stats["capacity"] == []


async def test_registration_metadata_is_bounded(coord):
    body = {"instance_id": "big", "ip": "10.0.0.1", "http_port": 8000,
            "metadata": {"k": "v" * MAX_METADATA_CHARS}}
    response = await coord.client.post(INSTANCES_PATH, data=encode(body))
    assert response.status == 422 and "metadata" in await response.text()
    huge = dict(body, metadata={"k": "v" * MAX_REGISTRATION_BODY_BYTES})
    response = await coord.client.post(INSTANCES_PATH, data=encode(huge))
    assert response.status == 413 and response.headers.get("Connection") == "close"
    ok = dict(body, metadata={"k": "v" * (MAX_METADATA_CHARS - 1)})
    assert (await coord.client.post(INSTANCES_PATH, data=encode(ok))).status == 200
    assert [i["instance_id"] for i in await coord.instances()] == ["big"]


async def test_registrations_are_decoded_and_listings_encoded_off_the_event_loop(coord):
    service, loop_thread = coord.coordinator, threading.get_ident()
    threads: dict[str, int] = {}

    def on_thread(name, work):
        def run(*args):
            threads[name] = threading.get_ident()
            return work(*args)
        return run

    service.parse_register = on_thread("decode", service.parse_register)
    service.instances_listing = on_thread("encode", service.instances_listing)
    await coord.register("i1", metadata={"k": "v" * 1000})
    assert [i["instance_id"] for i in await coord.instances()] == ["i1"]
    assert set(threads) == {"decode", "encode"}
    assert loop_thread not in threads.values()
