"""Claims on one chunk: cost per claim and per change, as the number of claims grows.

One chunk hash stored in n namespaces (one STORE with the same tokens and offset each, in
batches of 100, through `KeyDirectory.ingest` in-process), then one namespace's STORE at
another offset (its first change), then alternating content and offset changes. Printed per mode (content
per namespace, the default; `--trust-shared-hashes`, LMCache's rules, where a change moves
every claim): microseconds per claim and milliseconds per change at each n, and the ratio of
the large n to the small one measured in the same run (per claim: 1.0 is O(1) per claim; per
change under trust: n_large / n_small is O(claims)). Before issue 19, every claim rewrote
the offset of all the chunk's claims: 8,000 claims made one content change take seconds.

    python -m benchmarks.bench_claims [--small 500] [--large 8000] [--chunk-size 256]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import machine_description
from blend_wire import CacheEventBatch, CacheEventEntry, EncodedObjectKey, pack_kv_rank
from coordinator_stub.directory import KeyDirectory

BATCH = 100


def _entry(salt: str, tokens: np.ndarray, offset: int) -> CacheEventEntry:
    key = EncodedObjectKey(chunk_hash_hex="aa01", model_name="m", kv_rank=pack_kv_rank(1),
                           cache_salt=salt)
    return CacheEventEntry(key=key, token_ids=tokens, token_offset=offset, size_bytes=64)


def _ingest(directory: KeyDirectory, seq: int, entries: list[CacheEventEntry]) -> float:
    batch = CacheEventBatch(instance_id="i0", incarnation=0, seq=seq, event_type="store",
                            tier="l1", backend="dram", entries=entries)
    start = time.perf_counter()
    assert directory.ingest([batch]).applied == 1
    return time.perf_counter() - start


def measure(n: int, chunk_size: int, trust: bool, repeats: int = 5) -> dict[str, float]:
    """Figures of one fresh directory; each change repeated `repeats` times (alternating
    offsets or contents), its fastest kept: shared cores make single timings noisy."""
    directory = KeyDirectory(chunk_size=chunk_size, enable_blend_lookup=True,
                             trust_shared_hashes=trust)
    tokens = np.arange(chunk_size, dtype=np.uint32)
    claiming, seq = 0.0, 0
    for first in range(0, n, BATCH):
        seq += 1
        claiming += _ingest(directory, seq, [_entry(f"s{i}", tokens, 0)
                                             for i in range(first, min(n, first + BATCH))])
    assert directory.stats()["blend"]["num_claims"] == n
    # The first change parts namespace s0 from the others (content per namespace: once,
    # O(claims)); the repeated ones are what a namespace's later reports cost.
    first_move = _ingest(directory, seq + 1, [_entry("s0", tokens, 4 * chunk_size)])
    seq += 1
    moves, changes = [], []
    for i in range(repeats):
        seq += 1
        changes.append(_ingest(directory, seq, [_entry("s0", tokens + 1 + i % 2,
                                                       4 * chunk_size)]))
        seq += 1
        moves.append(_ingest(directory, seq, [_entry("s0", tokens + 1 + i % 2,
                                                     (8 + i % 2) * chunk_size)]))
    return {"us_per_claim": claiming / n * 1e6, "first_move_ms": first_move * 1e3,
            "content_ms": min(changes) * 1e3, "offset_ms": min(moves) * 1e3}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=500)
    parser.add_argument("--large", type=int, default=8000)
    parser.add_argument("--chunk-size", type=int, default=256)
    args = parser.parse_args(argv)
    print(f"machine: {machine_description()}")
    print(f"one chunk claimed by n namespaces (batches of {BATCH}), chunk size "
          f"{args.chunk_size}; then one namespace's first change (offset), then its content "
          "and offset changes (fastest of 5; fastest of 3 directories)")
    for trust in (False, True):
        mode = "--trust-shared-hashes" if trust else "content per namespace"
        runs = {n: [measure(n, args.chunk_size, trust) for _ in range(3)]
                for n in (args.small, args.large)}
        best = {n: {k: min(r[k] for r in results) for k in results[0]}
                for n, results in runs.items()}
        for n, figures in best.items():
            print(f"  {mode:22} n={n:>6,}: {figures['us_per_claim']:7.1f} us/claim; first "
                  f"change {figures['first_move_ms']:8.2f} ms; then content "
                  f"{figures['content_ms']:8.2f} ms, offset {figures['offset_ms']:8.2f} ms")
        small, large = best[args.small], best[args.large]
        print(f"  {mode:22} ratio n={args.large:,} / n={args.small:,} "
              f"({args.large / args.small:.0f}x the claims): per claim "
              f"{large['us_per_claim'] / small['us_per_claim']:.2f}x, content change "
              f"{large['content_ms'] / small['content_ms']:.1f}x, offset change "
              f"{large['offset_ms'] / small['offset_ms']:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
