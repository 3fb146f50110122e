"""Connection hygiene: a cap on open connections, enforced in front of aiohttp's handler
(docs/DESIGN.md, "Coordinator layout").

Contract:
- `ConnectionGuard(max_connections).protocol_factory(server)` wraps aiohttp's protocol
  factory (`AppRunner.server`, a `web.Server`) for `loop.create_server`. At most
  `max_connections` connections are open at once. A connection beyond the cap first
  makes room by closing the connection that has been idle longest (no request in
  progress); if every open connection has a request in progress, the newcomer is
  answered `503` and closed. So sockets that hold a connection and send nothing cannot
  lock out well-behaved clients, and the process never runs out of descriptors.
- `ConnectionGuard.middleware` marks a connection busy while a request of it is being
  handled; install it on the application.
- Timeouts are not here: aiohttp closes a connection that has not sent a complete
  request head within its keep-alive timeout of opening or of its last response (the
  runner's `keepalive_timeout`), and the app bounds how long a body may take.

Runs on the event loop only; no locks.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from aiohttp import web

log = logging.getLogger(__name__)

_REFUSED_BODY = b'{"error": "too many connections; retry in a moment"}'
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Retry-After: 1\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(_REFUSED_BODY), _REFUSED_BODY))
#: Descriptors kept free of connections: the listening socket, logs, worker threads' files.
_RESERVED_DESCRIPTORS = 64


def connection_cap(requested: int) -> int:
    """`requested`, lowered to fit the process's descriptor limit (RLIMIT_NOFILE)."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, ValueError, OSError):  # no such limit on this platform
        return requested
    if soft == resource.RLIM_INFINITY:
        return requested
    return max(1, min(requested, soft - _RESERVED_DESCRIPTORS))


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, counted and closable by the guard."""

    __slots__ = ("guard", "inner", "transport", "busy")

    def __init__(self, guard: "ConnectionGuard", inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.busy = 0  # requests of this connection being handled

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.guard._admit(self):
            transport.write(_REFUSED)  # type: ignore[attr-defined]
            transport.close()
            self.inner = None
            return
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard._forget(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


class ConnectionGuard:
    """Counts the server's connections and keeps them at or below `max_connections`."""

    def __init__(self, max_connections: int) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections={max_connections} must be >= 1")
        self.max_connections = max_connections
        # Insertion order = least recently active first (a request ending moves its
        # connection to the end), so the first idle entry is the longest idle.
        self._open: dict[_Guarded, None] = {}
        self._by_transport: dict[object, _Guarded] = {}
        self.refused = 0
        self.evicted = 0

    def protocol_factory(self, server: Callable[[], asyncio.Protocol]
                         ) -> Callable[[], asyncio.Protocol]:
        def make() -> asyncio.Protocol:
            return _Guarded(self, server())
        return make

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        guarded = self._by_transport.get(request.transport)
        if guarded is None:  # not behind the guard (e.g. an in-process test server)
            return await handler(request)
        guarded.busy += 1
        try:
            return await handler(request)
        finally:
            guarded.busy -= 1
            if guarded in self._open:  # now the most recently active
                del self._open[guarded]
                self._open[guarded] = None

    # --- called by _Guarded --------------------------------------------------------------

    def _admit(self, guarded: _Guarded) -> bool:
        if len(self._open) >= self.max_connections:
            victim = next((c for c in self._open if not c.busy), None)
            if victim is None:
                self.refused += 1
                if self.refused == 1 or self.refused % 1000 == 0:
                    log.warning("%d connections open, all busy (--max-connections): "
                                "refused %d so far", len(self._open), self.refused)
                return False
            self.evicted += 1
            if self.evicted == 1 or self.evicted % 1000 == 0:
                log.warning("%d connections open (--max-connections): closed the longest "
                            "idle to make room (%d so far)", len(self._open), self.evicted)
            self._forget(victim)
            victim.transport.close()
        self._open[guarded] = None
        self._by_transport[guarded.transport] = guarded
        return True

    def _forget(self, guarded: _Guarded) -> None:
        if self._open.pop(guarded, 0) is None:
            self._by_transport.pop(guarded.transport, None)
