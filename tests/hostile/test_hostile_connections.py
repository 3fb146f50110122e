"""Connection hygiene (issue 11, point 3): sockets that send nothing, or trickle, are
closed; open connections are capped below the descriptor limit; and the coordinator
keeps answering `/healthz` and lookups while hundreds of hostile sockets are open.

Before: a connection was kept for aiohttp's default keep-alive (about an hour) whether or
not it ever sent a request, there was no cap, so ~20k idle sockets exhausted descriptors
(`Errno 24`) and the coordinator stopped accepting.
"""

from __future__ import annotations

import select
import socket
import time

import httpx
import pytest

from blend_wire import BLEND_LOOKUP_PATH, EVENTS_PATH, HEALTH_PATH, encode, encode_tokens
from coordinator_stub.launch.process import launch_coordinator
from helpers import NOT_HUNG_S
from hostile_helpers import A, batch, entry

LANE = "coordinator"


def _open_sockets(host: str, port: int, count: int, first_bytes: bytes = b"",
                  opened_at: list[float] | None = None) -> list:
    """`count` connections that send `first_bytes` and nothing more; with `opened_at`, the
    monotonic time before each connect is appended to it (no earlier than the server's
    accept, which starts its idle timer)."""
    sockets = []
    for _ in range(count):
        if opened_at is not None:
            opened_at.append(time.monotonic())
        sock = socket.create_connection((host, port), timeout=NOT_HUNG_S)
        if first_bytes:
            sock.sendall(first_bytes)
        sockets.append(sock)
    return sockets


def _closed_by_server(sock: socket.socket) -> bool:
    """True when the server let go of the socket (EOF, reset, or a refusal), non-blocking.

    These sockets never complete a request, so anything readable is the server closing
    them (possibly after a 503 "too many connections").
    """
    return bool(select.select([sock], [], [], 0)[0])


def _wait_until_closed(sockets: list, at_least: int | None = None) -> dict[int, float]:
    """Wait (up to NOT_HUNG_S) until the server closed `at_least` of `sockets` (default:
    all); {index: monotonic time it was seen closed} of those it closed."""
    deadline = time.monotonic() + NOT_HUNG_S
    target = len(sockets) if at_least is None else at_least
    closed: dict[int, float] = {}
    while time.monotonic() < deadline and len(closed) < target:
        for i, sock in enumerate(sockets):
            if i not in closed and _closed_by_server(sock):
                closed[i] = time.monotonic()
        time.sleep(0.05)
    return closed


def test_idle_and_trickling_connections_are_closed_after_the_idle_timeout():
    with launch_coordinator("--idle-timeout", "1", "--chunk-size", "4") as running:
        opened_at: list[float] = []
        silent = _open_sockets(running.host, running.port, 50, opened_at=opened_at)
        partial = _open_sockets(running.host, running.port, 50,
                                b"POST /events HTTP/1.1\r\nHost: x\r\n", opened_at)
        closed = _wait_until_closed(silent + partial)
        assert len(closed) == 100  # every one is closed ...
        # ... and none before its idle timeout (a loaded machine only closes them later).
        assert min(closed[i] - opened_at[i] for i in closed) >= 1.0
        for sock in silent + partial:
            sock.close()


def test_a_body_that_never_completes_is_answered_408():
    with launch_coordinator("--body-timeout", "1", "--chunk-size", "4") as running:
        # The reply comes after the body timeout (1 s); without it, never (the socket's
        # timeout, NOT_HUNG_S, would fail the test).
        with socket.create_connection((running.host, running.port), timeout=NOT_HUNG_S) as sock:
            sock.sendall(b"POST /events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                         b"\r\nContent-Length: 1000\r\n\r\n{\"batches\": [")
            reply = sock.recv(4096)
            assert reply.startswith(b"HTTP/1.1 408"), reply


def test_keeps_answering_under_hundreds_of_hostile_sockets_and_caps_them():
    flags = ("--enable-blend-lookup", "--chunk-size", "4", "--max-connections", "100",
             "--idle-timeout", "30")
    with launch_coordinator(*flags) as running:
        with httpx.Client(base_url=running.url, timeout=10) as http:
            stored = http.post(EVENTS_PATH, content=encode({"batches": [
                batch(entry("aa01", A, offset=0))]}))
            assert stored.status_code == 200
        hostile = _open_sockets(running.host, running.port, 200)
        hostile += _open_sockets(running.host, running.port, 200, b"GET /healthz HTTP/1.1\r\n")
        # At most the cap stays open: the longest-idle make room for newcomers.
        assert len(_wait_until_closed(hostile, at_least=len(hostile) - 100)) >= len(hostile) - 100
        query = encode({"tokens_b64": encode_tokens([9] + A), "model_name": "m"})
        # Fresh connections (no keep-alive), each of which must get in past the hostile ones
        # (their latencies under ~19k such sockets: benchmarks/bench_hostile_sockets.py).
        for _ in range(20):
            with httpx.Client(base_url=running.url, timeout=NOT_HUNG_S) as http:
                assert http.get(HEALTH_PATH).status_code == 200
                response = http.post(BLEND_LOOKUP_PATH, content=query)
                assert response.status_code == 200
                assert [m["chunk_hash"] for m in response.json()["matches"]] == ["aa01"]
        for sock in hostile:
            sock.close()


@pytest.mark.unit
def test_connection_cap_is_kept_below_the_descriptor_limit():
    from coordinator_stub.http.connections import connection_cap
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        pytest.skip("no descriptor limit on this machine")
    assert connection_cap(10 * soft) < soft
    assert connection_cap(5) == 5
