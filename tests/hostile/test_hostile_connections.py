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
from hostile_helpers import A, batch, entry


def _open_sockets(host: str, port: int, count: int, first_bytes: bytes = b"") -> list:
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((host, port), timeout=5)
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


def _wait_until_closed(sockets: list, within: float) -> int:
    deadline = time.monotonic() + within
    closed: set[int] = set()
    while time.monotonic() < deadline and len(closed) < len(sockets):
        for i, sock in enumerate(sockets):
            if i not in closed and _closed_by_server(sock):
                closed.add(i)
        time.sleep(0.05)
    return len(closed)


def _timed(http: httpx.Client, method: str, path: str, **kwargs) -> tuple[int, float]:
    started = time.perf_counter()
    response = http.request(method, path, **kwargs)
    return response.status_code, time.perf_counter() - started


def test_idle_and_trickling_connections_are_closed_after_the_idle_timeout():
    with launch_coordinator("--idle-timeout", "1", "--chunk-size", "4") as running:
        silent = _open_sockets(running.host, running.port, 50)
        partial = _open_sockets(running.host, running.port, 50,
                                b"POST /events HTTP/1.1\r\nHost: x\r\n")
        # Nobody is closed early (well within the timeout) ...
        assert _wait_until_closed(silent + partial, within=0.3) == 0
        # ... and every one is closed soon after it.
        assert _wait_until_closed(silent + partial, within=5.0) == 100
        for sock in silent + partial:
            sock.close()


def test_a_body_that_never_completes_is_answered_408():
    with launch_coordinator("--body-timeout", "1", "--chunk-size", "4") as running:
        with socket.create_connection((running.host, running.port), timeout=10) as sock:
            sock.sendall(b"POST /events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                         b"\r\nContent-Length: 1000\r\n\r\n{\"batches\": [")
            started = time.monotonic()
            reply = sock.recv(4096)
            assert reply.startswith(b"HTTP/1.1 408"), reply
            assert time.monotonic() - started < 5


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
        assert _wait_until_closed(hostile, within=3.0) >= len(hostile) - 100
        query = encode({"tokens_b64": encode_tokens([9] + A), "model_name": "m"})
        latencies = []
        # Fresh connections (no keep-alive), each of which must get in past the hostile ones.
        for _ in range(20):
            with httpx.Client(base_url=running.url, timeout=5) as http:
                status, took = _timed(http, "GET", HEALTH_PATH)
                assert status == 200
                latencies.append(took)
                response = http.post(BLEND_LOOKUP_PATH, content=query)
                assert response.status_code == 200
                assert [m["chunk_hash"] for m in response.json()["matches"]] == ["aa01"]
        assert max(latencies) < 2.0, latencies
        for sock in hostile:
            sock.close()


def test_connection_cap_is_kept_below_the_descriptor_limit():
    from coordinator_stub.http.connections import connection_cap
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        pytest.skip("no descriptor limit on this machine")
    assert connection_cap(10 * soft) < soft
    assert connection_cap(5) == 5
