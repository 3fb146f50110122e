"""Soak: a constant live set for minutes; does the coordinator's (or the client's) memory creep?

Run: `python -m benchmarks.soak [--duration 600] [--interval 30] [--warmup 120] ...`
(`--help` lists every knob). Everything on 127.0.0.1:

1. starts the bundled coordinator (`coordinator_stub`, blend lookup on) as a child process
   on a free port, through `benchmarks/memory_probe.py`, which can also answer diagnostic
   requests (`--diagnose`, below); `--coordinator-checkout DIR` runs another checkout's
   coordinator (an older commit in a worktree) under the same load, for before/after;
2. runs `--servers` serving processes in this process, each a `BlendPlugin` with the fleet
   leg over an `InMemoryHost` (shared L2). Each stores a fresh document (`--doc-chunks`
   chunks of 256 tokens) every 1/`--store-rate` s and evicts its oldest once it holds
   `--live-docs`, so the coordinator's live set is constant while its content keeps
   changing (new chunk hashes, new keys, new seqs, as in production);
3. at a fixed rate, meanwhile: direct `blend-lookup`s (queries of fresh text holding two
   live documents of random servers), plugin lookups (`cb_unified_lookup` polled like a
   scheduler, on a server that did not store the documents), `/healthz`, and every 5 s
   each server's heartbeat (registering on 404, as LMCache's servers do) and a scrape of
   `/metrics` and `/directory/stats`;
4. every `--interval` s prints one row: the coordinator's and this process's RSS, the
   coordinator's CPU time per second, its keys, the ops done, errors, and p50/p99 of each
   kind of request in that interval;
5. at the end: the RSS slope after `--warmup` (least squares, MB per 10 min) of both
   processes, latency of the last interval against the first after warm-up (ratio), errors,
   and the machine.

`--diagnose`: at the end of warm-up and at the end, the coordinator and this process
report what their memory is made of (`benchmarks.memory_probe.diagnosis`: RSS before and
after `malloc_trim`, anonymous vs file-backed, glibc's and pymalloc's heap figures, live
objects by type) and the change is printed; with `--tracemalloc N` the coordinator (with
`--client-tracemalloc N` this process) also traces allocations (N frames; slower) and the
growth by source line is printed. `--malloc-arena-max N` runs the coordinator with `MALLOC_ARENA_MAX=N`.
`--trim-every-sample` trims the coordinator's heap before each RSS sample, so the slope
shows memory that is held rather than memory the allocator keeps cached.

Load runs in this process (threads; the plugins' own workers), sharing the cores with the
coordinator: the figures are for a loaded box, as the output says.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import threading
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import psutil

from benchmarks import memory_probe
from benchmarks.common import machine_description
from blend_wire import (BLEND_LOOKUP_PATH, HEALTH_PATH, INSTANCES_PATH, METRICS_PATH, STATS_PATH,
                        encode, encode_tokens)
from plugin import BlendPlugin, InMemoryHost, LookupKey, PluginConfig

C = 256
MODEL = "soak-model"
VOCAB = 128_256


# --- the load ----------------------------------------------------------------------------------

@dataclass
class Interval:
    """What happened since the last sample (reset at each)."""

    latencies: dict[str, list[float]] = field(
        default_factory=lambda: collections.defaultdict(list))
    counts: collections.Counter = field(default_factory=collections.Counter)
    errors: collections.Counter = field(default_factory=collections.Counter)


class Load:
    """The servers and the request threads; `take()` hands over the current interval."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url
        self.args = args
        self.rng = np.random.default_rng(args.seed)
        self.l2: dict = {}
        # The host's request history is a test aid, not the engine's: keep it short so the
        # client's figures show the plugin (its own traces keep the last 1024 lookups).
        self.hosts = [InMemoryHost(C, shared_l2=self.l2, history=16)
                      for _ in range(args.servers)]
        self.plugins = [BlendPlugin(PluginConfig(
            coordinator_url=url, event_reporting=True, event_flush_interval=0.1,
            blend_timeout=args.budget, chunk_size=C, instance_id=f"soak-server-{i}"), host)
            for i, host in enumerate(self.hosts)]
        # Per server: its live documents, oldest first: (tokens, chunk hashes).
        self.live: list[collections.deque] = [collections.deque() for _ in self.plugins]
        self._live_lock = threading.Lock()
        self._interval = Interval()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._serial = 0

    # --- bookkeeping ---

    def _record(self, kind: str, seconds: float | None, error: str | None = None) -> None:
        with self._lock:
            self._interval.counts[kind] += 1
            if error:
                self._interval.errors[f"{kind}: {error}"] += 1
            elif seconds is not None:
                self._interval.latencies[kind].append(seconds)

    def take(self) -> Interval:
        with self._lock:
            interval, self._interval = self._interval, Interval()
        return interval

    def _tokens(self, n: int) -> np.ndarray:
        with self._live_lock:
            return self.rng.integers(1, VOCAB, n, dtype=np.uint32)

    def _pick_docs(self, count: int, not_server: int | None = None
                   ) -> tuple[list[np.ndarray], str]:
        """`count` different live documents of one tenant (stored by servers other than
        `not_server`), and that tenant's salt; ([], "") when there are not enough yet."""
        with self._live_lock:
            servers = [i for i, docs in enumerate(self.live) if docs and i != not_server]
            if not servers:
                return [], ""
            picks: list[tuple] = []
            for _ in range(20 * count):
                docs = self.live[random.choice(servers)]
                doc = docs[random.randrange(len(docs))]
                if picks and (doc[2] != picks[0][2] or any(doc is p for p in picks)):
                    continue
                picks.append(doc)
                if len(picks) == count:
                    return [p[0] for p in picks], picks[0][2]
            return [], ""

    # --- the threads ---

    def _paced(self, rate: float, step) -> None:
        period = 1.0 / rate
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                step()
            except Exception as exc:  # counted, never the end of the soak
                self._record("loop", None, f"{type(exc).__name__}: {exc}"[:120])
            next_at += period
            delay = next_at - time.monotonic()
            if delay > 0:
                self._stop.wait(delay)
            else:
                next_at = time.monotonic()  # behind: do not burst to catch up

    def _store_step(self, server: int) -> None:
        plugin, host = self.plugins[server], self.hosts[server]
        tokens = self._tokens(self.args.doc_chunks * C)
        with self._live_lock:
            self._serial += 1
            request_id = f"store-{server}-{self._serial}"
            salt = f"tenant-{self._serial % self.args.tenants}"
        key = LookupKey(request_id, tokens, MODEL, cache_salt=salt)
        started = time.perf_counter()
        hashes = host.chunk_hashes(key)
        host.store(key, hashes)
        plugin.on_store(key, hashes)
        evicted = None
        with self._live_lock:
            docs = self.live[server]
            docs.append((tokens, hashes, salt))
            if len(docs) > self.args.live_docs:
                evicted = docs.popleft()[1]
        if evicted:
            host.evict(evicted)
            plugin.on_evict(evicted)
        self._record("store+evict", time.perf_counter() - started)

    def _direct_lookup_step(self, http: httpx.Client) -> None:
        docs, salt = self._pick_docs(2)
        if not docs:
            return
        query = np.concatenate([self._tokens(37), docs[0], self._tokens(100), docs[1],
                                self._tokens(20)])
        body = encode({"tokens_b64": encode_tokens(query), "model_name": MODEL,
                       "world_size": 1, "cache_salt": salt})
        started = time.perf_counter()
        try:
            response = http.post(BLEND_LOOKUP_PATH, content=body,
                                 headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            self._record("lookup", None, type(exc).__name__)
            return
        elapsed = time.perf_counter() - started
        if response.status_code != 200:
            self._record("lookup", None, f"HTTP {response.status_code}")
            return
        self._record("lookup", elapsed)
        found = len(response.json()["matches"])
        with self._lock:
            self._interval.counts["lookup chunks found"] += found
            self._interval.counts["lookup chunks planted"] += 2 * self.args.doc_chunks

    def _plugin_lookup_step(self) -> None:
        server = random.randrange(len(self.plugins))
        docs, salt = self._pick_docs(2, not_server=server)
        if not docs:
            return
        query = np.concatenate([self._tokens(53), docs[0], self._tokens(200), docs[1]])
        with self._live_lock:
            self._serial += 1
            request_id = f"lookup-{server}-{self._serial}"
        plugin = self.plugins[server]
        key = LookupKey(request_id, query, MODEL, cache_salt=salt)
        started = time.perf_counter()
        deadline = started + 10 * self.args.budget + 5
        while (result := plugin.cb_unified_lookup(key)) is None:
            if time.perf_counter() > deadline:
                plugin.cancel(request_id)
                self._record("plugin lookup", None, "did not complete")
                return
            time.sleep(0.001)
        elapsed = time.perf_counter() - started
        status = plugin.trace(request_id).fleet_status
        if str(status) != "ok":
            self._record("plugin lookup", None, f"fleet {status}")
            return
        self._record("plugin lookup", elapsed)
        with self._lock:
            self._interval.counts["plugin chunks found"] += len(result.non_prefix_segments)
            self._interval.counts["plugin chunks planted"] += 2 * self.args.doc_chunks

    def _health_step(self, http: httpx.Client) -> None:
        started = time.perf_counter()
        try:
            response = http.get(HEALTH_PATH)
        except httpx.HTTPError as exc:
            self._record("healthz", None, type(exc).__name__)
            return
        if response.status_code != 200:
            self._record("healthz", None, f"HTTP {response.status_code}")
            return
        self._record("healthz", time.perf_counter() - started)

    def _registry_step(self, http: httpx.Client) -> None:
        # What an LMCache server does: heartbeat every 5 s, re-register on 404. Plus an
        # operator's scrape of /metrics and /directory/stats.
        for i in range(len(self.plugins)):
            started = time.perf_counter()
            response = http.put(f"{INSTANCES_PATH}/soak-server-{i}/heartbeat")
            if response.status_code == 404:
                response = http.post(INSTANCES_PATH, json={
                    "instance_id": f"soak-server-{i}", "ip": "127.0.0.1", "http_port": 8000 + i})
            if response.status_code != 200:
                self._record("heartbeat", None, f"HTTP {response.status_code}")
            else:
                self._record("heartbeat", time.perf_counter() - started)
        for path in (METRICS_PATH, STATS_PATH):
            started = time.perf_counter()
            response = http.get(path)
            if response.status_code != 200:
                self._record("scrape", None, f"{path}: HTTP {response.status_code}")
            else:
                self._record("scrape", time.perf_counter() - started)

    def start(self) -> None:
        args = self.args
        self._direct_http = httpx.Client(base_url=self.url, timeout=10.0)
        self._health_http = httpx.Client(base_url=self.url, timeout=10.0)
        self._registry_http = httpx.Client(base_url=self.url, timeout=10.0)
        work = [(args.store_rate, lambda i=i: self._store_step(i)) for i in range(args.servers)]
        work += [(args.lookup_rate, lambda: self._direct_lookup_step(self._direct_http)),
                 (args.plugin_lookup_rate, self._plugin_lookup_step),
                 (args.health_rate, lambda: self._health_step(self._health_http)),
                 (args.heartbeat_rate, lambda: self._registry_step(self._registry_http))]
        for rate, step in work:
            if rate > 0:
                thread = threading.Thread(target=self._paced, args=(rate, step), daemon=True,
                                          name="soak-load")
                thread.start()
                self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
        for plugin in self.plugins:
            plugin.close()
        self._direct_http.close()
        self._health_http.close()
        self._registry_http.close()


# --- sampling and the report ---------------------------------------------------------------------

@dataclass
class Sample:
    """One interval, reduced (its latencies to p50/p99, ms): the soak keeps every sample,
    so a sample must not hold the interval's raw figures or the client would grow."""

    t: float
    coordinator_rss: int
    client_rss: int
    keys: int
    percentiles: dict[str, tuple[float, float]]
    counts: collections.Counter
    errors: collections.Counter

    @classmethod
    def of(cls, t: float, coordinator_rss: int, client_rss: int, keys: int,
           interval: Interval) -> "Sample":
        return cls(t, coordinator_rss, client_rss, keys,
                   {kind: (_p(v, 50), _p(v, 99)) for kind, v in interval.latencies.items()},
                   interval.counts, interval.errors)


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1e3) if values else float("nan")


def _slope_mb_per_10min(samples: list[Sample], attr: str, since: float) -> tuple[float, int]:
    points = [(s.t, getattr(s, attr)) for s in samples if s.t >= since]
    if len(points) < 3:
        return float("nan"), len(points)
    t, rss = np.array(points, dtype=float).T
    slope = np.polyfit(t, rss, 1)[0]  # bytes per second
    return slope * 600 / 2**20, len(points)


def _print_row(sample: Sample, cpu_per_s: float) -> None:
    lat = " ".join(f"{kind} {p50:.1f}/{p99:.1f}"
                   for kind, (p50, p99) in sorted(sample.percentiles.items()))
    errors = sum(sample.errors.values())
    print(f"{sample.t:7.0f}s  coord {sample.coordinator_rss / 2**20:7.1f} MB  client "
          f"{sample.client_rss / 2**20:7.1f} MB  coord cpu {cpu_per_s:4.2f} s/s  keys "
          f"{sample.keys:6d}  ops {sum(v for k, v in sample.counts.items() if 'chunks' not in k):6d}"
          f"  errors {errors:3d}  p50/p99 ms: {lat}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--interval", type=float, default=30.0, help="seconds between samples")
    p.add_argument("--warmup", type=float, default=120.0,
                   help="seconds excluded from the slope (the live set fills, caches warm)")
    p.add_argument("--servers", type=int, default=4, help="serving processes (plugins)")
    p.add_argument("--live-docs", type=int, default=100, help="documents each server holds")
    p.add_argument("--tenants", type=int, default=4,
                   help="cache salts the documents are stored under, in turn")
    p.add_argument("--doc-chunks", type=int, default=4, help="chunks of 256 tokens per document")
    p.add_argument("--store-rate", type=float, default=5.0,
                   help="documents stored (and one evicted) per second per server")
    p.add_argument("--lookup-rate", type=float, default=20.0, help="direct blend-lookups/s")
    p.add_argument("--plugin-lookup-rate", type=float, default=20.0, help="plugin lookups/s")
    p.add_argument("--health-rate", type=float, default=5.0, help="/healthz per second")
    p.add_argument("--heartbeat-rate", type=float, default=0.2,
                   help="rounds per second of heartbeats (every server) and metrics scrapes")
    p.add_argument("--budget", type=float, default=0.5, help="plugin match budget, s")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--diagnose", action="store_true",
                   help="coordinator reports (objects by type, heap) at warm-up end and end")
    p.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                   help="trace the coordinator's allocations (with --diagnose)")
    p.add_argument("--client-tracemalloc", type=int, default=0, metavar="FRAMES",
                   help="trace this process's allocations too (with --diagnose; slower)")
    p.add_argument("--malloc-arena-max", type=int, default=0,
                   help="MALLOC_ARENA_MAX for the coordinator (0: glibc's default)")
    p.add_argument("--trim-every-sample", action="store_true",
                   help="malloc_trim the coordinator's heap before each RSS sample")
    p.add_argument("--coordinator-flag", action="append", default=[],
                   help="extra flag for the coordinator (repeat)")
    p.add_argument("--coordinator-checkout", metavar="DIR",
                   help="run the coordinator of another checkout (e.g. an older commit in a "
                        "worktree) under the same load: a before/after comparison")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    print(f"machine: {machine_description()}; load average at start "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} (other work may share the cores)")
    print(f"soak: {args.duration:.0f} s, {args.servers} servers x {args.live_docs} live docs "
          f"({args.tenants} tenants) x "
          f"{args.doc_chunks} chunks (live set {args.servers * args.live_docs * args.doc_chunks}"
          f" chunks), stores {args.store_rate:g}/s/server, direct lookups {args.lookup_rate:g}/s,"
          f" plugin lookups {args.plugin_lookup_rate:g}/s, healthz {args.health_rate:g}/s; "
          f"MALLOC_ARENA_MAX={args.malloc_arena_max or 'default'}"
          f"{', trim before each sample' if args.trim_every_sample else ''}"
          f"{', diagnose' if args.diagnose else ''}"
          f"{f', tracemalloc {args.tracemalloc} frames' if args.tracemalloc else ''}")
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        coordinator = memory_probe.launch(
            ["--enable-blend-lookup", "--log-level", "WARNING", *args.coordinator_flag],
            Path(tmp), checkout=args.coordinator_checkout, tracemalloc_frames=args.tracemalloc,
            malloc_arena_max=args.malloc_arena_max)
        load = None
        try:
            child = psutil.Process(coordinator.process.pid)
            me = psutil.Process()
            if args.client_tracemalloc:
                tracemalloc.start(args.client_tracemalloc)
            load = Load(coordinator.url, args)
            stats_http = httpx.Client(base_url=coordinator.url, timeout=30.0)
            load.start()
            started = time.monotonic()
            samples: list[Sample] = []
            diagnosis: list[dict] = []
            client_diagnosis: list[dict] = []
            last_cpu = sum(child.cpu_times()[:2])
            next_at = started + args.interval
            while True:
                time.sleep(max(0.0, next_at - time.monotonic()))
                now = time.monotonic() - started
                if args.trim_every_sample:
                    coordinator.trim()
                    time.sleep(0.5)
                cpu = sum(child.cpu_times()[:2])
                keys = stats_http.get(STATS_PATH).json()["num_keys"]
                sample = Sample.of(now, child.memory_info().rss, me.memory_info().rss, keys,
                                   load.take())
                samples.append(sample)
                _print_row(sample, (cpu - last_cpu) / args.interval)
                last_cpu = cpu
                if args.diagnose and not diagnosis and now >= args.warmup:
                    diagnosis.append(coordinator.diagnose())
                    client_diagnosis.append(memory_probe.diagnosis(Path(tmp) / "client-0"))
                if now >= args.duration:
                    break
                next_at += args.interval
            if args.diagnose:
                diagnosis.append(coordinator.diagnose())
                client_diagnosis.append(memory_probe.diagnosis(Path(tmp) / "client-1"))
            stats_http.close()
        finally:
            if load is not None:
                load.stop()
            code = coordinator.stop()
        summarize(samples, args, code)
        if len(diagnosis) == 2:
            memory_probe.report_diagnosis("coordinator", *diagnosis)
            memory_probe.report_diagnosis("client (this process: the plugins and the load)",
                                          *client_diagnosis)
    return 0


def summarize(samples: list[Sample], args: argparse.Namespace, code: int) -> None:
    after = [s for s in samples if s.t >= args.warmup]
    coord, n = _slope_mb_per_10min(samples, "coordinator_rss", args.warmup)
    client, _ = _slope_mb_per_10min(samples, "client_rss", args.warmup)
    print(f"\nRSS slope after {args.warmup:.0f} s warm-up ({n} samples): coordinator "
          f"{coord:+.1f} MB/10 min, client {client:+.1f} MB/10 min")
    if after:
        first, last = after[0], after[-1]
        print(f"RSS: coordinator {first.coordinator_rss / 2**20:.1f} -> "
              f"{last.coordinator_rss / 2**20:.1f} MB (x{last.coordinator_rss / first.coordinator_rss:.3f}),"
              f" client {first.client_rss / 2**20:.1f} -> {last.client_rss / 2**20:.1f} MB "
              f"(x{last.client_rss / first.client_rss:.3f}); keys {first.keys} -> {last.keys}")
        for kind in sorted(set(first.percentiles) & set(last.percentiles)):
            (a50, a99), (b50, b99) = first.percentiles[kind], last.percentiles[kind]
            print(f"{kind:14s} p50 {a50:6.2f} -> {b50:6.2f} ms (x{b50 / a50:.2f}), p99 "
                  f"{a99:6.2f} -> {b99:6.2f} ms (x{b99 / a99:.2f}), first interval after "
                  "warm-up -> last")
    totals: collections.Counter = collections.Counter()
    errors: collections.Counter = collections.Counter()
    for s in samples:
        totals.update(s.counts)
        errors.update(s.errors)
    for source in ("lookup", "plugin"):
        planted = totals[f"{source} chunks planted"]
        if planted:
            print(f"{source} recall: {totals[f'{source} chunks found']}/{planted} planted chunks "
                  "found (a document evicted between pick and query is a miss)")
    print(f"ops: {dict((k, v) for k, v in totals.items() if 'chunks' not in k)}")
    print(f"errors: {sum(errors.values())}" + (f" {dict(errors)}" if errors else ""))
    print(f"coordinator exit code {code}")


if __name__ == "__main__":
    sys.exit(main())
