"""Forwarding one request to the chosen instance and streaming its answer back."""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web

log = logging.getLogger(__name__)


async def forward(session: aiohttp.ClientSession, request: web.Request, raw: bytes, url: str,
                  headers: dict[str, str], timeout_s: float) -> web.StreamResponse:
    """POST `raw` to `url` and stream the answer to `request`'s client, with `headers`
    added to the answer's (`X-Routed-To`, `X-Route-Reason`)."""
    out = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    if "Authorization" in request.headers:
        out["Authorization"] = request.headers["Authorization"]
    async with session.post(url, data=raw, headers=out,
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as upstream:
        response = web.StreamResponse(status=upstream.status, headers={
            "Content-Type": upstream.headers.get("Content-Type", "application/json"),
            **headers})
        await response.prepare(request)
        try:
            async for piece in upstream.content.iter_any():
                await response.write(piece)
        except (aiohttp.ClientError, TimeoutError) as exc:
            # Headers are sent: all that is left is to end the stream early.
            log.warning("%s broke off its answer (%s)", headers.get("X-Routed-To"),
                        type(exc).__name__)
        await response.write_eof()
        return response
