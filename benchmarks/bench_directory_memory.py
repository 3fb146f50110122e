"""What one stored chunk costs the coordinator's memory, by structure, at each chunk size.

The common shape: one instance stores N chunks of distinct text, one key and one placement
each, in one namespace, through `KeyDirectory.ingest` in process (blend lookup on). The
Python allocations the ingest leaves behind (tracemalloc, numpy's arrays included) are
grouped by the structure that holds them, per chunk and per token:

- tokens: the content store's token rows (what verification needs; they stay);
- content index: the content store's hash table, filter and per-content columns;
- claims: the index's claim columns, and its chunk hashes (a row per claim and a table of
  slots: `local_matcher.chunk_hashes`);
- directory: the binding table (its columns, for the common binding, and its dict entry
  and tuple per chunk for the others), the chunks each instance holds (a set entry per
  chunk), the chunk-hash bytes objects, the digests.

So it shows where the bytes per stored token go, and which part is a floor of the design
(issue 30 asked for <= 8 B per token at chunk 32 and <= 5.5 at chunk 256). RSS growth of a
real coordinator process is `make bench-granularity`'s figure; this one is exact and
attributable, but leaves out allocator slack.

    python -m benchmarks.bench_directory_memory [--chunks 50000] [--chunk-sizes 256 64 32]
"""

from __future__ import annotations

import argparse
import gc
import json
import linecache
import os
import subprocess
import sys
import tracemalloc

import numpy as np

from benchmarks.common import machine_description

#: (file suffix, words in the allocating line, group); the first that fits wins.
_GROUPS = (
    ("local_matcher/store.py", "np.empty((kernels.BLOCK_ROWS", "tokens"),
    ("local_matcher/store.py", "", "content index: table, filter, columns"),
    ("local_matcher/chunk_hashes.py", "", "claims: chunk-hash columns (rows, table)"),
    ("local_matcher/claims.py", "", "claims: columns"),
    ("coordinator_stub/directory/journal.py", "set.", "directory: chunks held per instance"),
    ("coordinator_stub/directory/journal.py", "", "directory: binding table (dict + tuple)"),
    ("coordinator_stub/directory/binding_table.py", "", "directory: binding table (columns)"),
    ("coordinator_stub/directory/new_chunks.py", "digest", "directory: content digests"),
    ("coordinator_stub/directory/new_chunks.py", "", "directory: chunk-hash bytes"),
)


def _group(filename: str, lineno: int) -> str:
    line = linecache.getline(filename, lineno)
    for suffix, words, group in _GROUPS:
        if filename.endswith(suffix) and words in line:
            return group
    return "other: " + filename.rsplit("/", 2)[-1]


def measure(chunk_size: int, chunks: int, batch: int = 500) -> dict[str, float]:
    """Bytes per stored chunk by group (in this process)."""
    from blend_wire import CacheEventBatch, EventsRequest, decode, encode
    from coordinator_stub.directory import KeyDirectory

    directory = KeyDirectory(chunk_size=chunk_size, enable_blend_lookup=True)
    rng = np.random.default_rng(chunk_size)

    def body(seq: int, count: int) -> bytes:
        # Offsets as in prompts of up to 32 chunks: most are Python ints of their own.
        entries = [{"key": {"chunk_hash_hex": os.urandom(32).hex(), "model_name": "m",
                            "kv_rank": 0},
                    "token_ids": rng.integers(0, 128_000, chunk_size).tolist(),
                    "token_offset": (i % 32) * chunk_size} for i in range(count)]
        return encode({"batches": [{"instance_id": "i0", "seq": seq, "event_type": "store",
                                    "tier": "l1", "backend": "dram", "entries": entries}]})

    def batches(encoded: bytes) -> list[CacheEventBatch]:
        return decode(encoded, EventsRequest).batches

    directory.ingest(batches(body(1, batch)))  # kernels loaded, first blocks made
    bodies = [body(2 + k, batch) for k in range(chunks // batch)]
    gc.collect()
    tracemalloc.start(1)
    before = tracemalloc.take_snapshot()
    for encoded in bodies:  # decoded here: what the directory keeps of it is counted
        directory.ingest(batches(encoded))
    del bodies
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    stored = (chunks // batch) * batch
    groups: dict[str, float] = {}
    for stat in after.compare_to(before, "lineno"):
        frame = stat.traceback[0]
        group = _group(frame.filename, frame.lineno)
        groups[group] = groups.get(group, 0.0) + stat.size_diff / stored
    return groups


def _report(chunk_size: int, groups: dict[str, float]) -> None:
    total = sum(groups.values())
    print(f"\nchunk {chunk_size}: {total:.0f} B per stored chunk = "
          f"{total / chunk_size:.2f} B per stored token")
    for group, size in sorted(groups.items(), key=lambda item: -item[1]):
        if abs(size) >= 0.5:
            print(f"  {size:7.1f} B/chunk  {size / chunk_size:6.2f} B/token  {group}")
    floor = sum(size for group, size in groups.items()
                if group == "tokens" or group.startswith(("content index", "claims: "))
                or group.endswith("(columns)"))
    print(f"  tokens + the content index's, claims' and bindings' columns (no Python "
          f"object per chunk): {floor / chunk_size:.2f} B/token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=50_000)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[256, 64, 32])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child's chunk size
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.chunks)))
        return
    print(machine_description())
    print(f"{args.chunks} chunks of distinct text, one instance, one key each, in process "
          "(tracemalloc: Python and numpy allocations left by the ingest)")
    for chunk_size in args.chunk_sizes:  # each in a fresh process: nothing shared
        out = subprocess.run([sys.executable, "-m", "benchmarks.bench_directory_memory",
                              "--one", str(chunk_size), "--chunks", str(args.chunks)],
                             check=True, capture_output=True, text=True).stdout
        _report(chunk_size, json.loads(out.strip().splitlines()[-1]))


if __name__ == "__main__":
    main()
