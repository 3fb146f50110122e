"""Serving the app on a listening socket of our own (`python -m coordinator_stub`), rather
than an aiohttp TCPSite: every connection goes through the app's `ConnectionGuard`, which
counts them and makes room at the cap (`coordinator_stub.http.connections`).
"""

from __future__ import annotations

import asyncio
import ssl

from aiohttp import web

from coordinator_stub.http.app import CONNECTIONS

#: Pending connections the kernel queues before accept (aiohttp's default is 128): a burst
#: of clients connecting at once is accepted, not reset.
BACKLOG = 1024


def runner_for(app: web.Application, idle_timeout_s: float) -> web.AppRunner:
    """The app's runner: no access log (a line per request would cost more than serving
    a lookup), signals left to the caller, keep-alive cut after `idle_timeout_s`."""
    return web.AppRunner(app, access_log=None, handle_signals=False,
                         keepalive_timeout=idle_timeout_s)


async def listen(runner: web.AppRunner, host: str, port: int,
                 tls: ssl.SSLContext | None) -> asyncio.Server:
    """Listen on `host:port` (OSError when it cannot) for the set-up `runner`'s app."""
    guard = runner.app[CONNECTIONS]
    return await asyncio.get_running_loop().create_server(
        guard.protocol_factory(runner.server), host, port, backlog=BACKLOG, ssl=tls)
