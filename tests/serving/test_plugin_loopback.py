"""The loopback servers of tests/helpers.py behave as the plugin tests rely on."""

from __future__ import annotations

import httpx

from helpers import HangingServer, LoopbackServer, Reply

LANE = "unit"


# --- the helpers work -----------------------------------------------------------------------


def test_loopback_server_answers_as_told_and_records():
    with LoopbackServer(lambda path, body: Reply(503, "busy")) as server:
        response = httpx.post(server.url + "/x", content=b"{}")
        assert response.status_code == 503 and response.text == "busy"
        assert server.requests == [("/x", b"{}")]


def test_hanging_server_never_answers():
    with HangingServer() as server:
        try:
            httpx.post(server.url + "/x", content=b"{}", timeout=0.2)
        except httpx.ReadTimeout:
            pass
        else:
            raise AssertionError("the hanging server answered")
