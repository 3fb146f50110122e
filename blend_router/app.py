"""The router's HTTP application: take a request, choose an instance, forward, answer.

`create_router(config, tokenizer=None)` builds the aiohttp application (not started):
`POST /v1/completions`, `POST /v1/chat/completions`, `GET /healthz`. A request is admitted
(client token, body size and time, `access`, `intake`), read (`prompts`), scored, sent to
the instance `policy.choose_instance` picks from the coordinator's scores and the fleet's
load, and its answer streamed back (`forward`). Every answer, refusals included, says why
(`X-Route-Reason`) and, when sent on, where (`X-Routed-To`). Serve it with handler
cancellation on (`python -m blend_router` does), so a client leaving cancels its request
upstream. In full: docs/OPERATIONS.md, "Routing requests to where their KV is".
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Mapping

import aiohttp
import numpy as np
from aiohttp import web

from blend_router.access import ClientAccess
from blend_router.config import RouterConfig
from blend_router.coordinator import CoordinatorClient
from blend_router.fleet import Fleet
from blend_router.forward import Unreachable, backend_session, forward
from blend_router.intake import read_body
from blend_router.policy import chunk_hashes, choose_instance
from blend_router.prompts import (
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    ParsedRequest,
    Parser,
)
from blend_router.tokenizer import EngineTokenizer, ModelTokenizer, Tokenizers
from blend_wire import Refusal

log = logging.getLogger(__name__)


def refusal(status: int, detail: str, reason: str,
            headers: Mapping[str, str] | None = None) -> web.Response:
    """An answer the router gives itself: `{"detail": ...}` and its `X-Route-Reason`."""
    response = web.json_response({"detail": detail}, status=status,
                                 headers={**(headers or {}), "X-Route-Reason": reason})
    if status in (408, 413):  # the body was not read to its end: the connection is unusable
        response.force_close()
    return response


class Router:
    def __init__(self, config: RouterConfig, tokenizer: ModelTokenizer | None) -> None:
        self.config = config
        self.access = (ClientAccess.from_file(config.client_token_file)
                       if config.client_token_file else ClientAccess())
        self.fleet = Fleet(config.backends)
        self.coordinator = CoordinatorClient(config)
        self.parser = Parser()
        self.session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(total=config.backend_timeout_s,
                                              sock_connect=config.connect_timeout_s)
        engine = EngineTokenizer(self.fleet.any_url, lambda: self.session) \
            if config.engine_tokenize else None
        self.tokenizers = Tokenizers(tokenizer, engine)

    async def tokens_of(self, parsed: ParsedRequest, deadline: float) -> np.ndarray | None:
        """The request's ids to score; an engine's `/tokenize` only until `deadline`."""
        if self.tokenizers.engine is None:
            return await self.tokenizers.tokens_of(parsed)
        try:
            async with asyncio.timeout_at(deadline):
                return await self.tokenizers.tokens_of(parsed)
        except TimeoutError:
            return None

    async def choose(self, tokens: np.ndarray | None, model: str, cache_salt: str,
                     deadline: float) -> tuple[str | None, str, float, np.ndarray | None]:
        """`choose_instance`'s answer and the request's chunk hashes (None: unscored)."""
        model_name = self.config.model_name or model
        size = 0 if tokens is None else int(tokens.size)
        policy = self.config.routing
        if not size or not model_name:
            return *choose_instance(self.fleet, None, unscored_reason="unscored",
                                    request_tokens=size, policy=policy), None
        scores = await self.coordinator.score(
            tokens, model_name, cache_salt,
            max(deadline - asyncio.get_running_loop().time(), 0.001))
        chunks = None if scores is None else chunk_hashes(
            tokens, scores.chunk_size, f"{model_name}\0{cache_salt}")
        return *choose_instance(self.fleet, scores, unscored_reason="coordinator-unavailable",
                                request_tokens=size, policy=policy, chunks=chunks), chunks

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Admit, read, score and forward one request; a refusal on the way (401, 403, 408,
        413, 422) is raised, and answered by `_reason_on_every_answer`."""
        salts = self.access.salts_of(request.headers.get("Authorization", ""))
        raw = await read_body(request, self.config.max_body_bytes, self.config.body_timeout_s)
        parsed = await self.parser.parse(request.path, raw)
        self.access.check_salt(salts, parsed.cache_salt)
        loop = asyncio.get_running_loop()
        # The engine's /tokenize and the score share one budget; a local tokenizer's
        # milliseconds of CPU do not count against the score's.
        deadline = loop.time() + self.config.score_budget_s
        tokens = await self.tokens_of(parsed, deadline)
        if self.tokenizers.engine is None:
            deadline = loop.time() + self.config.score_budget_s
        instance, reason, service_s, chunks = await self.choose(
            tokens, parsed.model, parsed.cache_salt, deadline)
        failed = None
        while instance is not None:
            try:
                return await self.forward(request, raw, instance, reason, service_s, chunks)
            except Unreachable as exc:
                log.warning("instance %s unreachable (%s)", instance, exc)
                if failed is not None:
                    break
                failed, instance = instance, self.fleet.least_loaded(exclude=instance)
                reason = "retry-after-unreachable"
                service_s = self.config.routing.rates.service_s(
                    0 if tokens is None else int(tokens.size), None)
        if failed is not None:
            return refusal(502, f"instance {failed} could not be reached", "unreachable")
        return refusal(503, "no serving instance with a known engine is registered with the "
                            "coordinator (yet)", "no-instance")

    async def forward(self, request: web.Request, raw: bytes, instance: str, reason: str,
                      service_s: float, chunks: np.ndarray | None) -> web.StreamResponse:
        in_flight = self.fleet.begin(instance, service_s, chunks)
        try:
            return await forward(self.session, request, raw,
                                 self.fleet.urls[instance] + request.path,
                                 {"X-Routed-To": instance, "X-Route-Reason": reason},
                                 self._timeout, self.config.forward_client_authorization,
                                 on_first_piece=lambda: self.fleet.first_piece(in_flight))
        finally:
            self.fleet.end(in_flight)


ROUTER = web.AppKey("router", Router)


@web.middleware
async def _reason_on_every_answer(request: web.Request, handler) -> web.StreamResponse:
    """`X-Route-Reason` on every answer: a refusal (`blend_wire.Refusal`, by its own status,
    reason and headers: DESIGN.md "Refusals") and a path or method the router does not
    serve are `refused`, an error of its own `error` (logged, 500), `/healthz` `local`."""
    try:
        response = await handler(request)
    except Refusal as exc:
        return refusal(exc.status, exc.reason, "refused", exc.headers)
    except web.HTTPException as exc:
        return refusal(exc.status, exc.reason, "refused")
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("the router failed on %s %s", request.method, request.path)
        return refusal(500, "the router failed on this request (its log says why)", "error")
    if not response.prepared and "X-Route-Reason" not in response.headers:
        response.headers["X-Route-Reason"] = "local"
    return response


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    router = app[ROUTER]
    router.session = backend_session(router.config.backend_connections_per_host)
    await asyncio.get_running_loop().run_in_executor(None, router.parser.start)
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
    router.parser.close()


async def _health(request: web.Request) -> web.Response:
    fleet = request.app[ROUTER].fleet
    return web.json_response({"status": "healthy", "instances": len(fleet.urls),
                              "unroutable": len(fleet.unroutable)})


def create_router(config: RouterConfig, tokenizer: ModelTokenizer | None = None
                  ) -> web.Application:
    """The application (module doc); `ValueError` for a client token file it cannot use."""
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[_reason_on_every_answer])
    router = app[ROUTER] = Router(config, tokenizer)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post(COMPLETIONS_PATH, router.handle)
    app.router.add_post(CHAT_COMPLETIONS_PATH, router.handle)
    app.router.add_get("/healthz", _health)
    return app
