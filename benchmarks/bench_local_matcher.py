"""Local matcher benchmark: recall, match latency, registration rate, memory per chunk.

For each N it registers N random 256-token chunks (stored sequences of 16 chunks),
then matches queries of about 9,300 tokens, each holding 32 distinct stored chunks at
random offsets with random filler between. The reference, measured in the same run, is
a brute-force scan: a dict from every stored chunk's bytes, looked up at every query
offset. Both must report the same matches.

    python -m benchmarks.bench_local_matcher [--sizes 50000 200000 800000] [--queries 50]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import (machine_description, percentile_ms, prefault_memory,
                               release_free_memory, rss_bytes)
from local_matcher import LocalMatcher

CHUNK = 256
CHUNKS_PER_SEQUENCE = 16
PLANTED = 32
VOCAB = 128_000

# LMCache 0.5.6's released matcher on this workload and machine kind (from the issue,
# not measured by this script): p50 ms by N.
LMCACHE_P50_MS = {50_000: 0.61, 200_000: 1.32, 800_000: 3.42}


def make_queries(rng, stored: np.ndarray, count: int):
    """Queries of 32 distinct stored chunks with random filler; returns (query, planted)."""
    queries = []
    for _ in range(count):
        picks = rng.choice(stored.shape[0], size=PLANTED, replace=False)
        fillers = rng.integers(0, 2 * 1100 // PLANTED, size=PLANTED + 1)
        parts, planted, position = [], [], 0
        for i, chunk_id in enumerate(picks):
            parts.append(rng.integers(0, VOCAB, size=fillers[i], dtype=np.uint32))
            position += fillers[i]
            parts.append(stored[chunk_id])
            planted.append((int(chunk_id), position))
            position += CHUNK
        parts.append(rng.integers(0, VOCAB, size=fillers[-1], dtype=np.uint32))
        queries.append((np.concatenate(parts), planted))
    return queries


def brute_force_scan(table: dict[bytes, int], query: np.ndarray) -> list[tuple[int, int]]:
    found, seen = [], set()
    for start in range(query.size - CHUNK + 1):
        chunk_id = table.get(query[start:start + CHUNK].tobytes())
        if chunk_id is not None and chunk_id not in seen:
            seen.add(chunk_id)
            found.append((chunk_id, start))
    return found


def run(n: int, num_queries: int, reference_queries: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    n = n - n % CHUNKS_PER_SEQUENCE
    stored = rng.integers(0, VOCAB, size=(n, CHUNK), dtype=np.uint32)
    sequences = stored.reshape(-1, CHUNKS_PER_SEQUENCE * CHUNK)
    queries = make_queries(rng, stored, num_queries)

    release_free_memory()
    matcher = LocalMatcher(CHUNK)
    rss_before = rss_bytes()
    started = time.perf_counter()
    for s, tokens in enumerate(sequences):
        first = s * CHUNKS_PER_SEQUENCE
        matcher.register(tokens, range(first, first + CHUNKS_PER_SEQUENCE), position_offset=0)
    enqueued = time.perf_counter()
    matcher.flush()
    registered = time.perf_counter()
    release_free_memory()
    rss_growth = rss_bytes() - rss_before
    stats = matcher.stats()

    latencies, hits = [], 0
    for query, planted in queries:
        t0 = time.perf_counter()
        results = matcher.match(query)
        latencies.append(time.perf_counter() - t0)
        found = {(r.hash, r.cur_st) for r in results}
        hits += sum((chunk_id, position) in found for chunk_id, position in planted)

    table = {row.tobytes(): i for i, row in enumerate(stored)}
    reference_latencies, agree = [], True
    for query, _ in queries[:reference_queries]:
        t0 = time.perf_counter()
        expected = brute_force_scan(table, query)
        reference_latencies.append(time.perf_counter() - t0)
        ours = [(r.hash, r.cur_st) for r in matcher.match(query)]
        agree &= ours == expected

    return {
        "n": n,
        "recall": hits / (PLANTED * len(queries)),
        "p50": percentile_ms(latencies, 50),
        "p99": percentile_ms(latencies, 99),
        "ref_p50": percentile_ms(reference_latencies, 50),
        "agree": agree,
        "reg_rate": n / (registered - started),
        "enqueue_us": (enqueued - started) / len(sequences) * 1e6,
        "bytes_per_chunk": stats["bytes"] / n,
        "rss_per_chunk": rss_growth / n,
        "query_tokens": int(np.mean([q.size for q, _ in queries])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50_000, 200_000, 800_000])
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument("--reference-queries", type=int, default=5,
                        help="queries also answered by the brute-force scan")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    print(f"machine: {machine_description()}")
    prefault_memory(max(args.sizes) * CHUNK * 4 * 3)
    print(f"workload: {args.queries} queries of 32 stored chunks + random filler; "
          f"chunks registered as sequences of {CHUNKS_PER_SEQUENCE}")
    header = (f"{'N':>8} {'recall':>6} {'p50 ms':>7} {'p99 ms':>7} {'scan p50':>9} "
              f"{'speedup':>8} {'same':>5} {'reg chunks/s':>13} {'enqueue us':>11} "
              f"{'B/chunk':>8} {'RSS B/chunk':>12} {'LMCache p50':>12}")
    print(header)
    for n in args.sizes:
        r = run(n, args.queries, args.reference_queries, args.seed)
        lmcache = LMCACHE_P50_MS.get(r["n"])
        print(f"{r['n']:>8} {r['recall']:>6.3f} {r['p50']:>7.3f} {r['p99']:>7.3f} "
              f"{r['ref_p50']:>9.2f} {r['ref_p50'] / r['p50']:>7.0f}x {str(r['agree']):>5} "
              f"{r['reg_rate']:>13,.0f} {r['enqueue_us']:>11.1f} {r['bytes_per_chunk']:>8.0f} "
              f"{r['rss_per_chunk']:>12.0f} {f'{lmcache} ms' if lmcache else '-':>12}",
              flush=True)
    print(f"(query ~{r['query_tokens']} tokens; 'scan' is the brute-force dict scan run here; "
          "'LMCache p50' is the issue's figure for lmcache 0.5.6, not measured by this run)")


if __name__ == "__main__":
    main()
