"""The blend-lookup reply forms at two chunk sizes side by side: `make bench-lookup-forms`.

    python -m benchmarks.bench_lookup_forms [--chunk-sizes 256,32] [--queries N] [--rounds R]

One coordinator process per chunk size, both up at once, each holding MuSiQue workload B's
stores at its size (`benchmarks.bench_rag.workload_b`: every prompt stored on one of 4
servers through the plugin's reporter, so chunks have L1 holders). Then `--rounds` rounds;
in each, every size and every form (LMCache's default, the candidates as objects, as
columns) gets one pass over the queries (`benchmarks.lookup_forms.price_forms`), so that a
drift of a shared machine touches every figure alike and a ratio between sizes compares
the same minutes. Per form and size: reply bytes per chunk offered and per query chunk
found (also at LMCache's 32-byte hashes), the coordinator process's CPU per lookup, and this
process's CPU to read a reply as the plugin does and select from it; then the ratios of the
smallest size to the largest.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from benchmarks.bench_granularity import store_all
from benchmarks.bench_rag import INSTANCES, chunk_sizes, load_musique, workload_b
from benchmarks.bench_unified_lookup import MODEL
from benchmarks.common import machine_description
from benchmarks.lookup_forms import FORMS, forms_table, price_forms
from benchmarks.musique_data import MUSIQUE_DATA_DIR
from blend_wire import encode_tokens
from coordinator_stub.launch.process import start_coordinator
from plugin import InMemoryHost, LookupKey
from plugin.http import coordinator_http


def loaded_coordinator(work, chunk: int):
    """A coordinator process at `chunk` holding `work`'s stores, every chunk indexed."""
    coordinator = start_coordinator("--enable-blend-lookup", "--chunk-size", str(chunk),
                                    "--log-level", "WARNING", stderr=subprocess.DEVNULL)
    host = InMemoryHost(chunk)
    stores = [(s, t) for s, t in work.stores if len(t) >= chunk]
    hashes = [host.chunk_hashes(LookupKey(f"h{i}", t, MODEL)) for i, (_, t) in enumerate(stores)]
    store_all(coordinator.url, stores, hashes, chunk, f"forms-{chunk}")
    http = coordinator_http(coordinator.url, timeout=30.0)
    chunks = len({h for key_hashes in hashes for h in key_hashes})
    deadline = time.monotonic() + 60
    while http.get("/directory/stats").json()["blend"]["num_chunks"] < chunks:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the coordinator at chunk {chunk} did not index every chunk")
        time.sleep(0.05)
    return coordinator, http


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_lookup_forms",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-sizes", type=chunk_sizes, default=[256, 32],
                        help="comma-separated, largest first (default: 256,32)")
    parser.add_argument("--queries", type=int, default=150,
                        help="the first N MuSiQue questions (default: all 150)")
    parser.add_argument("--rounds", type=int, default=8, help="passes per size and form")
    args = parser.parse_args(argv)
    system, questions = load_musique(MUSIQUE_DATA_DIR)
    work = workload_b(system, questions[:args.queries], seed=0)
    print(f"machine: {machine_description()}; load average {os.getloadavg()[0]:.2f} at start")
    started = {chunk: loaded_coordinator(work, chunk) for chunk in args.chunk_sizes}
    queries = [tokens for _, tokens in work.queries]
    bodies = [{"tokens_b64": encode_tokens(t), "model_name": MODEL, "world_size": 1,
               "cache_salt": ""} for t in queries]
    prices = {chunk: {form: None for form in FORMS} for chunk in args.chunk_sizes}
    loads = [os.getloadavg()[0]]
    try:
        for _ in range(args.rounds):
            for chunk, (coordinator, http) in started.items():
                ids = [f"forms-{chunk}-{server % INSTANCES}" for server, _ in work.queries]
                got = price_forms(http, coordinator.process.pid, queries, bodies, chunk, ids, 1)
                for form, price in got.items():
                    prices[chunk][form] = price if prices[chunk][form] is None else \
                        prices[chunk][form].plus(price)
            loads.append(os.getloadavg()[0])
    finally:
        for coordinator, http in started.values():
            http.close()
            coordinator.stop()
    print(f"\n{len(queries)} queries of workload B, {args.rounds} rounds; load average "
          f"{min(loads):.2f}-{max(loads):.2f}\n")
    print("\n".join(forms_table([("B", chunk, prices[chunk]) for chunk in args.chunk_sizes])))
    large, small = args.chunk_sizes[0], args.chunk_sizes[-1]
    print(f"\nchunk {small} / chunk {large}, same form, same run:")
    for form in FORMS:
        a, b = prices[large][form], prices[small][form]
        ratio = lambda x, y: f"{x / y:.2f}x" if y else "not measured"  # noqa: E731
        print(f"- {form}: coordinator CPU {ratio(b.coordinator_ms, a.coordinator_ms)}, "
              f"plugin read + select {ratio(b.plugin_ms, a.plugin_ms)}, reply bytes "
              f"{ratio(b.reply_bytes, a.reply_bytes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
