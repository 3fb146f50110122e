"""`python -m coordinator_stub` as a process: start-up line, serving, clean exit."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

from coordinator_stub.launch.process import launch_coordinator
from blend_wire import (
    BLEND_LOOKUP_PATH,
    EVENTS_PATH,
    HEALTH_PATH,
    INSTANCES_PATH,
    METRICS_PATH,
    STATS_PATH,
    encode,
    encode_tokens,
    pack_kv_rank,
)

LANE = "coordinator"


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
            assert http.get(HEALTH_PATH).json() == {"status": "healthy"}
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
                 "--match-workers", "--instance-timeout", "--health-check-interval",
                 "--disable-metrics", "--log-level"):
        assert flag in result.stdout
    text = " ".join(result.stdout.split())  # argparse wraps lines
    assert "413" in text and "listening on" in text


@pytest.mark.parametrize("flag, value", [
    ("--chunk-size", "0"), ("--health-check-interval", "-1"), ("--instance-timeout", "0")])
def test_bad_flag_values_are_refused_at_start(flag, value):
    result = subprocess.run([sys.executable, "-m", "coordinator_stub", flag, value],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert flag.lstrip("-").replace("-", "_") in result.stderr or flag in result.stderr


def test_process_reaps_with_its_flags_and_disables_metrics():
    with launch_coordinator("--health-check-interval", "0.1", "--instance-timeout", "0.3",
                            "--disable-metrics") as running:
        with httpx.Client(base_url=running.url, timeout=10) as http:
            assert http.get(METRICS_PATH).status_code == 404
            http.post(INSTANCES_PATH, json={"instance_id": "i1", "ip": "h", "http_port": 1})
            assert [i["instance_id"] for i in http.get(INSTANCES_PATH).json()["instances"]]
            deadline = time.monotonic() + 15
            while http.get(INSTANCES_PATH).json()["instances"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert http.get(INSTANCES_PATH).json()["instances"] == []
