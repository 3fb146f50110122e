"""The plugin's registrar (`plugin.registrar`) against real coordinator processes: it
registers at once and heartbeats; when its replica dies it moves to the next one (here
two independent coordinators, so the second answers 404 and it registers there at once);
`close()` deregisters; a registration the coordinator refuses is logged, never raised."""

from __future__ import annotations

import functools
import logging

import httpx

from blend_wire import INSTANCES_PATH
from coordinator_stub.launch.process import launch_coordinator, start_coordinator
from helpers import wait_until
from plugin.registrar import InstanceRegistrar

LANE = "coordinator"

settled = functools.partial(wait_until, timeout=60.0, interval=0.05)


def ids(url: str) -> list[str]:
    return [i["instance_id"] for i in httpx.get(url + INSTANCES_PATH, timeout=10).json()["instances"]]


def test_registers_heartbeats_moves_to_the_next_replica_and_deregisters():
    a = start_coordinator()
    try:
        with launch_coordinator() as b:
            registrar = InstanceRegistrar(f"{a.url}, {b.url}/", instance_id="s1",
                                          ip="127.0.0.1", http_port=8123,
                                          heartbeat_interval=0.1, timeout=5)
            try:
                assert settled(lambda: registrar.stats().heartbeats >= 3), "heartbeats at a"
                assert ids(a.url) == ["s1"] and ids(b.url) == []
                [listed] = httpx.get(a.url + INSTANCES_PATH, timeout=10).json()["instances"]
                assert (listed["ip"], listed["http_port"]) == ("127.0.0.1", 8123)
                a.stop()
                assert settled(lambda: ids(b.url) == ["s1"]), "registered at b"
                stats = registrar.stats()
                assert stats.url == b.url and stats.moved >= 1
                # b never heard of s1: its 404 made the registrar register there at once.
                assert stats.forgotten == 1 and stats.registrations == 2
                assert stats.registered_id == "s1"
            finally:
                registrar.close()
            assert ids(b.url) == []
            registrar.close()  # idempotent
    finally:
        a.stop()


def test_a_refused_registration_is_logged_not_raised(caplog):
    with launch_coordinator() as coordinator:
        with caplog.at_level(logging.ERROR, logger="plugin.registrar"):
            registrar = InstanceRegistrar(coordinator.url, instance_id="s2", ip=" ",
                                          http_port=8123, start=False)
            try:
                registrar.beat()
                assert registrar.registered_id is None
                assert ids(coordinator.url) == []
            finally:
                registrar.close()
        assert "refused the registration: HTTP 422" in caplog.text


def test_a_bound_chunk_size_is_sent_with_every_registration_from_then_on():
    """LMCache 0.5.7 binds a negotiated chunk size through its one URL; with several, the
    plugin's registrar carries it (issue 32, item 8): it registers with it at once (the
    coordinator binds it), and a size the coordinator refuses is raised, as LMCache's bind
    listener does."""
    with launch_coordinator("--chunk-size", "256") as a, launch_coordinator() as b:
        registrar = InstanceRegistrar(f"{a.url},{b.url}", instance_id="s3", ip="127.0.0.1",
                                      http_port=8123, start=False)
        try:
            registrar.beat()
            assert httpx.get(a.url + "/directory/stats", timeout=10).json()["chunk_size"] == 256
            registrar.bind_chunk_size(288)
            assert httpx.get(a.url + "/directory/stats", timeout=10).json()["chunk_size"] == 288
            assert ids(a.url) == ["s3"] and registrar.stats().registrations == 2
            a.stop()
            registrar.beat()  # forgotten at b: registers there, with the bound size
            assert httpx.get(b.url + "/directory/stats", timeout=10).json()["chunk_size"] == 288
            try:
                registrar.bind_chunk_size(512)
            except RuntimeError as exc:
                assert "512" in str(exc)
            else:
                raise AssertionError("a refused chunk size must raise")
        finally:
            registrar.close()
