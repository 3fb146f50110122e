"""The reporter and a token's scope (issue 32, item 8).

Before: a `403` to a cache-event post (a batch outside the token's scope) was retried as
if the coordinator were down: every flush failed, the refused batch stayed at the head of
the queue and every event behind it waited with it, for good. Now a `403` is permanent:
the batch it refuses is dropped and counted (`forbidden_batches`, `forbidden_events`),
the other batches of the post are delivered in order, and the refusal is logged once.
"""

from __future__ import annotations

import logging

import httpx
import numpy as np
import pytest

from blend_wire import STATS_PATH
from coordinator_stub.launch.process import launch_coordinator
from plugin import BlendNamespace, CacheEventReporter

LANE = "coordinator"

EMITTER, ADMIN = "e" * 20, "z" * 20
MINE, THEIRS = BlendNamespace("m", "tenant", 1), BlendNamespace("m", "other", 1)
C = 4


def _tokens(seed: int) -> np.ndarray:
    return np.arange(seed, seed + C, dtype=np.uint32)


@pytest.mark.coordinator
def test_a_forbidden_batch_is_dropped_and_counted_and_the_rest_is_delivered(tmp_path,
                                                                            caplog):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"emitter {EMITTER} instances=srv-1 salts=tenant\nadmin {ADMIN}\n")
    with launch_coordinator("--enable-blend-lookup", "--chunk-size", str(C),
                            "--auth-token-file", str(tokens)) as running:
        reporter = CacheEventReporter(running.url, instance_id="srv-1", flush_interval=30.0,
                                      timeout=5.0, token=EMITTER)
        try:
            reporter.report_store(MINE, [b"\x01"], [_tokens(1)], [0])
            reporter.report_delete(THEIRS, [b"\x02"])  # a batch of its own: refused
            reporter.report_store(MINE, [b"\x03"], [_tokens(9)], [0])
            with caplog.at_level(logging.DEBUG, logger="plugin.reporter"):
                assert reporter.flush()  # not an outage: nothing left to retry
                reporter.report_store(THEIRS, [b"\x04", b"\x05"], [_tokens(5), _tokens(7)],
                                      [0, C])
                assert reporter.flush()
            stats = reporter.stats()
            assert (stats.forbidden_batches, stats.forbidden_events) == (2, 3)
            assert (stats.pending, stats.failed_flushes, stats.applied) == (0, 0, 2)
            errors = [r for r in caplog.records
                      if r.name == "plugin.reporter" and r.levelno >= logging.WARNING]
            assert len(errors) == 1 and "403" in errors[0].getMessage(), errors
        finally:
            reporter.close()
        stats = httpx.get(running.url + STATS_PATH, timeout=10,
                          headers={"Authorization": f"Bearer {ADMIN}"}).json()
        assert stats["num_keys"] == 2
