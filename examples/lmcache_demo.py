"""Fleet demo on real LMCache MP servers (0.5.6, or 0.5.7rc2 with --lmcache): our lookup vs LMCache's built-in, one table.

Starts the bundled coordinator and two `lmcache server`s (blend engine, CPU, a shared
filesystem L2) that load the plugin with `--server-module`; each engine is a client with a
CPU KV cache in shared memory. The story: both servers store documents; the coordinator
restarts (its index lives in memory, so it forgets them); both store more documents. Then
RAG-style prompts on server B mix documents B stored before the restart (only B's local
matcher knows them), documents A stored after it (only the fleet knows them), and documents
B stored after it (both know them).

Each prompt is looked up twice on B: by our `cb_unified_lookup` (local matcher + fleet, one
budget) and by LMCache's own (coordinator mode: it asks the coordinator only), reachable on
the same server through the adapter's `fleet_blend.builtin_cb_unified_lookup` method.

Run: `make demo-lmcache` (or `python examples/lmcache_demo.py [--log-dir DIR]`); on LMCache
0.5.7rc2: `make demo-lmcache ARGS="--lmcache 0.5.7rc2"` (after `make lmcache-057`). Exits 0
when the demo ran. Only the table is printed; the coordinator's and the servers' logs go to
files in one directory, named at the end. SIGTERM or SIGINT stops it cleanly: the
coordinator and both servers stopped, the engines' shared-memory segments and the temporary
L2 directory removed (on an error too).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import tempfile
import time
from pathlib import Path

# LMCache's engine-side client logs at INFO in this process (shared-memory set-up, ...):
# only its warnings reach the table. The servers log at INFO to their files.
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, too

from coordinator_stub.launch.process import exit_on_signals, start_coordinator  # noqa: E402
from plugin.harness.lmcache_process import (LMCACHE_057, ServerFleet,  # noqa: E402
                                   running_lmcache_version, run_under)

LMCACHE_VERSIONS = ("0.5.6", LMCACHE_057)

C = 256
rng = random.Random(2026)


def tokens(n: int) -> list[int]:
    return [rng.randrange(1000, 60000) for _ in range(n)]


def reused(result) -> int:
    return result.prefix_coverage_tokens + sum(s.cur_ed - s.cur_st
                                               for s in result.non_prefix_segments)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="where the coordinator's and the LMCache servers' logs go "
                             "(default: a new lmcache-demo-logs-* directory in the temporary "
                             "directory, kept and named at the end)")
    parser.add_argument("--lmcache", choices=LMCACHE_VERSIONS, default=None,
                        help="the LMCache version to run (default: the one installed)")
    args = parser.parse_args(argv)
    run_under(args.lmcache)
    # SIGTERM/SIGINT end the demo through the `with`: the coordinator and both servers are
    # stopped, the engines' shared-memory KV caches freed, the shared L2 removed (on an
    # error too).
    with exit_on_signals(), contextlib.ExitStack() as stack:
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="lmcache-demo-logs-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        stack.callback(print, f"coordinator and LMCache server logs: {log_dir}")
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lmcache-demo-")))
        return run(workdir, log_dir, stack)


def run(workdir: Path, log_dir: Path, stack: contextlib.ExitStack) -> int:
    coordinators = []  # the one running last is stopped on the way out

    def start() -> str:
        with open(log_dir / f"coordinator-{len(coordinators)}.log", "w") as log:
            port = coordinators[-1].port if coordinators else 0
            coordinators.append(start_coordinator("--enable-blend-lookup", port=port,
                                                  stderr=log))
        return coordinators[-1].url

    stack.callback(print, "servers and coordinator stopped")
    stack.callback(lambda: coordinators and coordinators[-1].stop())
    url = start()
    print(f"LMCache {running_lmcache_version()}; coordinator: {url}; shared L2: {workdir}/l2")
    fleet = stack.enter_context(ServerFleet(
        coordinator_url=url, l2_dir=f"{workdir}/l2", log_dir=str(log_dir),
        module_config={"builtin_lookup": True}, env={"LMCACHE_LOG_LEVEL": "INFO"}))
    clients = fleet.start_many({name: dict(instance_id=f"demo-{name}") for name in ("A", "B")})
    for name, client in zip(("A", "B"), clients):  # started side by side
        print(f"lmcache server {name}: {fleet.servers[name].rpc_url} (plugin loaded, "
              f"reporting by {client.status()['reporting']})")
    a, b = fleet.clients["A"], fleet.clients["B"]
    system = tokens(C)

    def store(client, label, n_chunks):
        doc = tokens(n_chunks * C)
        assert client.store(tokens(C) + doc, f"store-{label}")
        return doc

    b_old = [store(b, f"b-old-{i}", 2) for i in range(3)]
    a_old = [store(a, f"a-old-{i}", 2) for i in range(2)]
    time.sleep(0.5)
    coordinators[-1].stop()
    start()
    print("coordinator restarted: its index forgot every document stored so far\n")
    a_new = [store(a, f"a-new-{i}", 3) for i in range(3)]
    b_new = [store(b, f"b-new-{i}", 2) for i in range(2)]
    time.sleep(1.0)  # events flushed, L2 written

    mixes = [("b-old", "a-new"), ("a-new", "b-new"), ("b-old", "a-new", "b-new"),
             ("a-old", "a-new"), ("b-old", "b-old", "a-new"), ("a-new", "a-new", "b-old")]
    pools = {"b-old": b_old, "a-old": a_old, "a-new": a_new, "b-new": b_new}
    header = (f"{'req':>3} {'documents on B':<24} {'tokens':>6} {'ours':>6} {'fleet-only':>10} "
              f"{'built-in':>8} {'ours ms':>8} {'built-in ms':>11}")
    print(header)
    print("-" * len(header))
    totals = {"tokens": 0, "ours": 0, "builtin": 0}
    for r, mix in enumerate(mixes):
        docs = [rng.choice(pools[kind]) for kind in mix]
        prompt = list(system)
        for doc in docs:
            prompt += tokens(rng.randrange(8, 60)) + doc
        prompt += tokens(40)
        before = b.status()["plugin"]["segments_fleet_only"]
        ours, ours_s, _ = b.lookup(prompt, f"req-{r}")
        fleet_only = b.status()["plugin"]["segments_fleet_only"] - before
        theirs, theirs_s, _ = b.lookup(prompt, f"req-{r}-builtin", builtin=True)
        for rid in (f"req-{r}", f"req-{r}-builtin"):
            b.end_session(rid)  # no retrieve follows in the demo: release the locks
        print(f"{r:>3} {'+'.join(mix):<24} {len(prompt):>6} {reused(ours):>6} "
              f"{fleet_only * C:>10} {reused(theirs):>8} {ours_s * 1e3:>8.1f} "
              f"{theirs_s * 1e3:>11.1f}")
        totals["tokens"] += len(prompt)
        totals["ours"] += reused(ours)
        totals["builtin"] += reused(theirs)
    t = totals["tokens"]
    print()
    print(f"reused, ours (local + fleet)       : {totals['ours']:>6} of {t} tokens "
          f"({totals['ours'] / t:.0%})")
    print(f"reused, LMCache built-in (coord.)  : {totals['builtin']:>6} of {t} tokens "
          f"({totals['builtin'] / t:.0%})")
    print(f"ours vs built-in                   : {totals['ours'] / max(totals['builtin'], 1):.2f}x "
          f"the reused tokens; {totals['ours'] - totals['builtin']} fewer tokens to prefill")
    print("(a-old documents sit in the shared L2 but neither the restarted coordinator nor "
          "B's local matcher knows them: no lookup finds them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
