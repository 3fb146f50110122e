"""Reading a request body within the router's limits: its size and the time it may take."""

from __future__ import annotations

import asyncio

from aiohttp import web

from blend_wire import RequestTimeout, TooLarge


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body, or a refusal: `TooLarge` (413) when it is (or says it will be)
    larger than `max_bytes`, before reading it; `RequestTimeout` (408) when it has not all
    arrived within `timeout_s`."""
    length = request.content_length
    if length is not None and length > max_bytes:
        raise TooLarge(f"the body is {length} bytes; this router takes at most {max_bytes}")
    pieces, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            while piece := await request.content.readany():
                size += len(piece)
                if size > max_bytes:
                    raise TooLarge(f"the body is over {max_bytes} bytes, the most this "
                                   "router takes")
                pieces.append(piece)
    except TimeoutError:
        raise RequestTimeout(f"the body did not arrive within {timeout_s} s") from None
    return b"".join(pieces)
