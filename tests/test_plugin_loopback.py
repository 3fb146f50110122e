"""Real loopback HTTP servers that misbehave on purpose, for the plugin's client and reporter.

`LoopbackServer(behave)` serves HTTP/1.1 on 127.0.0.1 with a thread per connection;
`behave(path, body) -> Reply` decides each answer (status, body, delay before answering), and
every request is recorded with the peak number answered concurrently. `HangingServer` accepts
connections and never answers; `TricklingServer` answers one byte at a time, forever.
`closed_port_url()` names a port nothing listens on.

Imported by the other plugin tests; the tests here check the helpers themselves.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import httpx


@dataclass
class Reply:
    status: int = 200
    body: bytes | str | dict = b'{"matches": []}'
    delay_s: float = 0.0

    def payload(self) -> bytes:
        if isinstance(self.body, dict):
            return json.dumps(self.body).encode()
        return self.body.encode() if isinstance(self.body, str) else self.body


def ok_reply(path: str, body: bytes) -> Reply:
    if path.endswith("/events"):
        batches = len(json.loads(body)["batches"])
        return Reply(200, {"applied": batches, "duplicates": 0, "stale": 0})
    return Reply(200, {"matches": []})


class LoopbackServer:
    """A real HTTP server on a free loopback port; `behave` may be swapped at any time."""

    def __init__(self, behave: Callable[[str, bytes], Reply] = ok_reply) -> None:
        self.behave = behave
        self.requests: list[tuple[str, bytes]] = []
        self.active = 0
        self.peak_active = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with server._lock:
                    server.requests.append((self.path, body))
                    server.active += 1
                    server.peak_active = max(server.peak_active, server.active)
                try:
                    reply = server.behave(self.path, body)
                    if reply.delay_s:
                        time.sleep(reply.delay_s)
                    payload = reply.payload()
                    self.send_response(reply.status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    with server._lock:
                        server.active -= 1

            do_GET = do_POST

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.02,), daemon=True)
        self._thread.start()

    def bodies(self, path: str) -> list[dict]:
        with self._lock:
            return [json.loads(b) for p, b in self.requests if p == path]

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "LoopbackServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HangingServer:
    """Accepts TCP connections and never sends a byte back."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        return len(self.accepted)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted.append(conn)
            self._handle(conn)

    def _handle(self, conn: socket.socket) -> None:
        pass  # held open, never answered

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        for conn in self.accepted:
            conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TricklingServer(HangingServer):
    """Answers every connection one byte per `interval_s`, never finishing: the status line
    and headers (`part="headers"`), or a complete header then an endless body (`"body"`)."""

    def __init__(self, part: str = "headers", interval_s: float = 0.05) -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        if part == "headers":
            self._prefix, self._trickle = b"", head + b"x-padding: " + b"a" * 10**6
        else:
            self._prefix = head + b"content-length: 1000000\r\n\r\n"
            self._trickle = b'{"matches": [' + b" " * 10**6
        self.interval_s = interval_s
        super().__init__()

    def _handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)  # the request (small enough for one read here)
            conn.sendall(self._prefix)
            for i in range(len(self._trickle)):
                if self._closed.wait(self.interval_s):
                    return
                conn.sendall(self._trickle[i:i + 1])
        except OSError:
            return  # the client gave up and closed the connection


def closed_port_url() -> str:
    """A loopback URL nothing listens on (the port was just released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# --- the helpers work -----------------------------------------------------------------------


def test_loopback_server_answers_as_told_and_records():
    with LoopbackServer(lambda path, body: Reply(503, "busy")) as server:
        response = httpx.post(server.url + "/x", content=b"{}")
        assert response.status_code == 503 and response.text == "busy"
        assert server.requests == [("/x", b"{}")]


def test_hanging_server_never_answers():
    with HangingServer() as server:
        started = time.monotonic()
        try:
            httpx.post(server.url + "/x", content=b"{}", timeout=0.2)
        except httpx.ReadTimeout:
            pass
        else:
            raise AssertionError("the hanging server answered")
        assert time.monotonic() - started < 1.0
