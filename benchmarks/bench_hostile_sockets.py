"""Does the coordinator keep answering under ~19k hostile sockets? (issue 11, point 3)

Run: `python -m benchmarks.bench_hostile_sockets [--sockets 19000] [--clients 2]
[--cap 4096 --cap 19000] [--requests 200]` (`--help` lists every knob). Everything on
127.0.0.1. For each connection cap (`--max-connections`; the coordinator lowers it to fit
its own descriptor limit, printed):

1. starts the bundled coordinator (blend lookup on, `--idle-timeout` long enough that no
   hostile socket times out during the run: the cap alone protects it) and stores a few
   chunks through `POST /events`;
2. quiet: `--requests` `/healthz` and `--requests` blend lookups (each on a fresh
   connection, the worst case under a flood: it must be admitted past the held sockets;
   and as many on one keep-alive connection), latencies and errors, the coordinator's RSS
   and open descriptors;
3. hostile: `--clients` processes (each with its own descriptor limit) open `--sockets`
   sockets between them, half silent, half sending an incomplete request head, and hold
   them. Then the same requests as in 2 while they are held, plus how many sockets the
   coordinator holds, how many it closed to stay under the cap, its CPU time while
   holding them;
4. release: the clients close their sockets; after `--settle` s, the coordinator's RSS
   and descriptors again, and the quiet requests once more; then RSS after a garbage
   collection and `malloc_trim`, next to what live objects hold (pymalloc and glibc in
   use, `benchmarks.memory_probe`), so memory that is merely cached or fragmented shows
   apart from memory still held; `--rounds` floods in all, and those figures after each
   (what stays after one flood must not grow with the next);
5. prints each phase's p50/p99/max per request kind, the hostile/quiet ratios, errors,
   and the machine. Every lookup must return the stored chunks.

Needs a descriptor limit (`ulimit -n`) above `--sockets / --clients` plus a few hundred
for the clients and above the cap for the coordinator; the script says so and stops if not.
"""

from __future__ import annotations

import argparse
import os
import resource
import select
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

from benchmarks import memory_probe
from benchmarks.common import machine_description, percentile_ms
from blend_wire import (BLEND_LOOKUP_PATH, EVENTS_PATH, HEALTH_PATH, encode, encode_tokens,
                        pack_kv_rank)

C = 256
MODEL = "hostile-model"
_PARTIAL_HEAD = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"


# --- the hostile client process ------------------------------------------------------------------

def hold(host: str, port: int, count: int) -> int:
    """Child process: open `count` sockets (every other one sends a partial request head),
    print `opened N failed F SECONDS`, wait for a line on stdin, report how many the server
    closed meanwhile (`closed_by_server N`), close them all and exit."""
    sockets: list[socket.socket] = []
    failed = 0
    started = time.perf_counter()
    for i in range(count):
        try:
            sock = socket.create_connection((host, port), timeout=30)
            if i % 2:
                sock.sendall(_PARTIAL_HEAD)
            sockets.append(sock)
        except OSError:
            failed += 1
    print(f"opened {len(sockets)} failed {failed} {time.perf_counter() - started:.2f}",
          flush=True)
    sys.stdin.readline()
    poller = select.poll()
    for sock in sockets:
        poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    closed = len(poller.poll(0))  # readable: EOF, reset, or a 503 before the close
    print(f"closed_by_server {closed}", flush=True)
    for sock in sockets:
        sock.close()
    return 0


class Holders:
    """The hostile client processes."""

    def __init__(self, host: str, port: int, total: int, clients: int) -> None:
        counts = [total // clients + (i < total % clients) for i in range(clients)]
        self.processes = [subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_hostile_sockets", "--hold", host,
             str(port), str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for n in counts]
        self.opened = self.failed = 0
        self.open_s = 0.0
        for process in self.processes:
            _, opened, _, failed, seconds = process.stdout.readline().split()
            self.opened += int(opened)
            self.failed += int(failed)
            self.open_s = max(self.open_s, float(seconds))

    def release(self) -> int:
        """Close every socket; returns how many the server had closed by then."""
        closed = 0
        for process in self.processes:
            process.stdin.write("close\n")
            process.stdin.flush()
        for process in self.processes:
            closed += int(process.stdout.readline().split()[1])
            process.wait(60)
        return closed

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


# --- the legitimate requests ------------------------------------------------------------------------

def store_chunks(url: str, rng: np.random.Generator, count: int) -> tuple[np.ndarray, list[str]]:
    """Store `count` chunks of one document at offset 0; returns its tokens and hashes."""
    tokens = rng.integers(1, 128_000, count * C, dtype=np.uint32)
    hashes = [f"{i + 1:032x}" for i in range(count)]
    entries = [{"key": {"chunk_hash_hex": h, "model_name": MODEL, "kv_rank": pack_kv_rank(1, 0),
                        "object_group_id": 0, "cache_salt": ""}, "size_bytes": 1024,
                "token_ids": tokens[i * C:(i + 1) * C].tolist(), "token_offset": i * C}
               for i, h in enumerate(hashes)]
    body = encode({"batches": [{"instance_id": "legit", "incarnation": 1, "seq": 1,
                                "event_type": "store", "tier": "l1", "backend": "dram",
                                "entries": entries}]})
    response = httpx.post(url + EVENTS_PATH, content=body, timeout=30,
                          headers={"content-type": "application/json"})
    if response.status_code != 200:
        raise RuntimeError(f"storing the chunks: HTTP {response.status_code} {response.text[:300]}")
    return tokens, hashes


class Requests:
    """Times `/healthz` and blend lookups on fresh connections and on one kept alive."""

    def __init__(self, url: str, query: bytes, expected: list[str]) -> None:
        self.url = url
        self.query = query
        self.expected = expected

    def _one(self, http: httpx.Client, kind: str) -> float:
        started = time.perf_counter()
        if kind == "healthz":
            response = http.get(HEALTH_PATH)
        else:
            response = http.post(BLEND_LOOKUP_PATH, content=self.query,
                                 headers={"content-type": "application/json"})
        elapsed = time.perf_counter() - started
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}")
        if kind == "lookup" and [m["chunk_hash"] for m in response.json()["matches"]] != \
                self.expected:
            raise RuntimeError("wrong matches")
        return elapsed

    def run(self, count: int) -> dict[str, tuple[list[float], int]]:
        """{kind: (latencies, errors)} for fresh/keep-alive x healthz/lookup."""
        out: dict[str, tuple[list[float], int]] = {}
        for kind in ("healthz", "lookup"):
            samples, errors = [], 0
            for _ in range(count):
                try:
                    with httpx.Client(base_url=self.url, timeout=10) as http:
                        samples.append(self._one(http, kind))
                except Exception:
                    errors += 1
            out[f"{kind} (new connection)"] = (samples, errors)
            samples, errors = [], 0
            with httpx.Client(base_url=self.url, timeout=10) as http:
                for _ in range(count):
                    try:
                        samples.append(self._one(http, kind))
                    except Exception:
                        errors += 1
            out[f"{kind} (keep-alive)"] = (samples, errors)
        return out


def _describe(samples: list[float], errors: int) -> str:
    if not samples:
        return f"no answer, {errors} errors"
    return (f"p50 {percentile_ms(samples, 50):6.2f}  p99 {percentile_ms(samples, 99):7.2f}  "
            f"max {max(samples) * 1e3:7.2f} ms  errors {errors}")


def _state(process: psutil.Process) -> tuple[int, int]:
    return process.memory_info().rss, process.num_fds()


def run_cap(cap: int, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    diag_dir = tempfile.TemporaryDirectory(prefix="hostile-")
    coordinator = memory_probe.launch(
        ["--enable-blend-lookup", "--max-connections", str(cap), "--idle-timeout",
         str(args.idle_timeout), "--log-level", "ERROR"], Path(diag_dir.name))
    holders = None
    try:
        child = psutil.Process(coordinator.process.pid)
        soft, _ = child.rlimit(psutil.RLIMIT_NOFILE)
        effective = min(cap, soft - 64)  # coordinator_stub.http.connections.connection_cap
        tokens, hashes = store_chunks(coordinator.url, rng, args.chunks)
        query = np.concatenate([rng.integers(1, 128_000, 77, dtype=np.uint32), tokens])
        requests = Requests(coordinator.url, encode(
            {"tokens_b64": encode_tokens(query), "model_name": MODEL, "world_size": 1,
             "cache_salt": ""}), hashes)
        requests.run(20)  # warm both paths (first-call allocations, kernels)
        print(f"\ncap {cap} requested -> {effective} (coordinator descriptor limit {soft}); "
              f"idle timeout {args.idle_timeout:g} s")
        quiet = requests.run(args.requests)
        quiet_state = _state(child)
        quiet_probe = coordinator.diagnose()
        holders = Holders(coordinator.host, coordinator.port, args.sockets, args.clients)
        time.sleep(1.0)  # let the coordinator accept (and evict) the tail
        held_state = _state(child)
        hold_started = time.monotonic()
        hostile = requests.run(args.requests)
        idle_cpu_started = sum(child.cpu_times()[:2])
        time.sleep(args.idle_hold)  # sockets held, no requests: what do they cost?
        idle_cpu = (sum(child.cpu_times()[:2]) - idle_cpu_started) / args.idle_hold
        held_for = time.monotonic() - hold_started
        opened = (holders.opened, holders.failed, holders.open_s)
        closed_by_server = holders.release()
        holders = None
        time.sleep(args.settle)
        after = requests.run(args.requests)
        after_state = _state(child)
        after_probe = coordinator.diagnose()
        # More rounds of the same flood: what stays after one must not grow with the next.
        rounds = [after_probe]
        for _ in range(args.rounds - 1):
            holders = Holders(coordinator.host, coordinator.port, args.sockets, args.clients)
            time.sleep(1.0)
            requests.run(10)
            holders.release()
            holders = None
            time.sleep(args.settle)
            rounds.append(coordinator.diagnose())
        return dict(cap=cap, effective=effective, quiet=quiet, hostile=hostile, after=after,
                    quiet_state=quiet_state, held_state=held_state, after_state=after_state,
                    held_for=held_for, idle_cpu=idle_cpu, closed_by_server=closed_by_server,
                    opened=opened, quiet_probe=quiet_probe, after_probe=after_probe,
                    rounds=rounds)
    finally:
        if holders is not None:
            holders.kill()
        coordinator.stop()
        diag_dir.cleanup()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--hold"]:
        return hold(argv[1], int(argv[2]), int(argv[3]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sockets", type=int, default=19_000, help="hostile sockets, all clients")
    p.add_argument("--clients", type=int, default=2, help="hostile client processes")
    p.add_argument("--cap", type=int, action="append",
                   help="--max-connections to run with (repeat); default 4096 and 19000")
    p.add_argument("--requests", type=int, default=200, help="requests per kind and phase")
    p.add_argument("--chunks", type=int, default=4, help="chunks stored, found by each lookup")
    p.add_argument("--idle-timeout", type=float, default=600.0,
                   help="coordinator --idle-timeout: long, so the cap alone protects it")
    p.add_argument("--idle-hold", type=float, default=5.0,
                   help="seconds the sockets are held with no requests (idle CPU)")
    p.add_argument("--settle", type=float, default=3.0, help="seconds after the release")
    p.add_argument("--rounds", type=int, default=3,
                   help="floods (open, hold, release) per cap: memory after each")
    p.add_argument("--seed", type=int, default=3)
    args = p.parse_args(argv)
    caps = args.cap or [4096, 19_000]
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    per_client = -(-args.sockets // args.clients)
    if soft < per_client + 256:
        print(f"descriptor limit {soft} too low for {per_client} sockets per client: raise "
              f"`ulimit -n` or use more --clients", file=sys.stderr)
        return 2
    print(f"machine: {machine_description()}; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} (other work may share the cores)")
    print(f"{args.sockets} hostile sockets from {args.clients} processes (half silent, half an "
          f"incomplete request head), {args.requests} requests per kind and phase, each lookup "
          f"a {args.chunks * C + 77}-token query finding {args.chunks} stored chunks")
    for cap in caps:
        r = run_cap(cap, args)
        report(r, args)
    return 0


def report(r: dict, args: argparse.Namespace) -> None:
    mb = 2**20
    (q_rss, q_fds), (h_rss, h_fds), (a_rss, a_fds) = (r["quiet_state"], r["held_state"],
                                                      r["after_state"])
    print(f"coordinator RSS / open descriptors: quiet {q_rss / mb:.1f} MB / {q_fds}, holding "
          f"{h_rss / mb:.1f} MB / {h_fds}, {args.settle:g} s after the release "
          f"{a_rss / mb:.1f} MB / {a_fds}")
    q, a = r["quiet_probe"], r["after_probe"]
    print(f"  after gc + malloc_trim: RSS quiet {q['rss_after_trim'] / mb:.1f} MB, after the "
          f"release {a['rss_after_trim'] / mb:.1f} MB; held by live objects (pymalloc and glibc "
          f"in use) {memory_probe.held_bytes(q) / mb:.1f} -> "
          f"{memory_probe.held_bytes(a) / mb:.1f} MB; pymalloc "
          f"arenas {q['pymalloc'].get('arena_bytes', 0) / mb:.0f} -> "
          f"{a['pymalloc'].get('arena_bytes', 0) / mb:.0f} MB")
    print("  after each flood (gc + malloc_trim): " + ", ".join(
        f"RSS {p['rss_after_trim'] / mb:.1f} MB / live {memory_probe.held_bytes(p) / mb:.1f} MB"
        for p in r["rounds"]))
    opened, failed, seconds = r["opened"]
    print(f"hostile sockets opened {opened} (failed {failed}) in {seconds:.1f} s; held "
          f"{r['held_for']:.0f} s")
    print(f"sockets closed by the coordinator to stay under its cap while held: "
          f"{r['closed_by_server']}; its CPU while holding them with no requests: "
          f"{r['idle_cpu'] * 1e3:.1f} ms/s")
    for kind in r["quiet"]:
        quiet, hostile, after = r["quiet"][kind], r["hostile"][kind], r["after"][kind]
        print(f"  {kind:24s} quiet   {_describe(*quiet)}")
        print(f"  {'':24s} hostile {_describe(*hostile)}")
        print(f"  {'':24s} after   {_describe(*after)}")
        if quiet[0] and hostile[0]:
            print(f"  {'':24s} hostile/quiet: p50 x"
                  f"{percentile_ms(hostile[0], 50) / percentile_ms(quiet[0], 50):.2f}, p99 x"
                  f"{percentile_ms(hostile[0], 99) / percentile_ms(quiet[0], 99):.2f}")


if __name__ == "__main__":
    sys.exit(main())
