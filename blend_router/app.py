"""The router's HTTP application: take a request, choose an instance, forward, answer.

`create_router(config, tokenizer=None)` builds the aiohttp application (not started):
`POST /v1/completions`, `POST /v1/chat/completions`, `GET /healthz`. Each request goes to
the instance `policy.choose_instance` picks from the coordinator's scores and the fleet's
load; the reply says which and why (`X-Routed-To`, `X-Route-Reason`) and is streamed back
as the instance sends it. Bad input: `422`, nothing forwarded. Tokens, namespace,
fallbacks and errors in full: docs/OPERATIONS.md, "Routing requests to where their KV is".
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

import aiohttp
import numpy as np
from aiohttp import web

from blend_router.config import RouterConfig
from blend_router.coordinator import CoordinatorClient
from blend_router.fleet import Fleet
from blend_router.forward import forward
from blend_router.policy import choose_instance
from blend_router.prompts import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, BadRequest
from blend_router.tokenizer import Tokenizer, tokens_of

log = logging.getLogger(__name__)


class Router:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.fleet = Fleet()
        self.coordinator = CoordinatorClient(config)
        self.session: aiohttp.ClientSession | None = None

    async def choose(self, tokens: np.ndarray | None, body: dict) -> tuple[str | None, str]:
        model_name = self.config.model_name or body.get("model")
        cache_salt = body.get("cache_salt", "")
        if tokens is None or not tokens.size or not isinstance(model_name, str) \
                or not model_name or not isinstance(cache_salt, str):
            return choose_instance(self.fleet, None, unscored_reason="unscored",
                                   request_tokens=0 if tokens is None else int(tokens.size))
        scores = await self.coordinator.score(tokens, model_name, cache_salt)
        return choose_instance(self.fleet, scores, unscored_reason="coordinator-unavailable",
                               request_tokens=int(tokens.size))

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            tokens = await tokens_of(self.tokenizer, request.path, body)
        except (ValueError, BadRequest) as exc:  # json.JSONDecodeError is a ValueError
            detail = str(exc) if isinstance(exc, BadRequest) else f"the body is not JSON: {exc}"
            return web.json_response({"detail": detail}, status=422)
        instance, reason = await self.choose(tokens, body)
        if instance is None:
            return web.json_response(
                {"detail": "no serving instance is registered with the coordinator (yet)"},
                status=503)
        size = 0 if tokens is None else int(tokens.size)
        for attempt in range(2):
            try:
                return await self.forward(request, raw, instance, reason, size)
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                log.warning("instance %s unreachable (%s)", instance, type(exc).__name__)
                failed, instance = instance, self.fleet.least_loaded(exclude=instance)
                reason = "retry-after-unreachable"
                if instance is None or attempt:
                    return web.json_response(
                        {"detail": f"instance {failed} could not be reached"}, status=502)
        raise AssertionError("unreachable")

    async def forward(self, request: web.Request, raw: bytes, instance: str, reason: str,
                      tokens: int) -> web.StreamResponse:
        self.fleet.begin(instance, tokens)
        try:
            return await forward(self.session, request, raw,
                                 self.fleet.urls[instance] + request.path,
                                 {"X-Routed-To": instance, "X-Route-Reason": reason},
                                 self.config.backend_timeout_s)
        finally:
            self.fleet.end(instance, tokens)


ROUTER = web.AppKey("router", Router)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    router = app[ROUTER]
    router.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
    await router.coordinator.start()
    await router.coordinator.refresh(router.fleet)
    task = asyncio.create_task(router.coordinator.refresh_forever(router.fleet))
    yield
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    await router.coordinator.close()
    await router.session.close()


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "healthy",
                              "instances": len(request.app[ROUTER].fleet.urls)})


def create_router(config: RouterConfig, tokenizer: Tokenizer | None = None) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    router = app[ROUTER] = Router(config, tokenizer)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post(COMPLETIONS_PATH, router.handle)
    app.router.add_post(CHAT_COMPLETIONS_PATH, router.handle)
    app.router.add_get("/healthz", _health)
    return app
