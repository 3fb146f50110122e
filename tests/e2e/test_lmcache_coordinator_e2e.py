"""A real LMCache 0.5.6 MP server (`lmcache server`) and LMCache's own CLI against the
bundled coordinator process: the server registers, heartbeats, reports its stores and
accesses, and deregisters on shutdown; `lmcache query coordinator` reads every API it
knows of ours; nothing in the server's log is a 404 or a failed coordinator call.

Stores come from LMCache's own client (`lmcache bench server`, CPU tensors over shared
memory), so the chunk hashes are LMCache's: the tokens form of `/directory/lookup`
must resolve the stored sequences to exactly those keys.

LMCache runs with usage tracking off and its tracking URL pointed at a dead loopback port.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from blend_wire import encode_tokens
from coordinator_stub.launch.process import launch_coordinator
from helpers import wait_until
from plugin.harness.lmcache_process import lmcache_command, quiet_lmcache_env, start_lmcache_server

LANE = "lmcache"

pytest.importorskip("lmcache", reason="LMCache 0.5.6 is installed by `make test` (the "
                    "project's Makefile); this test needs its server and CLI")

CHUNK = 256
REQUESTS = 3
TOKENS_PER_REQUEST = 512  # two chunks per request
INSTANCE = "e2e-lmcache"
HEARTBEAT_S = 0.5


def _lmcache(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(lmcache_command(*args), env=quiet_lmcache_env(),
                          capture_output=True, text=True, timeout=timeout)


# LMCache's CLI entry point (`lmcache.cli.main.main`, what the `lmcache` script runs), once
# per API, in one process: a CLI process spends seconds importing LMCache and torch before
# its one request, and one per API side by side took ~15 s of a loaded 2-core machine. Each
# run keeps its own stdout, stderr and exit code, as a process of its own would.
_QUERY_EACH_API = """
import contextlib, io, json, sys
from lmcache.cli.main import main
url, results = sys.argv[1], {}
for api in sys.argv[2:]:
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(["query", "coordinator", "--api", api, "--url", url, "--format", "json"])
    except SystemExit as exit:
        code = 0 if exit.code is None else exit.code if isinstance(exit.code, int) else 1
    results[api] = {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
json.dump(results, sys.__stdout__)
"""


def _query_coordinator(url: str, apis: tuple[str, ...]) -> dict[str, subprocess.CompletedProcess]:
    """`lmcache query coordinator --api API --url URL --format json` for each API."""
    child = subprocess.run([sys.executable, "-c", _QUERY_EACH_API, url, *apis],
                           env=quiet_lmcache_env(), capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    return {api: subprocess.CompletedProcess(api, **run)
            for api, run in json.loads(child.stdout).items()}


@pytest.fixture
def lmcache_server(tmp_path: Path):
    """A stock `lmcache server` (default engine, no plugin) against a coordinator: yields
    (coordinator, an HTTP client for it, the server)."""
    with launch_coordinator("--enable-blend-lookup", "--chunk-size", str(CHUNK)) as coord:
        server = start_lmcache_server(
            "stock", plugin_module=False, engine_type="default", coordinator_url=coord.url,
            instance_id=INSTANCE, chunk_size=CHUNK, l1_size_gb=0.2, log_dir=str(tmp_path),
            extra_flags=["--coordinator-advertise-ip", "127.0.0.1",
                         "--coordinator-heartbeat-interval", str(HEARTBEAT_S)])
        try:
            with httpx.Client(base_url=coord.url, timeout=10) as http:
                yield coord, http, server
        finally:
            server.stop(kill=True)


def test_lmcache_server_and_cli_against_the_bundled_coordinator(lmcache_server):
    coord, http, server = lmcache_server

    def listed() -> list[str]:
        return [i["instance_id"] for i in http.get("/instances").json()["instances"]]

    assert wait_until(lambda: INSTANCE in listed() or server.process.poll() is not None,
                      timeout=120, interval=0.2), "no registration"
    assert server.process.poll() is None, server.log_tail(60)
    registered_at = time.monotonic()
    [record] = http.get("/instances").json()["instances"]
    assert (record["ip"], record["http_port"]) == ("127.0.0.1", server.http_port)

    # LMCache's own client stores three 512-token requests through the server.
    bench = _lmcache("bench", "server", "--rpc-url", server.rpc_url,
                     "--mode", "cpu", "--transfer-mode", "lmcache_driven",
                     "--num-tokens", str(TOKENS_PER_REQUEST), "--start", "0",
                     "--end", str(REQUESTS), "--interval", "0.1",
                     "--kvcache-shape-spec", "(2,64,16,2,16):float16:2",
                     "--num-blocks", "64", "--url", f"http://127.0.0.1:{server.http_port}")
    assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-2000:]
    chunks = REQUESTS * TOKENS_PER_REQUEST // CHUNK
    stats = wait_until(lambda: (s := http.get("/directory/stats").json())["num_keys"] == chunks
                       and s["blend"]["num_chunks"] == chunks and s, timeout=120, interval=0.2)
    assert stats, "the stores' events did not arrive"
    assert stats["l1_keys_by_instance"] == {INSTANCE: chunks}
    assert stats["l1_count"] == chunks and stats["l1_size_bytes"] > 0

    # The server's chunk hashes are the tokens form's: LMCache's blake3 prefix chain.
    rows = http.get("/directory/keys").json()["keys"]
    assert len(rows) == chunks and all(row["num_tokens"] == CHUNK for row in rows)
    model = rows[0]["key"]["model_name"]
    tokens_of = {}
    for row in rows:
        [result] = http.post("/directory/lookup", json={"keys": [row["key"]]}).json()["results"]
        assert [p["instance_id"] for p in result["placements"]] == [INSTANCE]
        tokens_of[row["key"]["chunk_hash_hex"]] = result["token_ids"]
    for first, second in zip(rows[0::2], rows[1::2]):  # each request stored two chunks
        sequence = tokens_of[first["key"]["chunk_hash_hex"]] + \
            tokens_of[second["key"]["chunk_hash_hex"]]
        reply = http.post("/directory/lookup",
                          json={"token_ids": sequence, "model_name": model}).json()
        assert reply["chunks"] == 2
        assert [r["key"]["chunk_hash_hex"] for r in reply["results"]] == [
            first["key"]["chunk_hash_hex"], second["key"]["chunk_hash_hex"]]
        assert all(r["placements"] for r in reply["results"])
    # ...and the blend index found the stored content anywhere in a query.
    middle = tokens_of[rows[1]["key"]["chunk_hash_hex"]]
    found = http.post("/directory/blend-lookup", json={
        "tokens_b64": encode_tokens([1, 2, 3] + middle), "model_name": model}).json()
    assert {m["chunk_hash"] for m in found["matches"]} >= {rows[1]["key"]["chunk_hash_hex"]}
    assert any(m["cur_st"] == 3 for m in found["matches"])

    # LMCache's CLI reads every API of ours it knows.
    apis = ("health", "instances", "directory", "keys", "metrics")
    query = _query_coordinator(coord.url, apis)
    assert set(query) == set(apis)
    for api, result in query.items():
        assert result.returncode == 0, (api, result.stderr[-2000:])
    assert json.loads(query["health"].stdout)["metrics"]["status"] == "healthy"
    assert INSTANCE in query["instances"].stdout
    assert json.loads(query["directory"].stdout)["metrics"]["num_keys"] == chunks
    assert json.loads(query["keys"].stdout)["metrics"]["total"] == chunks
    assert "lmcache_coordinator_key_directory_placements" in query["metrics"].stdout

    # Heartbeats keep it registered well past several intervals (the log, checked below,
    # shows none failed); the stores and queries above usually took longer than that.
    time.sleep(max(0.0, registered_at + 4 * HEARTBEAT_S - time.monotonic()))
    assert listed() == [INSTANCE]

    # Shutdown deregisters it, and its L1 placements go with it.
    server.stop(timeout=60)
    assert listed() == []
    stats = http.get("/directory/stats").json()
    assert (stats["num_keys"], stats["l1_count"], stats["l1_keys_by_instance"]) == (0, 0, {})

    log = server.log_path.read_text()
    assert "Registered with coordinator as " + INSTANCE in log
    # LMCache's own words when a coordinator call fails (registrar.py, cache_events.py).
    for failure in (" 404", "Not Found", "no longer knows", "registration/heartbeat failed",
                    "Cache-event publish failed"):
        assert failure not in log, f"{failure!r} in LMCache's log:\n{log[-4000:]}"
