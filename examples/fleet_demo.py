"""Fleet demo: three serving processes, one coordinator, RAG requests on the "wrong" server.

Starts the bundled coordinator (a subprocess on a free loopback port), three servers (each a
`BlendPlugin` over an `InMemoryHost`; the hosts share one L2 dict, so a chunk one server
stored can be fetched by another), stores a small corpus of documents spread across them, then
sends RAG-style prompts (shared system prompt, retrieved documents in any order between fresh
text, a question) to servers that did not store most of those documents.

Each request is looked up twice on the same server: by the fleet-enabled plugin, and by a
local-only twin that sees the same stores but no coordinator. The table shows where the reused
tokens came from; the summary compares reuse with the fleet leg against local-only.

With `--cluster` (`make demo-cluster`) the coordinator is two replicas over a NATS
JetStream event log (a 3-node NATS cluster on loopback, stream replicas 3); the servers
get both URLs. Half-way through the requests one replica is killed (SIGKILL) and
restarted from its snapshot; the lookups go on through the other replica, and at the
end both replicas answer every request's lookup identically.

Run: `make demo` (or `python examples/fleet_demo.py [--cluster]`). Exits 0 when the demo
ran (and, with `--cluster`, the replicas agree).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
import time
from pathlib import Path

import httpx

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, too

from blend_wire import BLEND_LOOKUP_PATH, encode, encode_tokens  # noqa: E402
from coordinator_stub.launch.process import (exit_on_signals, held_signals,  # noqa: E402
                                      start_coordinator)
from plugin import BlendPlugin, InMemoryHost, LookupKey, PluginConfig, Source  # noqa: E402

C = 256
MODEL = "demo-llama-8b"
NUM_SERVERS = 3
NUM_DOCS = 9
NUM_REQUESTS = 9


class Server:
    """One serving process: its engine-side host, its plugin, and a local-only twin."""

    def __init__(self, index: int, url: str, l2: dict) -> None:
        self.name = f"server-{index}"
        self.host = InMemoryHost(C, shared_l2=l2)
        self.fleet = BlendPlugin(PluginConfig(
            coordinator_url=url, event_reporting=True, event_flush_interval=0.05,
            blend_timeout=0.5, chunk_size=C, instance_id=self.name), self.host)
        self.local_only = BlendPlugin(PluginConfig(chunk_size=C, instance_id=self.name), self.host)
        self.stored_docs: set[int] = set()

    def save(self, request_id: str, tokens: np.ndarray) -> None:
        key = LookupKey(request_id, tokens, MODEL)
        hashes = self.host.chunk_hashes(key)
        self.host.store(key, hashes, 0)
        self.fleet.on_store(key, hashes, 0)
        self.local_only.on_store(key, hashes, 0)

    def close(self) -> None:
        self.fleet.close()
        self.local_only.close()


def lookup(plugin: BlendPlugin, key: LookupKey):
    """Call like a scheduler does: again on each step until the lookup completes."""
    started = time.perf_counter()
    while (result := plugin.cb_unified_lookup(key, 1)) is None:
        time.sleep(0.0002)
    return result, time.perf_counter() - started


class Replicas:
    """Two coordinator replicas over a 3-node NATS cluster, on fixed ports so a restarted
    replica comes back at the same URL."""

    def __init__(self, workdir: Path, log_dir: Path) -> None:
        from coordinator_stub.launch.nats_process import free_ports, start_nats_cluster

        self.log_dir = log_dir
        self.running = [None, None]
        self.nats = start_nats_cluster(3, workdir / "nats")
        try:
            self.ports = free_ports(2)
            self.flags = [("--enable-blend-lookup", "--chunk-size", str(C), "--event-log",
                           self.nats.urls, "--event-log-replicas", "3", "--replica-name",
                           name, "--snapshot-dir", str(workdir / f"snapshots-{name}"),
                           "--snapshot-interval", "1") for name in ("a", "b")]
            for i in range(2):
                self.start(i)
        except BaseException:
            self.stop()
            raise

    def start(self, i: int) -> None:
        with open(self.log_dir / f"coordinator-{'ab'[i]}.log", "a") as log:
            self.running[i] = start_coordinator(*self.flags[i], port=self.ports[i],
                                                stderr=log)

    def kill(self, i: int) -> None:
        self.running[i].process.kill()
        self.running[i].process.wait()

    @property
    def url(self) -> str:
        return ",".join(f"http://127.0.0.1:{port}" for port in self.ports)

    def stop(self) -> None:
        for running in self.running:
            if running is not None:
                running.stop()
        self.nats.stop()


def replicas_agree(urls: list[str], queries: list[np.ndarray]) -> bool:
    answers = []
    for url in urls:
        with httpx.Client(base_url=url, timeout=10) as http:
            answers.append([http.post(BLEND_LOOKUP_PATH, content=encode(
                {"tokens_b64": encode_tokens(q), "model_name": MODEL})).json()
                for q in queries])
    return all(a == answers[0] for a in answers[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", action="store_true",
                        help="two coordinator replicas over NATS JetStream; one is killed "
                             "and restarted half-way")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="where the coordinator's log goes (default: a new "
                             "fleet-demo-logs-* directory in the temporary directory, kept "
                             "and named at the end)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # SIGTERM/SIGINT end the demo through the `with`: every process it started is stopped
    # and its temporary directory removed (on an error too).
    with exit_on_signals(), contextlib.ExitStack() as stack:
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="fleet-demo-logs-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        stack.callback(print, f"coordinator logs: {log_dir}")
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fleet-demo-")))
        return run(args.cluster, workdir, log_dir, stack)


def run(cluster: bool, workdir: Path, log_dir: Path, stack: contextlib.ExitStack) -> int:
    rng = np.random.default_rng(2024)
    if cluster:
        coordinator = Replicas(workdir, log_dir)
        stack.callback(print, "coordinator replicas and NATS stopped")
        stack.callback(coordinator.stop)
        url = coordinator.url
        print(f"coordinator: two replicas {url} over NATS JetStream "
              f"({coordinator.nats.urls}; blend lookup on, chunk size {C})")
    else:
        with open(log_dir / "coordinator.log", "w") as log:
            coordinator = start_coordinator("--enable-blend-lookup", "--chunk-size", str(C),
                                            stderr=log)
        stack.callback(print, "coordinator stopped")
        stack.callback(coordinator.stop)
        url = coordinator.url
        print(f"coordinator: {url} (blend lookup on, chunk size {C})")
    queries: list[np.ndarray] = []
    l2: dict = {}
    servers = []
    for i in range(NUM_SERVERS):
        with held_signals():  # a plugin's threads start in there: never without its close
            servers.append(Server(i, url, l2))
            stack.callback(servers[-1].close)
    system_prompt = rng.integers(1000, 60000, C, dtype=np.uint32)
    docs = [rng.integers(1000, 60000, int(rng.integers(3 * C // 2, 4 * C)), dtype=np.uint32)
            for _ in range(NUM_DOCS)]
    # Every server has served the system prompt before (a warm prefix).
    for server in servers:
        server.save(f"{server.name}-warmup", system_prompt)
    # Each document was retrieved (and its KV stored) on one server only.
    for d, doc in enumerate(docs):
        owner = servers[d % NUM_SERVERS]
        owner.save(f"doc-{d}", doc)
        owner.stored_docs.add(d)
    for server in servers:
        server.fleet.flush()
    print(f"corpus: {NUM_DOCS} documents ({sum(map(len, docs))} tokens) stored across "
          f"{NUM_SERVERS} servers; shared L2 holds {len(l2)} chunks\n")

    # One throw-away lookup per server first: JIT compilation and HTTP connection set-up
    # are once-per-process costs, not per-lookup ones.
    for server in servers:
        warm = np.concatenate([system_prompt, rng.integers(1000, 60000, 2 * C, dtype=np.uint32)])
        lookup(server.fleet, LookupKey(f"{server.name}-warm", warm, MODEL))
        lookup(server.local_only, LookupKey(f"{server.name}-warm", warm, MODEL))

    header = (f"{'req':>4} {'server':>8} {'docs':>9} {'tokens':>6} {'prefix':>6} "
              f"{'local':>6} {'fleet':>6} {'union':>6} {'local-only':>10} {'lookup ms':>9}")
    print(header)
    print("-" * len(header))
    totals = dict(tokens=0, fleet=0, local_only=0, time=[])
    for r in range(NUM_REQUESTS):
        if cluster and r == NUM_REQUESTS // 2:
            coordinator.kill(1)
            print("     -- replica b killed (SIGKILL); lookups go to replica a --")
        if cluster and r == NUM_REQUESTS // 2 + 2:
            coordinator.start(1)
            print("     -- replica b restarted from its snapshot + the event log --")
        server = servers[r % NUM_SERVERS]
        foreign = [d for d in range(NUM_DOCS) if d not in server.stored_docs]
        picked = list(rng.choice(foreign, size=2 if r % 2 else 3, replace=False))
        if r % 2:  # some requests also retrieve a document this server stored itself
            picked.append(int(rng.choice(sorted(server.stored_docs))))
        rng.shuffle(picked)
        pieces = [system_prompt]
        for d in picked:
            pieces += [rng.integers(1000, 60000, int(rng.integers(10, 60)), dtype=np.uint32), docs[d]]
        pieces.append(rng.integers(1000, 60000, 40, dtype=np.uint32))  # the question
        tokens = np.concatenate(pieces)

        queries.append(tokens)
        key = LookupKey(f"req-{r}", tokens, MODEL)
        result, seconds = lookup(server.fleet, key)
        trace = server.fleet.trace(key.request_id)
        alone, _ = lookup(server.local_only, LookupKey(f"req-{r}-local", tokens, MODEL))
        local_tokens = trace.tokens_from(Source.LOCAL, Source.BOTH)
        fleet_tokens = trace.tokens_from(Source.FLEET)
        n = len(tokens)
        print(f"{r:>4} {server.name:>8} {','.join(map(str, sorted(picked))):>9} {n:>6} "
              f"{result.prefix_coverage_tokens:>6} {local_tokens:>6} {fleet_tokens:>6} "
              f"{result.covered_tokens / n:>6.0%} {alone.covered_tokens / n:>10.0%} "
              f"{seconds * 1e3:>9.2f}")
        totals["tokens"] += n
        totals["fleet"] += result.covered_tokens
        totals["local_only"] += alone.covered_tokens
        totals["time"].append(seconds)

    times = np.array(totals["time"]) * 1e3
    print()
    print(f"reused with the fleet leg : {totals['fleet']:>6} of {totals['tokens']} tokens "
          f"({totals['fleet'] / totals['tokens']:.0%})")
    print(f"reused local-only         : {totals['local_only']:>6} of {totals['tokens']} tokens "
          f"({totals['local_only'] / totals['tokens']:.0%})")
    gain = totals["fleet"] / max(totals["local_only"], 1)
    print(f"fleet vs local-only       : {gain:.2f}x the reused tokens; "
          f"{totals['fleet'] - totals['local_only']} fewer tokens to prefill")
    print(f"lookup time (fleet)       : median {np.median(times):.2f} ms, max {times.max():.2f} ms "
          f"(budget {servers[0].fleet.config.match_budget_s * 1e3:.0f} ms)")
    if cluster:
        agree = replicas_agree(url.split(","), queries)
        print(f"replicas agree on all {len(queries)} lookups: {'yes' if agree else 'NO'}")
        return 0 if agree else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
