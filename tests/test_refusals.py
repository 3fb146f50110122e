"""Refusals and routes (issue 34): the coordinator answers any refusal by its own status,
reason and headers (`blend_wire.errors`), so a request caught by shutdown is a 503 with
`Retry-After`, never a 500, while a bug still is one; and every route is declared once with
its role, a route without one stopping the start-up.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from aiohttp import web

from blend_wire import (BLEND_LOOKUP_PATH, EVENTS_PATH, STATS_PATH, ServiceUnavailable,
                        TooManyRequests, encode, encode_tokens)
from coordinator_client import C, batch, entry
from coordinator_stub import CoordinatorConfig, create_app
from coordinator_stub.http.access import RouteWithoutRole

LANE = "unit"


def _rejected(metrics: str, reason: str) -> float:
    line = f'blend_coordinator_rejected_requests_total{{reason="{reason}"}} '
    return sum(float(row[len(line):]) for row in metrics.splitlines() if row.startswith(line))


async def test_requests_caught_by_shutdown_are_503_with_retry_after(start):
    """Once the app shuts down (its write path and match workers stopped, as its cleanup
    stops them), an ingest and a lookup that reach them are refused for now, not failed:
    503 with `Retry-After`, nothing applied, counted as `shutting_down`."""
    coord = await start()
    await coord.post_events(batch(entry("aa01", range(C), offset=0)))
    await coord.app.cleanup()  # what shutting down runs once the listener is closed

    ingest = await coord.client.post(EVENTS_PATH, data=encode(
        {"batches": [batch(entry("bb02", range(C, 2 * C), offset=0), seq=2)]}))
    # A lookup too large to match on the event loop goes to the (stopped) match workers.
    tokens = np.arange(30_000, dtype=np.uint32) % 50_000
    lookup = await coord.client.post(BLEND_LOOKUP_PATH, data=encode(
        {"tokens_b64": encode_tokens(tokens), "model_name": "m"}))
    for response in (ingest, lookup):
        assert response.status == 503, await response.text()
        assert response.headers["Retry-After"] == "1"
        assert "shutting down" in (await response.json())["detail"]
    assert (await coord.stats())["num_keys"] == 1  # the refused body applied nothing
    metrics = await (await coord.client.get("/metrics")).text()
    assert _rejected(metrics, "shutting_down") == 2


async def test_any_refusal_answers_its_own_status_and_headers_and_a_bug_is_500(start,
                                                                               monkeypatch):
    coord = await start()

    def over_quota():
        raise TooManyRequests("slow down, come back later", retry_after_s=7)

    monkeypatch.setattr(coord.coordinator, "stats", over_quota)
    response = await coord.client.get(STATS_PATH)
    assert response.status == 429 and response.headers["Retry-After"] == "7"
    assert await response.json() == {"detail": "slow down, come back later"}

    def busy():
        raise ServiceUnavailable("the event log has no quorum")

    monkeypatch.setattr(coord.coordinator, "stats", busy)
    response = await coord.client.get(STATS_PATH)
    assert (response.status, response.headers["Retry-After"]) == (503, "1")

    def bug():
        raise RuntimeError("a bug")

    monkeypatch.setattr(coord.coordinator, "stats", bug)
    assert (await coord.client.get(STATS_PATH)).status == 500


async def test_a_route_without_a_role_stops_the_start_up():
    app = create_app(CoordinatorConfig(port=0, chunk_size=C))

    async def undeclared(request: web.Request) -> web.Response:
        return web.Response(text="served to anyone?")

    app.router.add_get("/undeclared", undeclared)  # not in the route list: no role
    runner = web.AppRunner(app)
    with pytest.raises(RouteWithoutRole, match="GET /undeclared"):
        await runner.setup()
    await runner.cleanup()


async def test_a_request_no_route_serves_needs_the_admin_role(start):
    reader, admin = "r" * 20, "a" * 20
    coord = await start(access_tokens=(("reader", reader), ("admin", admin)))
    for token, status in ((None, 401), (reader, 403), (admin, 404)):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        response = await coord.client.get("/no-such-route", headers=headers)
        assert response.status == status, await response.text()
    response = await coord.client.get(EVENTS_PATH, headers={"Authorization": f"Bearer {admin}"})
    assert response.status == 405  # served, but not with this method


def test_a_refusal_keeps_its_status_reason_and_headers_across_processes():
    """The router decodes large bodies in a worker process: its refusal comes back pickled,
    and must still answer as raised."""
    from blend_router.prompts import MalformedRequest
    from blend_wire import WireError
    from coordinator_stub.service.quotas import OverQuota

    for refusal in (MalformedRequest("not JSON"), WireError("seq < 0", loc=("body", "seq")),
                    TooManyRequests("later", retry_after_s=3), OverQuota("cap", retry_after_s=9),
                    ServiceUnavailable("no quorum")):
        back = pickle.loads(pickle.dumps(refusal))
        assert (type(back), back.status, back.reason, dict(back.headers), back.detail) == (
            type(refusal), refusal.status, refusal.reason, dict(refusal.headers), refusal.detail)
