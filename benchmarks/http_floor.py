"""`python -m benchmarks.http_floor`: the HTTP cost alone, for `bench_coordinator --profile`.

An aiohttp server set up as the coordinator's process sets up its own (`AppRunner` with no
access log, the same event loop, the same body limit) whose handlers read the request body
and answer canned bytes of the size the coordinator answers: a blend lookup's reply with
`--matches` matches, and an `/events` reply. Its CPU per request is what serving HTTP
costs before any coordinator work: parsing, the request object, reading the body, writing
the response, the socket calls. Same start-up contract as the coordinator (one line
``listening on http://HOST:PORT``; SIGTERM stops it), so `start_coordinator(module=...)`
runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from aiohttp import web

from blend_wire import (BLEND_LOOKUP_PATH, EVENTS_PATH, HEALTH_PATH, BlendLookupReply,
                        EventsReply, HealthReply, WireBlendMatch, encode)
from coordinator_stub.config import DEFAULT_MAX_BODY_BYTES


def canned_lookup_reply(matches: int) -> bytes:
    return encode(BlendLookupReply(matches=[
        WireBlendMatch(chunk_hash=f"{i:064x}", old_st=256 * i, cur_st=300 * i)
        for i in range(matches)]))


def build_app(matches: int) -> web.Application:
    lookup_reply = canned_lookup_reply(matches)
    events_reply = encode(EventsReply(applied=1, duplicates=0, stale=0))
    healthy = encode(HealthReply())

    def answering(reply: bytes):
        async def handler(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(body=reply, content_type="application/json")
        return handler

    app = web.Application(client_max_size=DEFAULT_MAX_BODY_BYTES)
    app.router.add_post(BLEND_LOOKUP_PATH, answering(lookup_reply))
    app.router.add_post(EVENTS_PATH, answering(events_reply))
    app.router.add_get(HEALTH_PATH, answering(healthy))
    return app


async def serve(host: str, port: int, matches: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    runner = web.AppRunner(build_app(matches), access_log=None, handle_signals=False)
    await runner.setup()
    server = await loop.create_server(runner.server, host, port, backlog=1024)
    bound_host, bound_port = server.sockets[0].getsockname()[:2]
    print(f"listening on http://{bound_host}:{bound_port}", flush=True)
    try:
        await stop.wait()
    finally:
        server.close()
        await runner.cleanup()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.http_floor",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--matches", type=int, default=16,
                        help="matches in the canned blend-lookup reply")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.host, args.port, args.matches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
