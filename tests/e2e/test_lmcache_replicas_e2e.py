"""A real `lmcache server` (LMCache 0.5.6, and 0.5.7rc2 through tests/e2e/test_lmcache057.py;
HTTP front end, the plugin loaded) given two coordinator replicas in one
`--coordinator-url` list, as `LMCACHE_COORDINATOR_URL=a,b`.

LMCache's own registrar and cache-event sink take one URL (with a list, its registration
task dies on an invalid URL and every event flush fails): the adapter keeps them from
starting and the plugin's registrar and reporter take their place, failing over between
the replicas. What a user relies on, checked here with real processes (a NATS node, two
replicas over one event log, the LMCache server, an engine client): the server is
registered once, and listed alike by both replicas; its stores reach both; replica a is
killed: heartbeats and events move to b, the registration is kept (never re-registered,
never reaped, its placements never fenced) and new stores are found at b; a graceful
stop deregisters it at b. Nothing in the server's log is a failed coordinator call of
LMCache's own.
"""

from __future__ import annotations

import functools
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from blend_wire import BLEND_LOOKUP_PATH, INSTANCES_PATH, STATS_PATH, encode_tokens
from coordinator_stub.launch.nats_process import launch_nats_cluster
from coordinator_stub.launch.process import start_coordinator
from helpers import wait_until

LANE = "lmcache"

pytest.importorskip("lmcache", reason="LMCache 0.5.6 is installed by `make test` (the "
                    "project's Makefile); this test needs its server")

from plugin.harness.lmcache_process import EngineClient, start_lmcache_server  # noqa: E402
from plugin.lmcache.internals import LMCACHE_057  # noqa: E402

C = 256
MODEL = "fleet-model"  # EngineClient's default model
INSTANCE = "server-L"
TIMEOUT_S = 4  # the replicas' --instance-timeout: 8 heartbeat intervals of silence
HEARTBEAT_S = 0.5  # the server's --coordinator-heartbeat-interval
rng = random.Random(20261130)
settled = functools.partial(wait_until, timeout=90.0, interval=0.1)


def tokens(n: int) -> list[int]:
    return [rng.randrange(1000, 60000) for _ in range(n)]


def listing(url: str) -> list[dict]:
    return httpx.get(url + INSTANCES_PATH, timeout=15).json()["instances"]


def stats(url: str) -> dict:
    return httpx.get(url + STATS_PATH, timeout=15).json()


def fleet_matches(url: str, sequence: list[int]) -> int:
    body = {"tokens_b64": encode_tokens(np.asarray(sequence, dtype=np.uint32)),
            "model_name": MODEL, "world_size": 1, "cache_salt": ""}
    return len(httpx.post(url + BLEND_LOOKUP_PATH, json=body, timeout=15).json()["matches"])


def test_lmcache_server_with_two_replicas_keeps_its_registration_when_one_dies(tmp_path):
    flags = ("--enable-blend-lookup", "--chunk-size", str(C), "--instance-timeout",
             str(TIMEOUT_S), "--health-check-interval", "0.5")
    names = ("a", "b")
    with launch_nats_cluster(1, tmp_path / "nats") as nats:
        replicas, server, client = [], None, None
        try:
            with ThreadPoolExecutor(len(names)) as pool:  # each takes seconds to start
                starting = [pool.submit(start_coordinator, *flags, "--event-log", nats.urls,
                                        "--replica-name", name) for name in names]
            for future in starting:  # every one started is stopped below, even if one failed
                if future.exception() is None:
                    replicas.append(future.result())
            for future in starting:
                future.result()
            a, b = replicas
            server = start_lmcache_server(
                "L", coordinator_url=f"{a.url},{b.url}", instance_id=INSTANCE,
                log_dir=str(tmp_path), module_config={"blend_timeout": 0.5},
                extra_flags=["--coordinator-heartbeat-interval", str(HEARTBEAT_S)])
            client = EngineClient(server.rpc_url, instance_id=4242)
            status = client.status()
            assert status["reporting"] == "plugin"  # LMCache's sink would fail every flush
            # Once, or on LMCache 0.5.7 twice: again with the chunk size its engine's
            # registration bound (plugin.registrar.bind_chunk_size); b may list the first
            # while a already holds the second.
            registrations = 2 if LMCACHE_057 else 1
            assert settled(lambda: client.status()["registration"]["registrations"]
                           == registrations)
            assert settled(lambda: [i["instance_id"] for i in listing(b.url)] == [INSTANCE]
                           and listing(b.url) == listing(a.url)), \
                "registered, as both replicas list it"
            [record] = listing(a.url)

            first = tokens(2 * C)
            assert client.store(first, "first")
            for url in (a.url, b.url):
                assert settled(lambda url=url: fleet_matches(url, first) == 2), f"stores at {url}"

            # a dies. The server's next heartbeat and events go to b.
            a.process.kill()
            a.process.wait()
            before = client.status()["registration"]
            beats = before["heartbeats"]
            assert before["registrations"] == registrations
            # Long enough for b's reaper to have reaped a server that went silent: 3
            # timeouts' worth of beats.
            assert settled(lambda: client.status()["registration"]["heartbeats"]
                           >= beats + 3 * TIMEOUT_S / HEARTBEAT_S, timeout=240), \
                "heartbeats at b"
            registration = client.status()["registration"]
            assert registration["url"] == b.url and registration["moved"] >= 1
            assert registration["registrations"] == before["registrations"]
            assert registration["forgotten"] == 0
            assert listing(b.url) == [record]  # same record: never re-registered
            after = stats(b.url)
            assert after["counters"]["instances_dropped"] == 0  # never reaped or fenced
            assert after["l1_keys_by_instance"][INSTANCE] >= 2
            assert fleet_matches(b.url, first) == 2

            second = tokens(2 * C)
            assert client.store(second, "second")
            assert settled(lambda: fleet_matches(b.url, second) == 2), "stores after a died"

            # A graceful stop deregisters (at b, the replica still up).
            client.close()
            client = None
            assert server.stop(timeout=60) is not None
            assert settled(lambda: listing(b.url) == []), "deregistered at b"
            assert INSTANCE not in stats(b.url)["l1_keys_by_instance"]
            log_text = server.log_path.read_text(errors="replace")
            assert "InvalidURL" not in log_text and "Invalid port" not in log_text
            assert "Application shutdown failed" not in log_text
        finally:
            if client is not None:
                client.close()
            if server is not None:
                server.stop()
            for running in replicas:
                running.stop()
