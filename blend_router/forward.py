"""Forwarding one request to the chosen instance and streaming its answer back.

The request goes out once: only a connection that could not be opened (nothing sent) is
`Unreachable`, which the caller may try elsewhere. A failure after the request went out is
answered `502` or ends the stream, never sent again; a client that leaves cancels its
handler (the server runs with handler cancellation), which closes the instance's
connection, so the engine stops generating for nobody.
"""

from __future__ import annotations

import logging
from typing import Callable

import aiohttp
from aiohttp import web

log = logging.getLogger(__name__)

#: Request headers passed on to the instance (others, `Authorization` among them, are not).
_PASSED_ON = ("Content-Type", "Accept")


class Unreachable(Exception):
    """No connection to the instance could be opened: nothing was sent to it."""


def backend_session(connections_per_host: int) -> aiohttp.ClientSession:
    """The instances' own connection pool: at most `connections_per_host` to each, no
    total cap, so a slow or black-holed instance holds its own connections only."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=connections_per_host),
        timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)


async def forward(session: aiohttp.ClientSession, request: web.Request, raw: bytes, url: str,
                  answer_headers: dict[str, str], timeout: aiohttp.ClientTimeout,
                  pass_authorization: bool,
                  on_first_piece: Callable[[], None] = lambda: None) -> web.StreamResponse:
    """POST `raw` to `url` and stream the answer to `request`'s client, `answer_headers`
    added (`X-Routed-To`, `X-Route-Reason`). `Unreachable` if no connection opened.
    `on_first_piece` is called when the answer's first body bytes arrive (streamed: the
    first token, so the prefill is over)."""
    out = {name: request.headers[name] for name in _PASSED_ON if name in request.headers}
    if pass_authorization and "Authorization" in request.headers:
        out["Authorization"] = request.headers["Authorization"]
    instance = answer_headers.get("X-Routed-To")
    try:
        upstream = await session.post(url, data=raw, headers=out, timeout=timeout)
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
        raise Unreachable(f"{type(exc).__name__}: {exc}") from None
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("instance %s failed before answering (%s); not sent elsewhere",
                    instance, type(exc).__name__)
        return web.json_response(
            {"detail": f"instance {instance} failed before answering; the request was not "
                       "sent elsewhere (it may have started there)"},
            status=502, headers=answer_headers)
    try:
        response = web.StreamResponse(status=upstream.status, headers={
            "Content-Type": upstream.headers.get("Content-Type", "application/json"),
            **answer_headers})
        if "Content-Encoding" in upstream.headers:
            response.headers["Content-Encoding"] = upstream.headers["Content-Encoding"]
        await response.prepare(request)
        try:
            first = True
            async for piece in upstream.content.iter_any():
                if first:
                    first = False
                    on_first_piece()
                await response.write(piece)
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError, TimeoutError) as exc:
            if request.transport is None or request.transport.is_closing():
                return response  # the client left: nothing more to send anyone
            # Headers are sent: all that is left is to end the stream early.
            log.warning("instance %s broke off its answer (%s)", instance, type(exc).__name__)
        except ConnectionResetError:  # writing to a client that left
            return response
        await response.write_eof()
        return response
    finally:
        # Leaving early (the client went away, or an error) closes the connection to the
        # instance rather than reading the rest: the engine sees the request abandoned.
        if upstream.content.at_eof():
            upstream.release()
        else:
            upstream.close()
