"""Unified-lookup latency: local-only vs healthy coordinator vs stopped coordinator (breaker open).

    python -m benchmarks.bench_unified_lookup [--iterations N] [--query-chunks K]

One server B (a `BlendPlugin` over an `InMemoryHost` sharing an L2 with server A) answers
RAG-style queries mixing documents it stored itself and documents A stored. Latency is the
wall time from the first `cb_unified_lookup` call to the result, polling as a scheduler does.

Three legs, each as a ratio to local-only measured in the same run:
- local-only: the same server with no coordinator (the reference);
- healthy: the bundled coordinator running, fleet leg on;
- breaker open: the coordinator stopped, after the circuit breaker opened.
Local-only and the leg under test alternate query by query, so drift on the machine hits both
alike; each ratio uses the local-only samples of its own phase. The breaker-open ratio must stay
at or below 1.2 (p50 and p99); the exit code is 1 otherwise.
"""

from __future__ import annotations

import argparse
import gc
import logging
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import machine_description, percentile_ms
from coordinator_stub.launch.process import start_coordinator
from plugin import BlendPlugin, InMemoryHost, LookupKey, PluginConfig

C = 256
MODEL = "bench-model"
MAX_BREAKER_RATIO = 1.2


def timed_lookup(plugin: BlendPlugin, key: LookupKey) -> tuple[float, int]:
    """Seconds from the first call to the result, and the tokens it covers."""
    started = time.perf_counter()
    while (result := plugin.cb_unified_lookup(key, 1)) is None:
        time.sleep(0)  # yield to the client's worker threads, as a busy scheduler would
    return time.perf_counter() - started, result.covered_tokens


def save(host: InMemoryHost, plugins: list[BlendPlugin], request_id: str, tokens) -> None:
    key = LookupKey(request_id, tokens, MODEL)
    hashes = host.chunk_hashes(key)
    host.store(key, hashes, 0)
    for plugin in plugins:
        plugin.on_store(key, hashes, 0)


def interleaved(reference: BlendPlugin, tested: BlendPlugin, queries, iterations: int, tag: str):
    ref_s, test_s, ref_cov, test_cov = [], [], 0, 0
    gc.collect()
    gc.disable()  # a collection inside one sample would be noise, not lookup cost
    try:
        for i in range(iterations):
            tokens = queries[i % len(queries)]
            # Alternate which leg goes first, so neither always runs on a warmer cache.
            order = [(reference, ref_s), (tested, test_s)]
            if i % 2:
                order.reverse()
            for plugin, samples in order:
                seconds, covered = timed_lookup(plugin, LookupKey(f"{tag}-{i}-{id(plugin)}", tokens, MODEL))
                samples.append(seconds)
                if plugin is reference:
                    ref_cov += covered
                else:
                    test_cov += covered
    finally:
        gc.enable()
    return ref_s, test_s, ref_cov / iterations, test_cov / iterations


def make_queries(rng: np.random.Generator, docs_a: list, docs_b: list, length: int,
                 count: int = 32) -> list[np.ndarray]:
    """RAG-style queries: documents of either server in random order, short filler between."""
    queries = []
    for _ in range(count):
        pieces, total = [], 0
        while total < length:
            pool = docs_a if rng.random() < 0.5 else docs_b
            piece = pool[int(rng.integers(len(pool)))]
            filler = rng.integers(1000, 60000, int(rng.integers(5, 80)), dtype=np.uint32)
            pieces += [filler, piece]
            total += len(filler) + len(piece)
        queries.append(np.concatenate(pieces)[:length])
    return queries


def open_breaker(plugin: BlendPlugin, query: np.ndarray) -> None:
    """With the coordinator stopped, a few lookups fail fast (refused) and open the breaker."""
    for i in range(20):
        timed_lookup(plugin, LookupKey(f"open-{i}", query, MODEL))
        if plugin.client.breaker_state == "open":
            return
    raise AssertionError("the breaker did not open")


def row(name: str, samples: list[float], reference: list[float]) -> tuple[float, float]:
    """One line of the table; returns the (p50, p99) ratios to the reference."""
    p50, p99 = percentile_ms(samples, 50), percentile_ms(samples, 99)
    r50 = p50 / percentile_ms(reference, 50)
    r99 = p99 / percentile_ms(reference, 99)
    print(f"{name:<28} {p50:>9.3f} {p99:>9.3f} {r50:>9.2f}x {r99:>9.2f}x")
    return r50, r99


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2000, help="lookups per leg (default 2000)")
    parser.add_argument("--query-chunks", type=int, default=32,
                        help="query length in chunks of 256 tokens (default 32 = 8192 tokens)")
    parser.add_argument("--docs", type=int, default=64, help="documents per server (default 64)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the stopped leg logs warnings by design

    rng = np.random.default_rng(5)
    print(f"machine: {machine_description()}")
    print(f"setup: chunk size {C}, {args.docs} documents on each of servers A and B, "
          f"queries of {args.query_chunks * C} tokens, {args.iterations} lookups per leg\n")

    coordinator = start_coordinator("--enable-blend-lookup", "--chunk-size", str(C),
                                    stderr=subprocess.DEVNULL)
    l2: dict = {}
    fleet_config = dict(coordinator_url=coordinator.url, event_reporting=True, chunk_size=C,
                        blend_timeout=1.0, event_flush_interval=0.2)
    host_a, host_b = InMemoryHost(C, shared_l2=l2), InMemoryHost(C, shared_l2=l2)
    server_a = BlendPlugin(PluginConfig(instance_id="A", **fleet_config), host_a)
    fleet_b = BlendPlugin(PluginConfig(instance_id="B", **fleet_config), host_b)
    local_b = BlendPlugin(PluginConfig(instance_id="B-local", chunk_size=C), host_b)
    try:
        docs_a, docs_b = ([rng.integers(1000, 60000, int(rng.integers(2, 6)) * C, dtype=np.uint32)
                           for _ in range(args.docs)] for _ in range(2))
        for d, doc in enumerate(docs_a):
            save(host_a, [server_a], f"a-{d}", doc)
        for d, doc in enumerate(docs_b):
            save(host_b, [fleet_b, local_b], f"b-{d}", doc)
        assert server_a.flush() and fleet_b.flush(), "events did not reach the coordinator"
        queries = make_queries(rng, docs_a, docs_b, args.query_chunks * C)

        # Warm-up: numba kernels, HTTP keep-alive connections, caches.
        interleaved(local_b, fleet_b, queries, 100, "warm")
        local_h, healthy, cov_local, cov_healthy = interleaved(local_b, fleet_b, queries,
                                                               args.iterations, "healthy")
        coordinator.stop()
        open_breaker(fleet_b, queries[0])
        local_s, stopped, _, _ = interleaved(local_b, fleet_b, queries, args.iterations, "stopped")
        breaker_skips = fleet_b.client.stats().skipped_breaker
    finally:
        for plugin in (server_a, fleet_b, local_b):
            plugin.close()
        coordinator.stop()

    print(f"{'lookup latency':<28} {'p50 ms':>9} {'p99 ms':>9} {'p50 ratio':>10} {'p99 ratio':>10}")
    print("phase 1: coordinator running")
    row("  local-only (reference)", local_h, local_h)
    row("  healthy coordinator", healthy, local_h)
    print("phase 2: coordinator stopped")
    row("  local-only (reference)", local_s, local_s)
    r50, r99 = row("  breaker open", stopped, local_s)
    print(f"\nreuse per query: local-only {cov_local:.0f} tokens, with the fleet leg "
          f"{cov_healthy:.0f} tokens ({cov_healthy / max(cov_local, 1):.2f}x)")
    print(f"breaker open: {breaker_skips} lookups skipped the fleet leg without waiting")
    ok = r50 <= MAX_BREAKER_RATIO and r99 <= MAX_BREAKER_RATIO
    print(f"breaker-open ratio <= {MAX_BREAKER_RATIO}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
