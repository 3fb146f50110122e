"""What a lookup's match costs when the lookups before it were not just now.

    python -m benchmarks.bench_cold_match [--chunks 200000] [--queries 200] [--gaps-ms 0.2 1 5]

The coordinator's index shape of `bench_coordinator` (N random chunks of 256 tokens, one
namespace; queries of 8,000 tokens holding 16 stored chunks), in process. Each query is
matched (`ContentIndex.match`) and its thread's CPU time read, first back to back, then
with a gap before each: the thread sleeping, or spinning (busy, touching almost no
memory), or reading 16 MiB elsewhere (a cache flush by this process's own hand).

On the shared 2-core VM this project is measured on, CPU per match grows with the time
since the last one even when the thread spins meanwhile: what the index's memory left in
the caches is gone after a few milliseconds, whoever runs. A coordinator that serves
lookups one at a time (paced, or behind a slow client) pays that on every lookup, one that
is busy does not (docs/BENCHMARKS.md, "make bench-coordinator", and this module's
section).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks.common import machine_description
from local_matcher.index import ContentIndex

CHUNK = 256
QUERY_TOKENS = 8000
PLANTED = 16
VOCAB = 50_000
_BATCH = 10_000


def built_index(chunks: int, seed: int) -> tuple[ContentIndex, np.ndarray]:
    """An index of `chunks` random chunks, and the first 64 of them (to plant)."""
    rng = np.random.default_rng(seed)
    index = ContentIndex(CHUNK)
    kept = None
    for start in range(0, chunks, _BATCH):
        rows = rng.integers(0, VOCAB, (min(_BATCH, chunks - start), CHUNK), dtype=np.uint32)
        index.add_many(rows, [b"%d" % (start + i) for i in range(len(rows))],
                       [0] * len(rows), "ns")
        kept = rows[:64].copy() if kept is None else kept
    return index, kept


def queries_holding(kept: np.ndarray, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    queries = []
    spacing = QUERY_TOKENS // PLANTED
    for _ in range(count):
        query = rng.integers(0, VOCAB, QUERY_TOKENS, dtype=np.uint32)
        for k, row in enumerate(rng.choice(len(kept), PLANTED, replace=False)):
            query[k * spacing:k * spacing + CHUNK] = kept[row]
        queries.append(query)
    return queries


def cpu_per_match_us(index: ContentIndex, queries: list[np.ndarray], before) -> float:
    """Mean thread CPU of one match, `before()` run ahead of each (not timed)."""
    spent = 0.0
    for query in queries:
        before()
        started = time.thread_time()
        if len(index.match(query, "ns")) < PLANTED:
            raise RuntimeError("a planted chunk was not found")
        spent += time.thread_time() - started
    return spent / len(queries) * 1e6


def summing_us(array: np.ndarray, before, rounds: int = 200) -> float:
    """Mean thread CPU to sum the first 128 KiB of `array`, `before()` ahead of each."""
    words = array.view(np.uint64)[:1 << 14]
    spent = 0.0
    for _ in range(rounds):
        before()
        started = time.thread_time()
        words.sum()
        spent += time.thread_time() - started
    return spent / rounds * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_cold_match",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=200_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--gaps-ms", type=float, nargs="+", default=[0.2, 1.0, 5.0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"machine: {machine_description()}; load average {os.getloadavg()[0]:.2f} at start")
    index, kept = built_index(args.chunks, args.seed)
    queries = queries_holding(kept, args.queries, args.seed)
    cpu_per_match_us(index, queries[:10], lambda: None)  # compiled, warmed
    elsewhere = np.ones(16 << 20, dtype=np.uint8)

    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def flush() -> None:
        elsewhere[::64] += 1  # one write per cache line

    hot = cpu_per_match_us(index, queries, lambda: None)
    print(f"\n{args.chunks:,} chunks of {CHUNK} tokens; {len(queries)} queries of "
          f"{QUERY_TOKENS} tokens holding {PLANTED} stored chunks; thread CPU per match\n")
    print("| before each match | us | x back to back |")
    print("| --- | --- | --- |")
    print(f"| nothing (back to back) | {hot:.0f} | 1.00 |")
    rows = [("16 MiB read elsewhere", flush)]
    for gap in args.gaps_ms:
        rows += [(f"sleep {gap:g} ms", lambda g=gap: time.sleep(g / 1e3)),
                 (f"spin {gap:g} ms", lambda g=gap: spin(g / 1e3))]
    for name, before in rows:
        cost = cpu_per_match_us(index, queries, before)
        print(f"| {name} | {cost:.0f} | {cost / hot:.2f} |")
    # For scale, no code of ours: summing 128 KiB (sequential, hardware-prefetched).
    gap = max(args.gaps_ms) / 1e3
    warm, cold = summing_us(elsewhere, lambda: None), summing_us(elsewhere, lambda: spin(gap))
    print(f"\nsumming 128 KiB of an array: {warm:.1f} us back to back, {cold:.1f} us after "
          f"spinning {gap * 1e3:g} ms ({cold / warm:.1f}x)")
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
