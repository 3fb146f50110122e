"""Memory of the bundled coordinator through a burst of large `/events` bodies.

Run: `python -m benchmarks.bench_memory_burst [--threads 8] [--posts 2] [--rounds 3]`
(`make bench-memory`). Starts the coordinator (blend lookup on) through
`benchmarks/memory_probe.py`, posts one ~30 MiB body of STORE entries, then per round
`--threads` clients post it `--posts` times each at once (duplicates: validated in full
every time, nothing new stored, so the live set stays the first body's). Prints the RSS
settled before the round, its peak during it (sampled every 20 ms) and after it (once it
stops falling, up to `--settle` s), each change as a ratio of the bytes the coordinator
lets be in flight (`--max-ingest-bytes`, the bound on request bodies it buffers), what
live objects hold after a garbage collection and `malloc_trim` (`memory_probe`), and the
machine. A burst's peak is bounded by what is in flight, and what it took comes back
after it (`coordinator_stub/writes/local.py`, "Memory"). This was a test's RSS threshold, which
flaked under load.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

from benchmarks import memory_probe
from benchmarks.common import machine_description
from blend_wire import EVENTS_PATH, encode, pack_kv_rank

MIB = 1 << 20


def burst_body(batches: int, entries: int, chunk: int, seed: int = 11) -> bytes:
    """One `/events` body: `batches` STORE batches of `entries` chunks of `chunk` tokens."""
    rng = np.random.default_rng(seed)

    def entry(i: int) -> dict:
        key = {"chunk_hash_hex": rng.bytes(16).hex(), "model_name": "m",
               "kv_rank": pack_kv_rank(1, 0), "object_group_id": 0, "cache_salt": ""}
        return {"key": key, "size_bytes": 64, "token_offset": i * chunk,
                "token_ids": rng.integers(0, 2**31, chunk).tolist()}

    return encode({"batches": [
        {"instance_id": "burst", "incarnation": 0, "seq": 1 + b, "event_type": "store",
         "tier": "l1", "backend": "dram", "shared": False,
         "entries": [entry(i) for i in range(entries)]} for b in range(batches)]})


def one_round(url: str, process: psutil.Process, body: bytes, args) -> dict:
    settled = process.memory_info().rss
    peak = settled
    statuses: list[int] = []

    def send() -> None:
        with httpx.Client(base_url=url, timeout=300) as http:
            for _ in range(args.posts):
                statuses.append(http.post(EVENTS_PATH, content=body).status_code)

    threads = [threading.Thread(target=send) for _ in range(args.threads)]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        peak = max(peak, process.memory_info().rss)
        time.sleep(0.02)
    for thread in threads:
        thread.join()
    # Given back once the last bodies are freed, which can take a while after the last
    # reply on a loaded machine: wait until the RSS stops falling.
    after, deadline = process.memory_info().rss, time.monotonic() + args.settle
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = process.memory_info().rss
        if now >= after:
            break
        after = now
    return {"settled": settled, "peak": peak, "after": after,
            "accepted": statuses.count(200), "deferred": statuses.count(503),
            "other": len(statuses) - statuses.count(200) - statuses.count(503)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=8, help="clients posting at once")
    parser.add_argument("--posts", type=int, default=2, help="posts per client per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=16, help="batches in the body")
    parser.add_argument("--entries", type=int, default=700, help="entries per batch")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per entry")
    parser.add_argument("--max-ingest-bytes", type=int, default=128 * MIB,
                        help="the coordinator's bound on request bytes in flight")
    parser.add_argument("--settle", type=float, default=30.0,
                        help="longest wait, in s, for the RSS to stop falling after a round")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    body = burst_body(args.batches, args.entries, args.chunk)
    cap = args.max_ingest_bytes
    print(f"machine: {machine_description()}")
    print(f"body: {len(body) / MIB:.1f} MiB ({args.batches} x {args.entries} entries of "
          f"{args.chunk} tokens); per round {args.threads} clients x {args.posts} posts; "
          f"in-flight bound {cap / MIB:.0f} MiB")
    with tempfile.TemporaryDirectory() as diag_dir:
        coordinator = memory_probe.launch(
            ["--enable-blend-lookup", "--max-ingest-bytes", str(cap)], Path(diag_dir))
        try:
            process = psutil.Process(coordinator.process.pid)
            with httpx.Client(base_url=coordinator.url, timeout=300) as http:
                first = http.post(EVENTS_PATH, content=body)
                assert first.json()["applied"] == args.batches, first.text
            print(f"\n{'round':>5} {'settled MiB':>11} {'peak MiB':>9} {'after MiB':>9} "
                  f"{'peak-settled/bound':>18} {'after-settled/bound':>19}  posts 200/503/other")
            for number in range(1, args.rounds + 1):
                r = one_round(coordinator.url, process, body, args)
                print(f"{number:5d} {r['settled'] / MIB:11.0f} {r['peak'] / MIB:9.0f} "
                      f"{r['after'] / MIB:9.0f} {(r['peak'] - r['settled']) / cap:18.2f} "
                      f"{(r['after'] - r['settled']) / cap:19.2f}  "
                      f"{r['accepted']}/{r['deferred']}/{r['other']}")
            report = coordinator.diagnose()
            print(f"\nafter the rounds: RSS {report['rss'] / MIB:.0f} MiB, "
                  f"{report['rss_after_trim'] / MIB:.0f} MiB after malloc_trim; live objects "
                  f"hold {memory_probe.held_bytes(report) / MIB:.0f} MiB")
        finally:
            coordinator.stop()


if __name__ == "__main__":
    main()
