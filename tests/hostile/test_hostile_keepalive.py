"""A refused body leaves its connection usable, or says it is closing (issue 19, item 6).

Before: after a corrupt gzip body the 400 came back without `Connection: close`, and the
connection was reset under it: the client's next request on that keep-alive connection
failed. Now every answer to a body the coordinator did not read to its end (400
undecodable, 413 too large) carries `Connection: close` and the connection is closed
after it, and one whose body was read whole keeps the connection usable.
"""

from __future__ import annotations

import asyncio
import gzip

import pytest

from blend_wire import EVENTS_PATH, HEALTH_PATH, encode
from hostile_helpers import batch, entry

LANE = "unit"


async def _exchange(reader, writer, head: bytes, body: bytes) -> tuple[int, dict, bytes]:
    writer.write(head + body)
    await writer.drain()
    status_line = await reader.readline()
    assert status_line.startswith(b"HTTP/1.1 "), status_line
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    reply = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(status_line.split()[1]), headers, reply


def _post(body: bytes, **headers: str) -> bytes:
    fields = {"Host": "x", "Content-Type": "application/json", "Content-Length": str(len(body)),
              **{name.replace("_", "-"): value for name, value in headers.items()}}
    return (f"POST {EVENTS_PATH} HTTP/1.1\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n").encode()


GOOD = encode({"batches": [batch(entry())]})


@pytest.mark.parametrize("body,headers", [
    (b"\x1f\x8b\x08\x00" + b"not really gzip" * 10, {"Content_Encoding": "gzip"}),
    (gzip.compress(GOOD)[:-12], {"Content_Encoding": "gzip"}),
    (b"\x00\x01\x02garbage", {"Content_Encoding": "deflate"}),
    (b"abc", {"Content_Encoding": "x-unknown"}),
    (gzip.compress(b" " * (4 << 20), 9), {"Content_Encoding": "gzip"}),
    (b"{" * (2 << 20), {}),
    (b'{"batches": 5}', {}),
], ids=["corrupt gzip", "truncated gzip", "corrupt deflate", "unknown encoding",
        "gzip bomb", "declared too large", "invalid json (read whole)"])
async def test_after_a_refused_body_the_connection_works_or_says_it_closes(start, body,
                                                                           headers):
    coord = await start(max_body_bytes=1 << 20, max_ingest_bytes=1 << 20)
    reader, writer = await asyncio.open_connection("127.0.0.1", coord.client.server.port)
    try:
        code, reply_headers, _ = await _exchange(reader, writer, _post(body, **headers), body)
        assert 400 <= code < 500
        if reply_headers.get("connection", "").lower() == "close":
            assert await reader.read() == b""  # and it does close
            return
        # Not closing: the next requests on this connection are answered.
        code, _, reply = await _exchange(
            reader, writer, f"GET {HEALTH_PATH} HTTP/1.1\r\nHost: x\r\n\r\n".encode(), b"")
        assert code == 200, reply
        code, _, reply = await _exchange(reader, writer, _post(GOOD), GOOD)
        assert code == 200, reply
    finally:
        writer.close()
