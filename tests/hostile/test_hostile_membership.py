"""Membership and growth (issue 32, item 5).

Before: a reader-only token (403 on `GET /instances`) got every registered id from a
4-token blend score (4,000 ids, a 440 KB reply), and registrations and instance ids had
no cap per scope (50k made-up ids with one placement each: +130 MB, a 19 MB `/metrics`).
Now a caller that may not list the registry is scored only the instances holding some of
its request in its namespace, and each scoped token brings in at most
`--max-instances-per-scope` instance ids (429 past it, metered in `/metrics`).
"""

from __future__ import annotations

import numpy as np

from blend_wire import (BLEND_LOOKUP_PATH, BLEND_SCORE_PATH, EVENTS_PATH, INSTANCES_PATH,
                        METRICS_PATH, encode, encode_tokens)
from coordinator_stub.scopes import ANY, Scope
from hostile_helpers import A, B, batch, entry

LANE = "unit"

READER, ROUTER, EMITTER, POOL, ADMIN = "r" * 20, "t" * 20, "e" * 20, "p" * 20, "z" * 20
TOKENS = (("reader", READER, Scope(salts=frozenset({"tenant"}))),
          ("reader", ROUTER, ANY), ("emitter", ROUTER, ANY),  # a router: score + listing
          ("emitter", EMITTER, ANY), ("admin", ADMIN, ANY),
          ("emitter", POOL, Scope(("pool-*",), frozenset({"tenant"}))))


def _as(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


async def _register(coord, token: str, instance_id: str, expect: int = 200):
    body = {"instance_id": instance_id, "ip": "10.0.0.1", "http_port": 8000}
    response = await coord.client.post(INSTANCES_PATH, data=encode(body), headers=_as(token))
    assert response.status == expect, await response.text()
    return response


async def _post(coord, token: str, *batches: dict, expect: int = 200):
    response = await coord.client.post(EVENTS_PATH, data=encode({"batches": list(batches)}),
                                       headers=_as(token))
    assert response.status == expect, await response.text()
    return response


async def _scored(coord, token: str, tokens, salt: str = "tenant", **extra) -> list[str]:
    body = {"tokens_b64": encode_tokens(np.asarray(tokens, dtype=np.uint32)),
            "model_name": "m", "cache_salt": salt, **extra}
    response = await coord.client.post(BLEND_SCORE_PATH, data=encode(body), headers=_as(token))
    assert response.status == 200, await response.text()
    return [s["instance_id"] for s in (await response.json())["instances"]]


async def test_a_reader_learns_only_instances_holding_its_request(start):
    coord = await start(access_tokens=TOKENS)
    for i in range(40):
        await _register(coord, EMITTER, f"other-{i:02d}")
    await _register(coord, EMITTER, "holder")
    await _register(coord, EMITTER, "elsewhere")
    await _post(coord, EMITTER, batch(entry("aa01", A, salt="tenant"), instance="holder"),
                batch(entry("bb01", A, salt="other-tenant"), instance="elsewhere"))
    # Reader-only: the instance holding its request in its namespace, no one else.
    assert await _scored(coord, READER, A) == ["holder"]
    assert await _scored(coord, READER, B) == []
    named = ["other-01", "elsewhere", "holder", "never-registered"]
    assert await _scored(coord, READER, A, instance_ids=named) == ["holder"]
    # A router's token may list the registry anyway: every instance is scored.
    assert len(await _scored(coord, ROUTER, A)) == 42
    # Candidates name only holders of the caller's namespace (another salt's holder: no).
    body = {"tokens_b64": encode_tokens(np.asarray(A, dtype=np.uint32)), "model_name": "m",
            "cache_salt": "tenant", "candidates": True}
    reply = await (await coord.client.post(BLEND_LOOKUP_PATH, data=encode(body),
                                           headers=_as(READER))).json()
    assert [c.get("l1") for found in reply["candidates"] for c in found["chunks"]] == [["holder"]]


async def test_a_scoped_token_brings_in_at_most_its_cap_of_instance_ids(start):
    coord = await start(access_tokens=TOKENS, max_instances_per_scope=3, instance_timeout=7.0)
    for i in (1, 2):
        await _register(coord, POOL, f"pool-{i}")
    await _post(coord, POOL, batch(entry("aa01", A, salt="tenant"), instance="pool-3"))
    refused = await _register(coord, POOL, "pool-4", expect=429)
    assert refused.headers["Retry-After"] == "7"
    detail = (await refused.json())["detail"]
    assert "--max-instances-per-scope 3" in detail and "pool-4" in detail
    refused = await _post(coord, POOL, batch(entry("aa02", B, salt="tenant"), instance="pool-5"),
                          expect=429)
    assert "pool-5" in (await refused.json())["detail"]
    # Its own ids go on as before; nothing of the refused body was applied.
    await _register(coord, POOL, "pool-1")
    await _post(coord, POOL, batch(entry("aa02", B, salt="tenant"), instance="pool-3", seq=2))
    stats = await (await coord.client.get("/directory/stats", headers=_as(ADMIN))).json()
    assert set(stats["ingest_streams"]) == {"pool-3"}
    metrics = await (await coord.client.get(METRICS_PATH, headers=_as(ADMIN))).text()
    assert "blend_coordinator_scoped_instance_ids 3.0" in metrics
    assert "blend_coordinator_instance_cap_refusals_total 2.0" in metrics
    # One leaves (holding nothing): room for a newcomer.
    assert (await coord.client.delete(f"{INSTANCES_PATH}/pool-1", headers=_as(POOL))).status == 204
    await _register(coord, POOL, "pool-4")
    # Unscoped tokens are not counted.
    for i in range(6):
        await _register(coord, EMITTER, f"srv-{i}")
