"""The instance registry over HTTP (WIRE.md, "Instances"): register, heartbeat,
deregister, list, and the reaper, with what a departed instance takes down with it."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from blend_wire import INSTANCES_PATH, encode
from coordinator_client import batch, entry, refusal
from coordinator_stub.service.instances import InstanceRegistry
from helpers import FakeClock

LANE = "unit"

A = [11, 12, 13, 14]
B = [21, 22, 23, 24]



async def test_register_list_heartbeat_deregister(coord):
    before = time.time()
    reply = await coord.register("i1", ip=" 10.0.0.1 ", http_port=8081,
                                 metadata={"zone": "a"}, p2p_advertised_url=" tcp://x:1 ",
                                 mq_port=5555)
    assert reply == {"instance_id": "i1", "re_registered": False}
    [listed] = await coord.instances()
    assert listed.pop("registration_time") >= before
    assert listed == {"instance_id": "i1", "ip": "10.0.0.1", "http_port": 8081,
                      "metadata": {"zone": "a"}, "p2p_advertised_url": "tcp://x:1",
                      "mq_port": 5555}
    response = await coord.call("PUT", f"{INSTANCES_PATH}/i1/heartbeat")
    assert await response.json() == {"instance_id": "i1"}
    response = await coord.call("DELETE", f"{INSTANCES_PATH}/i1", expect=204)
    assert await response.read() == b""
    assert await coord.instances() == []


async def test_defaults_and_a_generated_id(coord):
    reply = await coord.register("  ")
    assert re.fullmatch(r"mp-[0-9a-f]{32}", reply["instance_id"])
    [listed] = await coord.instances()
    assert (listed["metadata"], listed["p2p_advertised_url"], listed["mq_port"]) == ({}, "", 0)
    other = await coord.register()
    assert other["instance_id"] != reply["instance_id"]


async def test_reregistration_replaces_the_record_and_keeps_its_place(coord):
    await coord.register("i1", http_port=1)
    await coord.register("i2")
    reply = await coord.register("i1", http_port=2, metadata={"v": "2"})
    assert reply == {"instance_id": "i1", "re_registered": True}
    listed = await coord.instances()
    assert [i["instance_id"] for i in listed] == ["i1", "i2"]
    assert (listed[0]["http_port"], listed[0]["metadata"]) == (2, {"v": "2"})


async def test_heartbeat_of_an_unknown_instance_is_404_telling_it_to_reregister(coord):
    response = await coord.call("PUT", f"{INSTANCES_PATH}/ghost/heartbeat", expect=404)
    assert await response.json() == {"error": "unknown instance ghost; re-register"}


async def test_deregistering_is_idempotent(coord):
    for _ in range(2):
        await coord.call("DELETE", f"{INSTANCES_PATH}/never-registered", expect=204)


BAD_REGISTRATIONS = {
    "no ip": ({"http_port": 8080}, "ip"),
    "blank ip": ({"ip": "   ", "http_port": 8080}, "ip"),
    "port 0": ({"ip": "h", "http_port": 0}, "http_port"),
    "port 65536": ({"ip": "h", "http_port": 65536}, "http_port"),
    "mq port 65536": ({"ip": "h", "http_port": 1, "mq_port": 65536}, "mq_port"),
    "metadata values not strings": ({"ip": "h", "http_port": 1, "metadata": {"a": 1}},
                                    "metadata"),
}


@pytest.mark.parametrize("body,field", BAD_REGISTRATIONS.values(), ids=BAD_REGISTRATIONS.keys())
async def test_malformed_registration_is_422_and_registers_nothing(coord, body, field):
    response = await coord.call("POST", INSTANCES_PATH, expect=422, data=encode(body))
    assert field in refusal(await response.json())
    assert await coord.instances() == []


async def test_unknown_fields_are_ignored(coord):
    response = await coord.call("POST", INSTANCES_PATH, data=encode(
        {"ip": "h", "http_port": 1, "instance_id": "i1", "future_field": [1, 2]}))
    assert (await response.json())["instance_id"] == "i1"


async def test_events_of_an_unregistered_instance_are_accepted(coord):
    reply = await coord.post_events(batch(entry("aa01", A, offset=0), instance="nobody"))
    assert reply["applied"] == 1
    assert await coord.instances() == []


# --- what leaving takes down ------------------------------------------------------------------


async def _l1_and_l2_of(coord, instance: str) -> None:
    await coord.post_events(batch(entry("aa01", A, offset=0, size=100), instance=instance),
                            batch(entry("bb02", B, offset=4, size=7), instance=instance,
                                  seq=2, tier="l2", backend="disk"))


async def test_deregistering_fences_l1_keeps_l2_and_forgets_the_cursor(coord):
    await coord.register("i1")
    await _l1_and_l2_of(coord, "i1")
    stats = await coord.stats()
    assert stats["l1_keys_by_instance"] == {"i1": 1}
    await coord.call("DELETE", f"{INSTANCES_PATH}/i1", expect=204)
    stats = await coord.stats()
    assert (stats["l1_count"], stats["l1_size_bytes"]) == (0, 0)
    assert (stats["l2_count"], stats["l2_size_bytes"]) == (1, 7)
    assert stats["l1_keys_by_instance"] == {}
    assert await coord.lookup(A) == []
    assert await coord.lookup(B) == [("bb02", 4, 0)]
    # The cursor is gone: seq 1 at incarnation 0 is a fresh stream, not a duplicate, and
    # its L2 batches are applied; its L1 batches wait for it to register again (LMCache
    # 0.5.7: they would lay deltas on the slice the departure fenced).
    reply = await coord.post_events(batch(entry("aa01", A, offset=0), instance="i1"))
    assert reply == {"applied": 0, "duplicates": 0, "stale": 1}
    reply = await coord.post_events(batch(entry("cc03", A, offset=0), instance="i1",
                                          tier="l2", backend="disk"))
    assert reply == {"applied": 1, "duplicates": 0, "stale": 0}
    await coord.register("i1")
    reply = await coord.post_events(batch(entry("aa01", A, offset=0), instance="i1", seq=2))
    assert reply == {"applied": 1, "duplicates": 0, "stale": 0}
    assert (await coord.stats())["l1_keys_by_instance"] == {"i1": 1}


async def test_a_departed_instance_restarting_is_taken_without_registering(coord):
    """A higher incarnation is a restart: its L1 is new, so it is applied (and fenced)."""
    await _l1_and_l2_of(coord, "i1")
    await coord.call("DELETE", f"{INSTANCES_PATH}/i1", expect=204)
    reply = await coord.post_events(batch(entry("aa01", A, offset=0), instance="i1",
                                          incarnation=1))
    assert reply == {"applied": 1, "duplicates": 0, "stale": 0}
    assert (await coord.stats())["l1_keys_by_instance"] == {"i1": 1}


async def test_deregistering_an_instance_leaves_others_placements(coord):
    await coord.post_events(batch(entry("aa01", A, offset=0), instance="i1"),
                            batch(entry("aa01", A, offset=0), instance="i2"))
    await coord.call("DELETE", f"{INSTANCES_PATH}/i1", expect=204)
    assert await coord.lookup(A) == [("aa01", 0, 0)]
    result = await coord.directory_lookup(keys=[{"chunk_hash_hex": "aa01", "model_name": "m",
                                                 "kv_rank": 1 << 24 | 1 << 8}])
    assert [p["instance_id"] for p in result["results"][0]["placements"]] == ["i2"]


def _on_a_fake_clock(coord) -> FakeClock:
    """The coordinator's registry on a clock the test moves (the reaper still sweeps every
    `health_check_interval` of real time, each sweep reading this clock)."""
    clock = FakeClock()
    coord.coordinator.instances = InstanceRegistry(clock=clock)
    return clock


async def _until_listed(coord, ids: list[str], timeout: float = 30.0) -> list[str]:
    """Wait (a generous deadline: the reaper runs on this loaded loop) until the listing is
    `ids`; the listing then."""
    deadline = time.monotonic() + timeout
    while (listed := [i["instance_id"] for i in await coord.instances()]) != ids:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    return listed


async def test_the_reaper_deregisters_a_silent_instance_and_fences_its_l1(start):
    coord = await start(health_check_interval=0.05, instance_timeout=0.3)
    clock = _on_a_fake_clock(coord)
    await coord.register("silent")
    await coord.register("alive")
    await _l1_and_l2_of(coord, "silent")
    clock.advance(0.2)
    await coord.call("PUT", f"{INSTANCES_PATH}/alive/heartbeat")
    clock.advance(0.2)  # silent 0.4 s, past the timeout; alive 0.2 s
    assert await _until_listed(coord, ["alive"]) == ["alive"]
    stats = await coord.stats()
    assert (stats["l1_count"], stats["l2_count"]) == (0, 1)
    assert "silent" not in stats["l1_keys_by_instance"]
    assert await coord.lookup(A) == []
    assert await coord.lookup(B) == [("bb02", 4, 0)]
    # A reaped instance's heartbeat is refused, so it re-registers.
    await coord.call("PUT", f"{INSTANCES_PATH}/silent/heartbeat", expect=404)


@pytest.mark.parametrize("beat", ["heartbeat", "re-register"])
async def test_an_instance_that_keeps_speaking_is_never_reaped(start, beat):
    # Registered with a silent one; 3 s go by on the registry's clock in steps of 0.6 s,
    # each followed by a beat: the silent one is reaped, the speaking one never is.
    coord = await start(health_check_interval=0.05, instance_timeout=1.0)
    clock = _on_a_fake_clock(coord)
    await coord.register("silent")
    await coord.register("alive")
    for _ in range(5):
        clock.advance(0.6)
        if beat == "heartbeat":
            await coord.call("PUT", f"{INSTANCES_PATH}/alive/heartbeat")
        else:
            await coord.register("alive")
    assert await _until_listed(coord, ["alive"]) == ["alive"]


async def test_interval_0_never_reaps(start):
    coord = await start(health_check_interval=0.0, instance_timeout=0.05)
    clock = _on_a_fake_clock(coord)
    await coord.register("silent")
    clock.advance(60.0)
    await asyncio.sleep(0.3)  # what would be six sweeps at the smallest interval here
    assert [i["instance_id"] for i in await coord.instances()] == ["silent"]
