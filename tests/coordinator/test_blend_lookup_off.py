"""Blend lookup is off unless the coordinator is started with `--enable-blend-lookup`
(LMCache's default, kept: docs/OPERATIONS.md, "Blend lookup is off by default"). Reuse
through the fleet is then zero, and both sides say why: the coordinator at start-up, and the
plugin's client on the first lookup such a coordinator answers (its candidates reply carries
`"blend_lookup": false`, docs/WIRE.md).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from blend_wire import BLEND_LOOKUP_PATH, encode, encode_tokens
from coordinator_stub.launch.process import launch_coordinator
from helpers import take_when_done
from plugin import BlendCoordinatorClient, BlendNamespace, MatchState

LANE = "coordinator"

NS = BlendNamespace("m", "", 1)
TOKENS = np.arange(1000, 1000 + 3 * 256, dtype=np.uint32)


@pytest.mark.parametrize("off", [True, False])
def test_blend_lookup_off_is_said_at_start_and_on_the_first_lookup(tmp_path, caplog, off):
    flags = () if off else ("--enable-blend-lookup",)
    log = tmp_path / "coordinator.log"
    with open(log, "w") as stderr, launch_coordinator(*flags, stderr=stderr) as coordinator:
        client = BlendCoordinatorClient(coordinator.url, chunk_size=256, timeout=30)
        try:
            with caplog.at_level(logging.WARNING, logger="plugin.client"):
                for n in range(3):
                    assert client.submit(f"q{n}", TOKENS, NS, time.monotonic() + 30)
                    assert take_when_done(client, f"q{n}", timeout=30).state is MatchState.DONE
        finally:
            client.close()
    said = [r.getMessage() for r in caplog.records if "blend lookup off" in r.getMessage()]
    at_start = [line for line in log.read_text().splitlines()
                if "WARNING" in line and "blend lookup is off" in line]
    if off:
        assert len(said) == 1, said  # once per coordinator URL, not per lookup
        assert coordinator.url in said[0] and "--enable-blend-lookup" in said[0]
        assert len(at_start) == 1 and "--enable-blend-lookup" in at_start[0], log.read_text()
    else:
        assert said == [] and at_start == []


@pytest.mark.unit
async def test_the_candidates_reply_says_blend_lookup_is_off_and_only_then(start):
    body = encode({"tokens_b64": encode_tokens(TOKENS[:8]), "model_name": "m",
                   "candidates": True})
    for enabled in (False, True):
        coord = await start(enable_blend_lookup=enabled)
        reply = await (await coord.call("POST", BLEND_LOOKUP_PATH, data=body)).json()
        assert reply["candidates"] == []
        if enabled:
            assert "blend_lookup" not in reply  # written only when false
        else:
            assert reply["blend_lookup"] is False
