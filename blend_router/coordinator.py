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
    """`GET /instances` into a `Fleet`, and `POST /directory/blend-score` within a budget."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.session: aiohttp.ClientSession | None = None
        base = config.coordinator_url.rstrip("/")
        self._score_url, self._instances_url = base + BLEND_SCORE_PATH, base + INSTANCES_PATH
        self._auth = ({"Authorization": f"Bearer {config.coordinator_token}"}
                      if config.coordinator_token else {})

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def refresh(self, fleet: Fleet) -> bool:
        try:
            async with asyncio.timeout(self.config.refresh_interval_s):
                async with self.session.get(self._instances_url, headers=self._auth) as reply:
                    if reply.status != 200:
                        log.warning("GET /instances answered %d; keeping the last listing",
                                    reply.status)
                        return False
                    fleet.update(decode(await reply.read(), InstancesReply))
                    return True
        except (TimeoutError, aiohttp.ClientError, WireError) as exc:
            log.warning("GET /instances failed (%s); keeping the last listing",
                        type(exc).__name__)
            return False

    async def refresh_forever(self, fleet: Fleet) -> None:
        while True:
            await self.refresh(fleet)
            await asyncio.sleep(self.config.refresh_interval_s)

    async def score(self, tokens: np.ndarray, model_name: str, cache_salt: str
                    ) -> BlendScoreReply | None:
        """The coordinator's scores, or None when it did not answer within the budget."""
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
