"""Reuse against chunk size, and the whole price of each size: `make bench-granularity`.

    python -m benchmarks.bench_granularity [--chunk-sizes 256,128,64,32,16] [--queries N]
        [--lmcache-prompts N] [--plot PATH | --no-plot] [--quick]

Operators set the chunk size (`--chunk-size`, a multiple of the engine's block size). Smaller
chunks reuse more of a RAG prompt (a passage shorter than a chunk, or a chunk straddling a
passage seam, is never reused), and cost more per stored token and per lookup. At each size
this prints one Markdown table row (docs/OPERATIONS.md, "Choosing a chunk size") and plots it:

- reuse on MuSiQue A and B (`benchmarks.bench_rag`: its workloads, its `run_one` with the
  bundled coordinator as a child process and 4 servers sharing one L2): ours unified, the
  each-chunk-once oracle, the fleet leg alone, and the token ceiling (the prefix coverage
  plus every token stored text holds at any alignment: no chunk size reuses more);
- plugin and coordinator CPU per unified lookup (`run_one`'s pass of lookups alone: this
  process, and the coordinator process from psutil), on A and B;
- the price of storing, on workload B's stores (every prompt once, 4 servers), against a
  fresh coordinator process: its RSS growth and CPU per stored token (ingest) once every
  chunk is indexed, the serving process's store path per stored token (this process's CPU
  over `on_store`, the reporter's flushes and the local matcher's indexing, as
  `benchmarks.bench_store_path` measures it), and the `POST /events` bytes per stored token
  (heads included: counted by a loopback relay in a second pass, so it costs the first
  pass nothing);
- LMCache 0.5.6's own server at that chunk size (the real process, our plugin loaded through
  `--server-module`, started by `plugin.harness`): its CPU per stored token over the first
  `--lmcache-prompts` prompts of B stored, then per lookup of their reordered prompts (our
  `cb_unified_lookup` polled as an engine does), net of its idle CPU rate.

The default run takes a few minutes on 2 cores; `--quick` (a smoke test: two sizes, a few
queries, no LMCache server, no plot) seconds. Figures on shared cores are noisy: the load
average is printed beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

from benchmarks.bench_rag import (INSTANCES, Run, Workload, chunk_sizes, load_musique, run_one,
                                  workload_a, workload_b)
from benchmarks.bench_unified_lookup import MODEL
from benchmarks.common import cpu_seconds, machine_description
from benchmarks.lookup_forms import forms_table
from benchmarks.musique_data import DATA_FILE, MUSIQUE_DATA_DIR
from coordinator_stub.launch.process import start_coordinator
from plugin import BlendPlugin, InMemoryHost, LookupKey, PluginConfig
from plugin.http import coordinator_http

SIZES = [256, 128, 64, 32, 16]
PLOT = Path(__file__).resolve().parents[1] / "docs" / "chunk-size.png"
FLUSH_EVERY = 8  # stores per flush in the store pass (~46k tokens of B per POST)


# --- the price of storing ---------------------------------------------------------------------


class CountingRelay:
    """A loopback TCP relay to `port` that counts the bytes clients send through it."""

    def __init__(self, port: int) -> None:
        self.port, self.sent = port, 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._relay, "127.0.0.1", 0), self._loop).result()
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)

        async def pipe(source, sink, counted: bool) -> None:
            try:
                while data := await source.read(1 << 16):
                    self.sent += len(data) if counted else 0
                    sink.write(data)
                    await sink.drain()
            finally:
                sink.close()

        try:
            await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False),
                                 return_exceptions=True)
        except asyncio.CancelledError:  # closed: the relay ends here, quietly
            pass

    def close(self) -> None:
        async def shut() -> None:
            self._server.close()
            relays = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in relays:
                task.cancel()
            await asyncio.gather(*relays, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        self._loop.close()


@dataclass
class StorePrice:
    stored_tokens: int = 0
    coordinator_bytes: float = 0.0  # coordinator RSS growth per stored token
    ingest_us: float = 0.0           # coordinator CPU per stored token
    store_path_us: float = 0.0       # this process: on_store + reporter + local matcher
    event_bytes: float = 0.0         # POST /events bytes (heads included) per stored token


def store_all(url: str, stores: list, hashes: list, chunk: int, tag: str) -> None:
    """Each server's plugin is told of its stores, the reporter flushing every FLUSH_EVERY
    stores; closing the plugins delivers the rest and drains the local matchers."""
    plugins = [BlendPlugin(PluginConfig(instance_id=f"{tag}-{k}", coordinator_url=url,
                                        event_reporting=True, chunk_size=chunk,
                                        event_flush_interval=3600.0), InMemoryHost(chunk))
               for k in range(INSTANCES)]
    for i, ((server, tokens), key_hashes) in enumerate(zip(stores, hashes)):
        plugins[server].on_store(LookupKey(f"{tag}-{i}", tokens, MODEL), key_hashes, 0)
        if (i + 1) % FLUSH_EVERY == 0:
            plugins[server].flush()
    for plugin in plugins:
        plugin.close()
        if plugin.reporter.stats().pending:
            raise RuntimeError("the reporter could not deliver every event")


def store_price(work: Workload, chunk: int) -> StorePrice:
    """What storing `work`'s sequences costs the coordinator and the serving process."""
    host = InMemoryHost(chunk)
    stores = [(s, t) for s, t in work.stores if len(t) >= chunk]
    hashes = [host.chunk_hashes(LookupKey(f"h{i}", t, MODEL)) for i, (_, t) in enumerate(stores)]
    chunks = len({h for key_hashes in hashes for h in key_hashes})  # the system's are shared
    price = StorePrice(stored_tokens=chunks * chunk)
    coordinator = start_coordinator("--enable-blend-lookup", "--chunk-size", str(chunk),
                                    "--log-level", "WARNING", stderr=subprocess.DEVNULL)
    http = coordinator_http(coordinator.url, timeout=30.0)
    process = psutil.Process(coordinator.process.pid)
    indexed = lambda: http.get("/directory/stats").json()["blend"]["num_chunks"]  # noqa: E731
    try:
        # Warm-up on both sides (numba kernels compile on first use, the coordinator's too):
        # a store of fresh random text, before anything is counted.
        warm = np.random.default_rng(chunk).integers(0, 100_000, 8 * chunk, dtype=np.uint32)
        store_all(coordinator.url, [(0, warm)], [host.chunk_hashes(LookupKey("w", warm, MODEL))],
                  chunk, f"warm-{chunk}")
        before = indexed()
        rss, cpu = process.memory_info().rss, cpu_seconds(process.pid)
        started = time.process_time()
        store_all(coordinator.url, stores, hashes, chunk, f"price-{chunk}")
        price.store_path_us = (time.process_time() - started) / price.stored_tokens * 1e6
        deadline = time.monotonic() + 60
        while indexed() < before + chunks and time.monotonic() < deadline:
            time.sleep(0.05)
        if indexed() != before + chunks:
            raise RuntimeError(f"the coordinator indexed {indexed() - before} of {chunks} chunks")
        price.ingest_us = (cpu_seconds(process.pid) - cpu) / price.stored_tokens * 1e6
        # Its RSS as an operator reads it after a store: once a burst is over, the
        # coordinator hands back what its bodies used, off its loop (http/budget.py).
        time.sleep(0.25)
        price.coordinator_bytes = (process.memory_info().rss - rss) / price.stored_tokens
        relay = CountingRelay(coordinator.port)
        try:  # the same stores again from other instances, through the relay
            store_all(relay.url, stores, hashes, chunk, f"bytes-{chunk}")
        finally:
            relay.close()
        price.event_bytes = relay.sent / price.stored_tokens
    finally:
        http.close()
        coordinator.stop()
    return price


# --- LMCache's own server at this chunk size ------------------------------------------------


@dataclass
class ServerPrice:
    store_us: float = float("nan")   # server CPU per stored token
    lookup_ms: float = float("nan")  # server CPU per unified lookup
    idle_pct: float = float("nan")   # its idle CPU rate, subtracted from both


def server_cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system + sum(
        sum(child.cpu_times()[:2]) for child in process.children(recursive=True))


def lmcache_server_price(work: Workload, chunk: int, prompts: int, workdir: str) -> ServerPrice:
    """LMCache 0.5.6's server (our plugin loaded) storing the first `prompts` stores of
    `work`, then looking up as many of its queries: its CPU per stored token, per lookup."""
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # its engine client logs INFO
    from plugin.harness.lmcache_process import ServerFleet

    coordinator = start_coordinator("--enable-blend-lookup", "--chunk-size", str(chunk),
                                    "--log-level", "WARNING", stderr=subprocess.DEVNULL)
    # The server logs at INFO: the harness waits for its "initialized" line.
    fleet = ServerFleet(coordinator_url=coordinator.url, log_dir=workdir, chunk_size=chunk,
                        l1_size_gb=1.0, env={"LMCACHE_LOG_LEVEL": "INFO"})
    price = ServerPrice()
    try:
        client = fleet.start(f"c{chunk}", instance_id=f"granularity-{chunk}")
        process = psutil.Process(fleet.servers[f"c{chunk}"].process.pid)
        warm = np.random.default_rng(chunk).integers(1000, 60000, 4 * chunk).tolist()
        client.store(warm, "warm-store")
        client.lookup(warm, "warm-lookup")
        client.end_session("warm-lookup")
        time.sleep(1.0)
        idle_from, idle_cpu = time.monotonic(), server_cpu(process)
        time.sleep(2.0)
        idle = (server_cpu(process) - idle_cpu) / (time.monotonic() - idle_from)
        price.idle_pct = idle * 100

        def spent(since_wall: float, since_cpu: float) -> float:
            return server_cpu(process) - since_cpu - idle * (time.monotonic() - since_wall)

        stores = work.stores[:prompts]
        wall, cpu = time.monotonic(), server_cpu(process)
        stored = 0
        for i, (_, tokens) in enumerate(stores):
            if not client.store(tokens.tolist(), f"store-{i}"):
                raise RuntimeError(f"LMCache's server refused store {i}")
            stored += len(tokens) // chunk * chunk
        time.sleep(1.0)  # the events and the local matcher's indexing after the last store
        price.store_us = spent(wall, cpu) / stored * 1e6
        queries = work.queries[:prompts]
        wall, cpu = time.monotonic(), server_cpu(process)
        for i, (_, tokens) in enumerate(queries):
            client.lookup(tokens.tolist(), f"lookup-{i}")
            client.end_session(f"lookup-{i}")
        price.lookup_ms = spent(wall, cpu) / len(queries) * 1e3
    finally:
        fleet.close()
        coordinator.stop()
    return price


# --- one row per chunk size ----------------------------------------------------------------


@dataclass
class Row:
    chunk: int
    runs: dict[str, Run] = field(default_factory=dict)
    store: StorePrice = field(default_factory=StorePrice)
    server: ServerPrice = field(default_factory=ServerPrice)
    load: float = 0.0


def reuse_cell(run: Run | None) -> str:
    if run is None:
        return "-"
    return " / ".join(f"{run.percent(s):.1f}" for s in ("unified", "once", "fleet", "ceiling"))


def cpu_cell(rows: Row, workloads: list[str]) -> str:
    return "; ".join(f"{rows.runs[w].cpu_plugin_ms:.2f} + {rows.runs[w].cpu_coordinator_ms:.2f}"
                     for w in workloads if w in rows.runs)


def table(rows: list[Row], workloads: list[str]) -> list[str]:
    head = (["chunk"] + [f"{w}: unified / once / fleet leg / ceiling, %" for w in workloads]
            + [f"lookup CPU ms, plugin + coordinator ({'; '.join(workloads)})",
               "coordinator B / stored token", "ingest CPU us / stored token",
               "event B / stored token", "store path us / stored token",
               "LMCache server: store CPU us / stored token",
               "LMCache server: CPU ms / lookup", "load"])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        server = ("not run" if np.isnan(r.server.store_us) else f"{r.server.store_us:.2f}",
                  "not run" if np.isnan(r.server.lookup_ms) else f"{r.server.lookup_ms:.2f}")
        lines.append("| " + " | ".join(
            [str(r.chunk)] + [reuse_cell(r.runs.get(w)) for w in workloads]
            + [cpu_cell(r, workloads), f"{r.store.coordinator_bytes:.1f}",
               f"{r.store.ingest_us:.3f}", f"{r.store.event_bytes:.2f}",
               f"{r.store.store_path_us:.3f}", *server, f"{r.load:.1f}"]) + " |")
    return lines


def invariants(rows: list[Row]) -> list[str]:
    """What must hold whatever the machine: ceiling >= each-chunk-once >= unified >= fleet
    leg (summed and query by query), every price measured and positive."""
    broken = []
    for r in rows:
        for name, run in r.runs.items():
            at = f"{name}/{r.chunk}"
            sums = {s: sum(run.reused[s]) for s in ("ceiling", "once", "unified", "fleet")}
            if not sums["ceiling"] >= sums["once"] >= sums["unified"] >= sums["fleet"]:
                broken.append(f"{at}: not ceiling >= once >= unified >= fleet leg: {sums}")
            if run.below_fleet():
                broken.append(f"{at}: unified below the fleet leg on {run.below_fleet()} queries")
            if any(run.wrong.values()):
                broken.append(f"{at}: wrong segments {run.wrong}")
        if not (r.store.stored_tokens > 0 and r.store.ingest_us > 0 and r.store.event_bytes > 0
                and r.store.store_path_us > 0):
            broken.append(f"{r.chunk}: a store price is missing: {r.store}")
    return broken


def plot(rows: list[Row], workloads: list[str], path: Path) -> None:
    """Reuse (left) and each price relative to the largest size (right) against chunk size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    sizes = [r.chunk for r in rows]
    figure, (reuse, cost) = plt.subplots(1, 2, figsize=(12, 4.6))
    for w, color in zip(workloads, ("tab:blue", "tab:orange")):
        for system, style, label in (("unified", "o-", "ours (unified)"),
                                     ("ceiling", "--", "token ceiling")):
            reuse.plot(sizes, [r.runs[w].percent(system) for r in rows], style, color=color,
                       label=f"MuSiQue {w}: {label}")
    reuse.set(xscale="log", xlabel="chunk size (tokens)", ylabel="reused tokens, % of prompt",
              title="Reuse")
    base = rows[0]
    series = {
        "coordinator CPU / lookup (B)": [r.runs[workloads[-1]].cpu_coordinator_ms for r in rows],
        "plugin CPU / lookup (B)": [r.runs[workloads[-1]].cpu_plugin_ms for r in rows],
        "coordinator memory / token": [r.store.coordinator_bytes for r in rows],
        "ingest CPU / token": [r.store.ingest_us for r in rows],
        "event bytes / token": [r.store.event_bytes for r in rows],
        "store path CPU / token": [r.store.store_path_us for r in rows],
        "LMCache server store CPU / token": [r.server.store_us for r in rows],
        "LMCache server CPU / lookup": [r.server.lookup_ms for r in rows],
    }
    for label, values in series.items():
        if values[0] > 0 and not np.isnan(values[0]):
            cost.plot(sizes, [v / values[0] for v in values], "o-", label=label)
    cost.set(xscale="log", xlabel="chunk size (tokens)",
             ylabel=f"x its value at chunk {base.chunk}", title="Price")
    cost.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}x"))
    for axis in (reuse, cost):
        axis.set_xticks(sizes, [str(s) for s in sizes])
        axis.minorticks_off()
        axis.invert_xaxis()
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_granularity",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=MUSIQUE_DATA_DIR,
                        help=f"folder holding {DATA_FILE} (default: {MUSIQUE_DATA_DIR})")
    parser.add_argument("--chunk-sizes", type=chunk_sizes, default=SIZES,
                        help="comma-separated, largest first (default: 256,128,64,32,16)")
    parser.add_argument("--workloads", nargs="+", choices=["A", "B"], default=["A", "B"])
    parser.add_argument("--queries", type=int, default=60,
                        help="the first N MuSiQue questions for the reuse runs (default 60)")
    parser.add_argument("--store-questions", type=int, default=150,
                        help="questions of workload B whose prompts the store pass stores "
                             "(default: all 150)")
    parser.add_argument("--lmcache-prompts", type=int, default=12,
                        help="prompts LMCache's server stores, then looks up; 0 skips it")
    parser.add_argument("--warmup", type=int, default=3, help="untimed lookups per reuse run")
    parser.add_argument("--cpu-rounds", type=int, default=4,
                        help="passes over the queries for the CPU per lookup (the process "
                             "CPU clocks tick every 10 ms: more lookups, finer figures)")
    parser.add_argument("--plot", type=Path, default=PLOT, help=f"the PNG (default: {PLOT})")
    parser.add_argument("--no-plot", action="store_true", help="no PNG (matplotlib not needed)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: chunk 64 and 32, 4 questions, no LMCache server, "
                             "no plot")
    args = parser.parse_args(argv)
    if args.quick:
        args.chunk_sizes, args.queries, args.store_questions = [64, 32], 4, 8
        args.lmcache_prompts, args.warmup, args.cpu_rounds, args.no_plot = 0, 1, 1, True
    return args


def measure(args: argparse.Namespace) -> list[Row]:
    """One row per chunk size, largest first, progress printed as it goes."""
    system, questions = load_musique(args.data)
    print(f"machine: {machine_description()}; load average {os.getloadavg()[0]:.1f} at start")
    print(f"reuse: the first {args.queries} questions of {args.data / DATA_FILE}; store "
          f"price: workload B's {args.store_questions} prompts; LMCache's server: "
          f"{args.lmcache_prompts} prompts stored, then looked up", flush=True)
    questions_reuse = questions[:args.queries]
    works = {"A": lambda: workload_a(system, questions_reuse),
             "B": lambda: workload_b(system, questions_reuse, seed=0)}
    priced = workload_b(system, questions[:args.store_questions], seed=0)
    rows = []
    workdir = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench-granularity-{os.getpid()}")
    os.makedirs(workdir, exist_ok=True)
    for chunk in args.chunk_sizes:
        row, started = Row(chunk), time.perf_counter()
        for name in args.workloads:
            row.runs[name] = run_one(works[name](), chunk, False, args.warmup,
                                     cpu_rounds=args.cpu_rounds)
        row.store = store_price(priced, chunk)
        if args.lmcache_prompts:
            row.server = lmcache_server_price(priced, chunk, args.lmcache_prompts, workdir)
        row.load = os.getloadavg()[0]
        rows.append(row)
        print(f"chunk {chunk}: {time.perf_counter() - started:.0f} s, load {row.load:.1f}",
              flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = measure(args)
    print()
    print("\n".join(table(rows, args.workloads)))
    print("\nblend-lookup reply forms, per lookup (benchmarks.lookup_forms; "
          f"{args.cpu_rounds} passes each, interleaved):\n")
    print("\n".join(forms_table([(w, r.chunk, r.runs[w].forms) for r in rows
                                 for w in args.workloads if w in r.runs])))
    print("\nreuse: % of prompt tokens (prefix coverage + segments); lookup CPU: per unified "
          "lookup, this process + the coordinator process; store price on B's stores; LMCache "
          "server: its CPU net of idle, our plugin loaded")
    if not args.no_plot:
        plot(rows, args.workloads, args.plot)
        print(f"plot: {args.plot}")
    broken = invariants(rows)
    print("invariants (ceiling >= each chunk once >= unified >= fleet leg, prices measured): "
          + ("hold" if not broken else "BROKEN: " + "; ".join(broken)))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
