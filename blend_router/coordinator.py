"""The router's calls to the coordinator: the instance registry and the blend score."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import numpy as np

from blend_router.config import RouterConfig
from blend_router.fleet import Fleet
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


class CoordinatorClient:
    """`GET /instances` into a `Fleet`, and `POST /directory/blend-score` within a budget.

    Connections of their own (not the instances'): the registry one, the scores at most
    `coordinator_connections`, so neither slow instances nor a burst of scores keep the
    listing from being refreshed. A score given up on closes its connection, which tells
    the coordinator to drop the match work it still had queued for it."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.session: aiohttp.ClientSession | None = None
        self._registry: aiohttp.ClientSession | None = None
        self._reachable: bool | None = None  # None: not tried yet
        base = config.coordinator_url.rstrip("/")
        self._score_url, self._instances_url = base + BLEND_SCORE_PATH, base + INSTANCES_PATH
        self._auth = ({"Authorization": f"Bearer {config.coordinator_token}"}
                      if config.coordinator_token else {})

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.config.coordinator_connections),
            timeout=aiohttp.ClientTimeout(total=None))
        self._registry = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1),
                                               timeout=aiohttp.ClientTimeout(total=None))

    async def close(self) -> None:
        for session in (self.session, self._registry):
            if session is not None:
                await session.close()

    async def refresh(self, fleet: Fleet) -> bool:
        """Read the registry into `fleet`; on failure keep the last listing and say so
        (naming the URL) once per run of failures."""
        try:
            async with asyncio.timeout(self.config.refresh_interval_s):
                async with self._registry.get(self._instances_url,
                                              headers=self._auth) as reply:
                    if reply.status != 200:
                        return self._failed(f"it answered HTTP {reply.status}")
                    fleet.update(decode(await reply.read(), InstancesReply))
        except TimeoutError:
            return self._failed(f"no answer within {self.config.refresh_interval_s} s")
        except (aiohttp.ClientError, WireError) as exc:
            return self._failed(f"{type(exc).__name__}: {exc}")
        if self._reachable is False:
            log.info("the coordinator at %s answers again", self._instances_url)
        self._reachable = True
        return True

    def _failed(self, why: str) -> bool:
        if self._reachable is not False:
            log.warning("cannot read the instance registry at %s (%s); keeping the last "
                        "listing and trying again every %s s", self._instances_url, why,
                        self.config.refresh_interval_s)
        self._reachable = False
        return False

    async def refresh_forever(self, fleet: Fleet) -> None:
        while True:
            await self.refresh(fleet)
            await asyncio.sleep(self.config.refresh_interval_s)

    async def score(self, tokens: np.ndarray, model_name: str, cache_salt: str,
                    budget_s: float | None = None) -> BlendScoreReply | None:
        """The coordinator's scores, or None when it did not answer within `budget_s`
        (default: the score budget)."""
        body = encode(BlendScoreRequest(tokens_b64=encode_tokens(tokens), model_name=model_name,
                                        world_size=self.config.world_size,
                                        cache_salt=cache_salt))
        try:
            async with asyncio.timeout(self.config.score_budget_s if budget_s is None
                                       else budget_s):
                async with self.session.post(self._score_url, data=body, headers={
                        **self._auth, "Content-Type": "application/json"}) as reply:
                    if reply.status != 200:
                        return None
                    return decode(await reply.read(), BlendScoreReply)
        except (TimeoutError, aiohttp.ClientError, WireError):
            return None
