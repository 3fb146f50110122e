"""`cb_unified_lookup` through a real LMCache 0.5.6 MP server's RPC: ours vs LMCache's own.

Same servers, same documents, same prompts, measured in one run: the bundled coordinator and
two `lmcache server`s (blend engine, CPU, shared filesystem L2) loading the plugin with
`--server-module`, LMCache's built-in lookup reachable on the same server through the
adapter's `fleet_blend.builtin_cb_unified_lookup` method (coordinator mode, as LMCache runs it
when a coordinator is configured). Server A stores most documents; server B stores some
while the coordinator is restarting (so only B's local matcher knows them, the normal gap of
a best-effort event stream). Prompts on B mix both kinds plus fresh text.

Each lookup is driven as an engine drives it: `cb_unified_lookup` re-sent until it answers
(non-blocking server side), then `end_session` (not timed) releases the read locks since no
retrieve follows. Ours and LMCache's alternate prompt by prompt so drift hits both alike.

Printed: latency p50/p90/p99 and the ratio ours/LMCache (target <= 1.2), polls per lookup,
server CPU per lookup (B's process, from /proc, over each side's lookups), reused tokens of
each, and the machine. Other processes may share the cores: say so when quoting figures.

Run: `make bench-lmcache` (ARGS="--prompts 200"; `--lmcache 0.5.7rc2` runs it on LMCache
0.5.7rc2, after `make lmcache-057`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402

from benchmarks.common import machine_description, percentile_ms  # noqa: E402
from coordinator_stub.launch.process import start_coordinator  # noqa: E402
from plugin.harness.lmcache_process import (LMCACHE_057, ServerFleet,  # noqa: E402
                                   running_lmcache_version, run_under)

C = 256
TARGET_RATIO = 1.2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=120, help="prompts per side")
    parser.add_argument("--fleet-docs", type=int, default=24, help="documents stored on A")
    parser.add_argument("--local-docs", type=int, default=8,
                        help="documents B stores while the coordinator restarts")
    parser.add_argument("--warmup", type=int, default=10, help="untimed prompts per side")
    parser.add_argument("--lmcache", choices=("0.5.6", LMCACHE_057), default=None,
                        help="the LMCache version to run (default: the one installed)")
    args = parser.parse_args()
    run_under(args.lmcache)
    rng = random.Random(7)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000, 60000) for _ in range(n)]

    print(f"machine: {machine_description()}; LMCache {running_lmcache_version()}")
    workdir = tempfile.mkdtemp(prefix="bench-lmcache-")
    coordinator = start_coordinator("--enable-blend-lookup")
    fleet = ServerFleet(coordinator_url=coordinator.url, l2_dir=f"{workdir}/l2", log_dir=workdir,
                        module_config={"builtin_lookup": True}, l1_size_gb=1.0,
                        client_options={"num_blocks": 4096})
    try:
        a, b = (fleet.start(name, instance_id=f"bench-{name}") for name in ("A", "B"))
        fleet_docs = []
        for i in range(args.fleet_docs):
            doc = tokens(rng.choice((2, 3, 4)) * C)
            assert a.store(tokens(C) + doc, f"fleet-doc-{i}")
            fleet_docs.append(doc)
        port = coordinator.port
        coordinator.stop()
        local_docs = []
        for i in range(args.local_docs):
            doc = tokens(2 * C)
            assert b.store(tokens(C) + doc, f"local-doc-{i}")
            local_docs.append(doc)
        coordinator = start_coordinator("--enable-blend-lookup", port=port)
        time.sleep(1.0)
        # The coordinator restarted empty: A re-stores its documents (same content, new
        # requests), as a fleet would repopulate it; B's stay known to B alone.
        for i, doc in enumerate(fleet_docs):
            assert a.store(tokens(C) + doc, f"fleet-doc-again-{i}")
        time.sleep(1.5)

        def prompt() -> list[int]:
            picked = rng.sample(fleet_docs, 2) + rng.sample(local_docs, 1)
            rng.shuffle(picked)
            out = tokens(rng.randrange(20, 200))
            for doc in picked:
                out += doc + tokens(rng.randrange(5, 80))
            return out

        server_b = psutil.Process(fleet.servers["B"].process.pid)
        sides = {"ours": dict(builtin=False), "lmcache": dict(builtin=True)}
        samples = {side: [] for side in sides}
        polls = {side: [] for side in sides}
        reused = {side: 0 for side in sides}
        cpu = {side: 0.0 for side in sides}
        total_tokens = 0
        for n in range(args.warmup + args.prompts):
            query = prompt()
            timed = n >= args.warmup
            total_tokens += len(query) if timed else 0
            order = list(sides) if n % 2 == 0 else list(reversed(sides))
            for side in order:
                rid = f"{side}-{n}"
                before = server_b.cpu_times()
                result, seconds, calls = b.lookup(query, rid, **sides[side])
                after = server_b.cpu_times()
                b.end_session(rid)
                if timed:
                    samples[side].append(seconds)
                    polls[side].append(calls)
                    cpu[side] += (after.user + after.system) - (before.user + before.system)
                    reused[side] += result.prefix_coverage_tokens + sum(
                        s.cur_ed - s.cur_st for s in result.non_prefix_segments)

        print(f"\n{args.prompts} prompts per side on server B, {total_tokens / args.prompts:.0f} "
              f"tokens each on average; {args.fleet_docs} documents known to the fleet, "
              f"{args.local_docs} to B's local matcher only\n")
        header = (f"{'lookup':<26}{'p50 ms':>8}{'p90 ms':>8}{'p99 ms':>8}{'polls':>7}"
                  f"{'server CPU ms/op':>18}{'reused tokens':>15}")
        print(header)
        print("-" * len(header))
        labels = {"ours": "ours (local + fleet)", "lmcache": "LMCache built-in (coord.)"}
        for side in sides:
            print(f"{labels[side]:<26}{percentile_ms(samples[side], 50):>8.2f}"
                  f"{percentile_ms(samples[side], 90):>8.2f}{percentile_ms(samples[side], 99):>8.2f}"
                  f"{statistics.mean(polls[side]):>7.1f}"
                  f"{cpu[side] / args.prompts * 1e3:>18.2f}"
                  f"{reused[side]:>15}")
        ratio = percentile_ms(samples["ours"], 50) / percentile_ms(samples["lmcache"], 50)
        ratio99 = percentile_ms(samples["ours"], 99) / percentile_ms(samples["lmcache"], 99)
        print(f"\nlatency ours / LMCache: p50 {ratio:.2f}x, p99 {ratio99:.2f}x "
              f"(target <= {TARGET_RATIO}x); reused tokens ours / LMCache: "
              f"{reused['ours'] / max(reused['lmcache'], 1):.2f}x")
        print(f"throughput (one engine, sequential): ours {args.prompts / sum(samples['ours']):.0f} "
              f"lookups/s, LMCache {args.prompts / sum(samples['lmcache']):.0f} lookups/s")
        return 0
    finally:
        fleet.close()
        coordinator.stop()


if __name__ == "__main__":
    sys.exit(main())
