"""`python -m coordinator_stub` as a process: start-up line, serving, clean exit."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from coordinator_stub.process import launch_coordinator
from blend_wire import (
    BLEND_LOOKUP_PATH,
    EVENTS_PATH,
    HEALTH_PATH,
    STATS_PATH,
    encode,
    encode_tokens,
    pack_kv_rank,
)


def _store_body(chunk_hash: str, tokens: list[int], offset: int) -> bytes:
    key = {"chunk_hash_hex": chunk_hash, "model_name": "m", "kv_rank": pack_kv_rank(1)}
    batch = {"instance_id": "server-0", "incarnation": 0, "seq": 1, "event_type": "store",
             "tier": "l1", "backend": "dram",
             "entries": [{"key": key, "token_ids": tokens, "token_offset": offset}]}
    return encode({"batches": [batch]})


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_process_serves_a_store_and_a_lookup_and_exits_0(signum):
    with launch_coordinator("--enable-blend-lookup", "--chunk-size", "4") as running:
        with httpx.Client(base_url=running.url, timeout=10) as http:
            assert http.get(HEALTH_PATH).status_code == 200
            stored = http.post(EVENTS_PATH, content=_store_body("c0ffee", [5, 6, 7, 8], 16))
            assert stored.json() == {"applied": 1, "duplicates": 0, "stale": 0}
            query = {"tokens_b64": encode_tokens([1, 2, 5, 6, 7, 8]), "model_name": "m"}
            found = http.post(BLEND_LOOKUP_PATH, content=encode(query))
            assert found.json() == {"matches": [
                {"chunk_hash": "c0ffee", "old_st": 16, "cur_st": 2}]}
        running.process.send_signal(signum)
        assert running.process.wait(15) == 0


def test_process_without_the_flag_stores_but_never_matches():
    with launch_coordinator("--chunk-size", "4") as running:
        with httpx.Client(base_url=running.url, timeout=10) as http:
            http.post(EVENTS_PATH, content=_store_body("c0ffee", [5, 6, 7, 8], 0))
            query = {"tokens_b64": encode_tokens([5, 6, 7, 8]), "model_name": "m"}
            assert http.post(BLEND_LOOKUP_PATH, content=encode(query)).json() == {"matches": []}
            stats = http.get(STATS_PATH).json()
            assert stats["num_keys"] == 1 and stats["blend"]["num_chunks"] == 0
        assert running.stop() == 0


def test_help_explains_every_flag():
    result = subprocess.run([sys.executable, "-m", "coordinator_stub", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for flag in ("--host", "--port", "--enable-blend-lookup", "--chunk-size",
                 "--blend-probe-stride", "--max-body-bytes", "--max-query-tokens",
                 "--match-workers", "--log-level"):
        assert flag in result.stdout
    text = " ".join(result.stdout.split())  # argparse wraps lines
    assert "413" in text and "listening on" in text


def test_bad_flag_values_are_refused_at_start():
    result = subprocess.run([sys.executable, "-m", "coordinator_stub", "--chunk-size", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--chunk-size" in result.stderr
