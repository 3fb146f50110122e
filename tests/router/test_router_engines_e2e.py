"""The router in front of real LMCache 0.5.6 servers (issue 31, item 1): each server says
where its engine's OpenAI server is, and the router reaches it.

Processes, all on free loopback ports: the bundled coordinator; two `lmcache server`s
loading the plugin, started as the README's line is (HTTP front end, event reporting), A
with `LMCACHE_COORDINATOR_ENGINE_URL` naming its engine, B without (the router's operator
names B's engine with `--backend`); stand-in engines (OpenAI servers) in this process;
`python -m blend_router` as the README starts it. What users rely on: a completion goes to
the engine beside the server whose cache holds its prompt, never to LMCache's own HTTP
front end (the `ip:http_port` a server registers, which serves no completions).
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from blend_wire import ENGINE_URL_KEY, INSTANCES_PATH
from coordinator_stub.launch.process import launch_coordinator, start_coordinator
from helpers import wait_until

LANE = "lmcache"

pytest.importorskip("lmcache", reason="LMCache 0.5.6 is installed by `make test` (the "
                    "project's Makefile); this test needs its server")

from plugin.harness.lmcache_process import ServerFleet  # noqa: E402

C = 256
MODEL = "fleet-model"  # EngineClient's default model
rng = random.Random(20261202)


def tokens(n: int) -> list[int]:
    return [rng.randrange(1000, 60000) for _ in range(n)]


async def stand_in_engine(name: str, served: list) -> TestServer:
    async def answer(request: web.Request) -> web.Response:
        served.append((name, await request.json()))
        return web.json_response({"served_by": name})
    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/completions", answer)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    return server


def listing(url: str) -> dict[str, dict]:
    return {i["instance_id"]: i for i in httpx.get(url + INSTANCES_PATH).json()["instances"]}


async def test_completions_reach_the_engine_beside_the_server_that_holds_the_prompt(tmp_path):
    served: list = []
    engine_a = await stand_in_engine("engine-A", served)
    engine_b = await stand_in_engine("engine-B", served)
    a_url, b_url = f"http://127.0.0.1:{engine_a.port}", f"http://127.0.0.1:{engine_b.port}"
    coordinator = start_coordinator("--enable-blend-lookup", "--chunk-size", str(C),
                                    "--health-check-interval", "0")
    fleet = ServerFleet(coordinator_url=coordinator.url, log_dir=str(tmp_path))
    try:
        await asyncio.to_thread(fleet.start_many, {
            "A": {"env": {"LMCACHE_COORDINATOR_ENGINE_URL": a_url}}, "B": {}})
        registered = await asyncio.to_thread(
            wait_until, lambda: (lambda seen: len(seen) == 2 and seen)(listing(coordinator.url)),
            60.0, 0.1)
        assert registered["A"]["metadata"] == {ENGINE_URL_KEY: a_url}
        assert registered["B"]["metadata"] == {}  # LMCache's own registrar: no metadata
        assert fleet.clients["A"].status()["reporting"] == "plugin"

        at_a, at_b = tokens(2 * C), tokens(2 * C)
        assert await asyncio.to_thread(fleet.clients["A"].store, at_a, "doc-a")
        assert await asyncio.to_thread(fleet.clients["B"].store, at_b, "doc-b")
        with launch_coordinator("--coordinator-url", coordinator.url, "--port", "0",
                                "--refresh-interval", "0.2", "--score-budget", "5",
                                "--backend", f"B={b_url}", module="blend_router") as router:
            def route(prompt: list[int]) -> tuple[int, str, str, dict]:
                reply = httpx.post(router.url + "/v1/completions", timeout=30,
                                   json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
                return (reply.status_code, reply.headers.get("X-Routed-To"),
                        reply.headers.get("X-Route-Reason"), reply.json())

            def scored(prompt: list[int], instance: str) -> bool:
                return route(prompt)[1:3] == (instance, "score")
            # Each server's stores reach the coordinator in the background: wait for them.
            for prompt, instance in ((tokens(7) + at_a, "A"), (tokens(9) + at_b, "B")):
                assert await asyncio.to_thread(wait_until, lambda: scored(prompt, instance),
                                               60.0, 0.2), route(prompt)
            served.clear()
            status, instance, reason, answer = await asyncio.to_thread(route, at_a)
            assert (status, instance, reason, answer) == (200, "A", "score",
                                                          {"served_by": "engine-A"})
            status, instance, reason, answer = await asyncio.to_thread(route, tokens(3) + at_b)
            assert (status, instance, answer) == (200, "B", {"served_by": "engine-B"})
            assert [name for name, _ in served] == ["engine-A", "engine-B"]
            assert served[0][1]["prompt"] == at_a  # forwarded as received
            # Nothing cached: still an engine, never LMCache's front end (ip:http_port).
            for _ in range(4):
                status, instance, reason, answer = await asyncio.to_thread(route, tokens(40))
                assert (status, reason) == (200, "nothing-cached")
                assert answer == {"served_by": f"engine-{instance}"}
    finally:
        await asyncio.to_thread(fleet.close)
        coordinator.stop()
        await engine_a.close()
        await engine_b.close()
