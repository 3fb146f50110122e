"""`python -m blend_router --coordinator-url URL [--port 8100] ...`: the router
(docs/OPERATIONS.md). Prints `listening on http://HOST:PORT` once bound; exits 0 on
SIGINT/SIGTERM; a port it cannot bind is one line and exit 1."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import sys

from aiohttp import web

from blend_router.app import create_router
from blend_router.config import RouterConfig, parse_backend
from blend_router.policy import RoutingPolicy, ServiceRates
from blend_router.tokenizer import ModelTokenizer
from blend_wire.version import version_line

log = logging.getLogger("blend_router")


def _add_tokens_and_choice(parser: argparse.ArgumentParser) -> None:
    """The flags of tokenization and of the choice of instance."""
    parser.add_argument("--tokenizer", metavar="PATH", default=None,
                        help="the served model's tokenizer.json (or the folder holding it, "
                             "with tokenizer_config.json's chat template) for text prompts "
                             "and chats (default, or 'none': none)")
    parser.add_argument("--engine-tokenize", action="store_true",
                        help="ask an engine's POST /tokenize (vLLM's API), within the score "
                             "budget, for what --tokenizer cannot tokenize; without either, "
                             "text requests are routed unscored")
    rates, policy = ServiceRates(), RoutingPolicy()
    choice = parser.add_argument_group(
        "choice of instance", "where the first token is predicted soonest: the work queued "
        "ahead plus the request's own prefill and loads there, at these rates (defaults: "
        "Llama-3-8B on one A100; docs/DESIGN.md, 'Routing')")
    for flag, name, unit in (("--prefill-rate", "prefill_tokens_s", "prompt tokens prefilled"),
                             ("--l1-load-rate", "l1_load_tokens_s",
                              "tokens of KV loaded from the instance's own L1"),
                             ("--shared-load-rate", "shared_load_tokens_s",
                              "tokens of KV loaded from a shared tier"),
                             ("--peer-load-rate", "peer_load_tokens_s",
                              "tokens of KV loaded from a peer")):
        choice.add_argument(flag, type=float, default=getattr(rates, name), dest=name,
                            metavar="TOKENS_S",
                            help=f"{unit} per second (default: %(default)s)")
    choice.add_argument("--blend-recompute", type=float, default=rates.blend_recompute,
                        help="share of reused non-prefix tokens CacheBlend recomputes "
                             "(default: %(default)s)")
    choice.add_argument("--decode-cost", type=float, default=rates.decode_s,
                        help="GPU seconds one request's decode takes from the next prefill "
                             "(default: %(default)s)")
    choice.add_argument("--delay-weight", type=float, default=policy.delay_weight,
                        help="the request's own service counts 1 + this x the requests "
                             "waiting at the instance and per instance in the fleet: the "
                             "delay it causes those queuing behind it; 0: its own time to "
                             "first token only (default: %(default)s)")
    choice.add_argument("--max-imbalance", type=int, default=-1 if policy.max_imbalance is None
                        else policy.max_imbalance,
                        help="an instance with more requests waiting than the least-loaded "
                             "one plus this is not chosen; -1: no bound (default: "
                             "%(default)s)")
    choice.add_argument("--cache-greedy", action="store_true",
                        help="the best score wins and load only breaks ties (the router "
                             "before load-aware routing)")


def routing_policy(args: argparse.Namespace) -> RoutingPolicy:
    """The choice the flags describe (ValueError for rates out of range)."""
    rates = ServiceRates(prefill_tokens_s=args.prefill_tokens_s,
                         l1_load_tokens_s=args.l1_load_tokens_s,
                         shared_load_tokens_s=args.shared_load_tokens_s,
                         peer_load_tokens_s=args.peer_load_tokens_s,
                         blend_recompute=args.blend_recompute, decode_s=args.decode_cost)
    return RoutingPolicy(rates=rates, delay_weight=args.delay_weight,
                         max_imbalance=None if args.max_imbalance == -1 else args.max_imbalance,
                         load_aware=not args.cache_greedy)


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
    parser.add_argument("--backend", action="append", default=[], metavar="INSTANCE=URL",
                        help="the engine (OpenAI server, http(s)://HOST:PORT) of a registered "
                             "instance, over the engine_url it registers; repeatable")
    parser.add_argument("--client-token-file", default="",
                        help="client tokens and the cache salts each may name, lines 'TOKEN "
                             "[salts=S[,S...]]'; without it the router is open and scores the "
                             "empty salt only")
    parser.add_argument("--forward-client-authorization", action="store_true",
                        help="pass the client's Authorization header on to the instance "
                             "(default: never sent on)")
    parser.add_argument("--score-budget", type=float, default=0.05,
                        help="seconds a blend score may take before the request is routed "
                             "least-loaded instead (default: %(default)s)")
    parser.add_argument("--refresh-interval", type=float, default=2.0,
                        help="seconds between reads of the coordinator's instance registry "
                             "(default: %(default)s)")
    _add_tokens_and_choice(parser)
    parser.add_argument("--model-name", default="",
                        help="the model name the instances' LMCache reports (default: each "
                             "request's 'model')")
    parser.add_argument("--world-size", type=int, default=1,
                        help="the instances' TP x PP, part of the namespace (default: "
                             "%(default)s)")
    parser.add_argument("--backend-timeout", type=float, default=600.0,
                        help="seconds an instance may take for a whole answer (default: "
                             "%(default)s)")
    parser.add_argument("--connect-timeout", type=float, default=5.0,
                        help="seconds to open a connection to an instance (default: "
                             "%(default)s)")
    parser.add_argument("--backend-connections-per-host", type=int, default=64,
                        help="connections open to one instance at most (default: "
                             "%(default)s)")
    parser.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024,
                        help="largest request body taken; larger is 413 before it is read "
                             "(default: %(default)s)")
    parser.add_argument("--body-timeout", type=float, default=30.0,
                        help="seconds a request body may take to arrive; 408 past it "
                             "(default: %(default)s)")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


async def _serve(app: web.Application, host: str, port: int) -> int:
    # Handler cancellation: a client that leaves cancels its request, and with it the
    # connection to the instance serving it (blend_router/forward.py).
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        log.critical("cannot listen on http://%s:%s: %s%s", host, port, exc.strerror or exc,
                     " (another process holds the port: stop it, or choose another with "
                     "--port; --port 0 picks a free one)"
                     if exc.errno == errno.EADDRINUSE else "")
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    bound_host, bound_port = runner.addresses[0][:2]
    print(f"listening on http://{bound_host}:{bound_port}", flush=True)
    await stop.wait()
    await runner.cleanup()
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = RouterConfig(
            coordinator_url=args.coordinator_url, host=args.host, port=args.port,
            score_budget_s=args.score_budget, refresh_interval_s=args.refresh_interval,
            coordinator_token=os.environ.get("ROUTER_COORDINATOR_TOKEN", ""),
            model_name=args.model_name, world_size=args.world_size,
            backend_timeout_s=args.backend_timeout, connect_timeout_s=args.connect_timeout,
            backends=dict(parse_backend(value) for value in args.backend),
            client_token_file=args.client_token_file,
            forward_client_authorization=args.forward_client_authorization,
            max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout,
            backend_connections_per_host=args.backend_connections_per_host,
            engine_tokenize=args.engine_tokenize,
            routing=routing_policy(args))
        tokenizer = None if args.tokenizer in (None, "none") else ModelTokenizer(args.tokenizer)
        app = create_router(config, tokenizer)
    except (ValueError, RuntimeError) as exc:
        parser.error(str(exc))
    return asyncio.run(_serve(app, config.host, config.port))


if __name__ == "__main__":
    raise SystemExit(main())
