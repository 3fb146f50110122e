"""Fixtures of the hostile-client tests: an in-process coordinator (chunk size 4)."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from coordinator_stub import CoordinatorConfig, create_app
from hostile_helpers import C, Coord


@pytest.fixture
async def start():
    clients: list[TestClient] = []

    async def start_coordinator(**overrides) -> Coord:
        config = CoordinatorConfig(**{"chunk_size": C, "enable_blend_lookup": True, "port": 0,
                                      **overrides})
        client = TestClient(TestServer(create_app(config), host="127.0.0.1", port=0))
        await client.start_server()
        clients.append(client)
        return Coord(client)

    yield start_coordinator
    for client in clients:
        await client.close()


@pytest.fixture
async def coord(start) -> Coord:
    return await start()
