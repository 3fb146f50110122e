"""Root of the test tree: the fixtures every coordinator test shares, in one place.

Its presence also puts tests/ on sys.path (pytest's default "prepend" import mode adds each
conftest's folder), so every test module, sub-folders included, imports the shared helpers
(`helpers` for the plugin side, `coordinator_client` for the coordinator side); no test
module imports another.

- `start(**overrides)`: an in-process coordinator (chunk size 4, blend lookup on) on a free
  loopback port, with `CoordinatorConfig` overrides; every one started is closed after the
  test.
- `coord`: one such coordinator with the defaults.
"""

from __future__ import annotations

import pytest

from coordinator_client import Coordinator, start_coordinator


@pytest.fixture
async def start():
    clients = []
    yield lambda **overrides: start_coordinator(clients, **overrides)
    for client in clients:
        await client.close()


@pytest.fixture
async def coord(start) -> Coordinator:
    return await start()
