"""Shared fixtures: a real coordinator process on a free loopback port."""

from __future__ import annotations

from typing import Iterator

import pytest

from coordinator_stub.process import CoordinatorProcess, launch_coordinator


@pytest.fixture
def coordinator() -> Iterator[CoordinatorProcess]:
    """A blend-enabled coordinator process with the production chunk size (256)."""
    with launch_coordinator("--enable-blend-lookup") as running:
        yield running
