"""`python -m coordinator_stub`: run the bundled coordinator until SIGINT/SIGTERM.

Contract (tests/conftest.py relies on it): once the socket is bound, exactly one line
``listening on http://HOST:PORT`` is written to stdout and flushed, with the real port
when `--port 0` asked for a free one. Logs go to stderr. On SIGINT or SIGTERM the server
stops accepting, finishes in-flight requests, stops its worker threads and exits 0.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from typing import Sequence

from aiohttp import web

from coordinator_stub.app import create_app
from coordinator_stub.config import CoordinatorConfig, parse_args

log = logging.getLogger("coordinator_stub")


def _tune_runtime() -> None:
    """Process-wide settings for a long-lived server holding millions of small objects.

    - The directory keeps GC-untracked records, but each ingested entry still allocates a
      few tracked objects (decoded structs, token lists) that refcounting frees at once;
      the default gen-0 threshold (700) would run a collection every few hundred entries.
    - Objects alive after start-up (modules, compiled kernels, the empty index) are frozen
      out of every later collection pass.
    - A shorter GIL switch interval (default 5 ms) lets a match worker finishing its
      kernel, or the loop answering a health check, get the GIL back sooner while another
      thread runs Python: it bounds tail latency, at a small cost in throughput.
    """
    gc.set_threshold(50_000, 20, 10)
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(0.001)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve(config: CoordinatorConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    # No access log: a line per request would cost more than serving a lookup.
    runner = web.AppRunner(create_app(config), access_log=None, handle_signals=False)
    await runner.setup()
    _tune_runtime()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        print(f"listening on {_url(host, port)}", flush=True)
        log.info("blend lookup %s, chunk size %d, probe stride %d",
                 "on" if config.enable_blend_lookup else "off", config.chunk_size,
                 config.blend_probe_stride)
        await stop.wait()
        log.info("shutting down")
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(level=config.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
