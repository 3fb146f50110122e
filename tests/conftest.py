"""Root of the test tree: the fixtures every coordinator test shares, in one place.

Its presence also puts tests/ on sys.path (pytest's default "prepend" import mode adds each
conftest's folder), so every test module, sub-folders included, imports the shared helpers
(`helpers` for the plugin side, `coordinator_client` for the coordinator side); no test
module imports another.

- `start(**overrides)`: an in-process coordinator (chunk size 4, blend lookup on) on a free
  loopback port, with `CoordinatorConfig` overrides; every one started is closed after the
  test.
- `coord`: one such coordinator with the defaults.

Hypothesis runs without its per-example deadline: property tests assert results, not
speed, and a first example that compiles or loads kernels on a loaded 2-core machine took
over a second (seen: `test_wire.py`).
"""

from __future__ import annotations

import pytest
from hypothesis import settings

from coordinator_client import Coordinator, start_coordinator

settings.register_profile("suite", deadline=None)
settings.load_profile("suite")


@pytest.fixture
async def start():
    clients = []
    yield lambda **overrides: start_coordinator(clients, **overrides)
    for client in clients:
        await client.close()


@pytest.fixture
async def coord(start) -> Coordinator:
    return await start()
