"""`make bench-routing`: routing policies in a queueing simulation on CacheBlend's MuSiQue
prompts (issue 31; the simulation: benchmarks/routing_sim.py).

Cells: 8 and 32 instances x Poisson arrivals at 50%, 80% and 95% of the fleet's capacity x
two workloads:
- `uniform`: each request one of the 150 questions at random, its 10 passages in one of 4
  orders (the retriever's, or one of 3 others: the same passages ranked differently);
- `hot`: half the requests carry one passage set (the first question's passages, in one of
  its 4 orders, behind a random question), the other half as `uniform`.

Capacity: the requests/s the fleet serves when each costs the mean GPU time it costs under
round-robin, measured in a calibration run of the same workload and fleet (round-robin at
half the no-reuse capacity). So at 95% round-robin's instances are 95% busy, a policy that
reuses more is less busy, and one that piles requests onto few instances queues there.

Policies (routing_sim.policies): round-robin; least-loaded (fewest in flight, the router's
fallback); prefix-only (Dynamo's KV router: its documented cost, prefill queued plus this
request's uncached prefix at 1.0 plus the KV in flight, lowest wins; llm-d's prefix scorer
weighs the same own-cache prefix against queue depth); cache-greedy (the best blend score,
load breaks ties: the router before issue 31); ours (the router's default
`blend_router.policy.RoutingPolicy`: the predicted wait plus the request's own predicted
service, weighted by the requests queuing behind it, the prompts waiting at an instance
counted as held there).

Per cell and policy: mean and p99 time to first token past the first 10% of requests
(caches filling), the share of prompt tokens reused (not recomputed: own L1 and peers) and
of them from the instance's own L1, and the largest share of requests one instance served.
A PNG of TTFT against load per policy (`--plot`, needs matplotlib: the `bench` extra).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_rag import load_musique, prompt
from benchmarks.common import machine_description
from benchmarks.musique_data import MUSIQUE_DATA_DIR
from benchmarks.routing_sim import (
    POLICIES,
    Rates,
    Served,
    Simulation,
    arrivals,
    policies,
    round_robin,
    summary,
)
from blend_router.policy import RoutingPolicy

WORKLOADS = ["uniform", "hot"]
ORDERS = 4  # passage orders per question: the retriever's and 3 others
DEFAULT_PLOT = Path(__file__).resolve().parents[1] / "docs" / "bench_routing_ttft.png"


class Prompts:
    """MuSiQue prompts: (question, order) -> tokens, built once and shared by reference."""

    def __init__(self, data: Path, questions: int) -> None:
        self.system, self.questions = load_musique(data)
        self.questions = self.questions[:questions]
        self._built: dict[tuple[int, int, int], np.ndarray] = {}

    def get(self, passages_of: int, order: int, question_of: int) -> np.ndarray:
        key = (passages_of, order, question_of)
        if key not in self._built:
            passages = self.questions[passages_of].passages
            ranked = (np.arange(len(passages)) if order == 0 else
                      np.random.default_rng(1000 * passages_of + order).permutation(
                          len(passages)))
            self._built[key] = prompt(self.system, [passages[j] for j in ranked],
                                      self.questions[question_of].question)
        return self._built[key]

    def workload(self, name: str, count: int, seed: int) -> list[np.ndarray]:
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(count):
            q, order = int(rng.integers(len(self.questions))), int(rng.integers(ORDERS))
            if name == "hot" and rng.random() < 0.5:
                out.append(self.get(0, order, q))
            else:
                out.append(self.get(q, order, q))
        return out


def run_cell(prompts: list[np.ndarray], instances: int, rate: float, args, policy_fn
             ) -> tuple[list[Served], Simulation]:
    sim = Simulation(instances, args.l1_chunks, args.chunk_size, Rates())
    requests = arrivals(prompts, rate, args.chunk_size, args.seed)
    return sim.run(requests, policy_fn), sim


def capacity(prompts: list[np.ndarray], instances: int, args) -> float:
    """Requests/s the fleet serves at round-robin's cost per request (module docstring)."""
    rates = Rates()
    no_reuse = instances * rates.capacity_per_instance(float(np.mean([len(p) for p in prompts])))
    served, _ = run_cell(prompts, instances, 0.5 * no_reuse, args, round_robin)
    kept = [s for s in served if s.n >= len(prompts) // 10]
    return instances / float(np.mean([s.gpu_s for s in kept]))


def ours_policy(args) -> RoutingPolicy:
    """Ours: the router's policy with this run's weight and bound, predicting service at the
    simulated GPUs' rates (the router's defaults)."""
    return RoutingPolicy(rates=Rates().service, delay_weight=args.delay_weight,
                         max_imbalance=None if args.max_imbalance < 0 else args.max_imbalance)


def run_all(args) -> dict:
    source = Prompts(args.data, args.questions)
    ours = ours_policy(args)
    table = {}
    for workload in WORKLOADS:
        prompts = source.workload(workload, args.requests, args.seed)
        for instances in args.instances:
            cap = capacity(prompts, instances, args)
            for load in args.loads:
                for name, policy_fn in policies(ours).items():
                    if name not in args.policies:
                        continue
                    started = time.perf_counter()
                    served, _ = run_cell(prompts, instances, load * cap, args, policy_fn)
                    row = summary(served, len(prompts) // 10)
                    row["capacity"] = cap
                    table[workload, instances, load, name] = row
                    if args.verbose:
                        print(f"# {workload} {instances} {load} {name}: "
                              f"{time.perf_counter() - started:.1f} s", flush=True)
    return table


def print_table(table: dict, args) -> None:
    print("| workload | instances | load | policy | mean TTFT ms | p99 TTFT ms | reused | "
          "of it own L1 | busiest instance |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (workload, instances, load, name), row in table.items():
        print(f"| {workload} | {instances} | {load:.0%} | {name} | {1000 * row['mean']:.0f} | "
              f"{1000 * row['p99']:.0f} | {row['reused']:.1%} | {row['local']:.1%} | "
              f"{row['max_share']:.1%} |")
    print()
    cells = sorted({key[:3] for key in table})
    if not {"ours", "cache-greedy"} <= set(args.policies):
        return
    wins = reuse_kept = 0
    for cell in cells:
        rows = {name: table[(*cell, name)] for name in args.policies}
        best = all(rows["ours"][m] <= min(r[m] for r in rows.values()) for m in ("mean", "p99"))
        wins += best
        kept = rows["ours"]["reused"] / rows["cache-greedy"]["reused"]
        reuse_kept += kept >= 0.9
        print(f"- {cell[0]}, {cell[1]} instances, {cell[2]:.0%}: ours lowest mean and p99: "
              f"{'yes' if best else 'no'}; reuse {kept:.1%} of cache-greedy's "
              f"(own L1 {rows['ours']['local'] / max(rows['cache-greedy']['local'], 1e-9):.1%})")
    print(f"\nours lowest mean and p99 TTFT in {wins} of {len(cells)} cells; >= 90% of "
          f"cache-greedy's reuse in {reuse_kept} of {len(cells)}")


def plot(table: dict, args, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install -e '.[bench]'); {path} "
              f"not written")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(WORKLOADS), len(args.instances), figsize=(
        5 * len(args.instances), 4 * len(WORKLOADS)), squeeze=False, sharex=True)
    for r, workload in enumerate(WORKLOADS):
        for c, instances in enumerate(args.instances):
            ax = axes[r][c]
            for k, name in enumerate(args.policies):
                color = f"C{k}"
                ys = [table[workload, instances, load, name] for load in args.loads]
                ax.plot(args.loads, [1000 * y["mean"] for y in ys], "o-", color=color,
                        label=f"{name} mean")
                ax.plot(args.loads, [1000 * y["p99"] for y in ys], "s--", color=color,
                        alpha=0.6, label=f"{name} p99")
            ax.set_yscale("log")
            ax.set_title(f"{workload}, {instances} instances")
            ax.set_xlabel("load (share of the fleet's capacity)")
            ax.set_ylabel("TTFT, ms")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.suptitle("bench-routing: TTFT against load (MuSiQue, Llama-3-8B on A100 rates)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_routing",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=MUSIQUE_DATA_DIR,
                        help="folder holding musique_tokens.json.gz (default: %(default)s)")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--questions", type=int, default=150,
                        help="questions used (default: all %(default)s)")
    parser.add_argument("--requests", type=int, default=1000, help="requests per cell")
    parser.add_argument("--instances", type=lambda s: [int(v) for v in s.split(",")],
                        default=[8, 32], help="fleet sizes, comma-separated (default: 8,32)")
    parser.add_argument("--loads", type=lambda s: [float(v) for v in s.split(",")],
                        default=[0.5, 0.8, 0.95],
                        help="arrival rates as shares of capacity (default: 0.5,0.8,0.95)")
    parser.add_argument("--l1-chunks", type=int, default=1250,
                        help="chunks each instance's L1 holds (default: %(default)s: 320k "
                             "tokens of 256, 40 GiB of Llama-3-8B KV)")
    default = RoutingPolicy()
    parser.add_argument("--delay-weight", type=float, default=default.delay_weight,
                        help="ours: weight of the delay a request's service causes those "
                             "queuing behind it (default: the router's, %(default)s)")
    parser.add_argument("--max-imbalance", type=int, default=-1 if default.max_imbalance is None
                        else default.max_imbalance,
                        help="ours: requests waiting above the least-loaded instance past "
                             "which an instance is not chosen; -1: no bound (default: the "
                             "router's, %(default)s)")
    parser.add_argument("--policies", type=lambda s: s.split(","), default=POLICIES)
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT,
                        help="PNG to write (default: %(default)s); 'none': no plot")
    parser.add_argument("--quick", action="store_true",
                        help="a small run for tests: 30 questions, 200 requests, 4 instances, "
                             "80%% load, no plot")
    parser.add_argument("--verbose", action="store_true", help="each run's time")
    args = parser.parse_args(argv)
    if args.quick:
        args.questions, args.requests, args.instances, args.loads = 30, 200, [4], [0.8]
        args.plot = Path("none")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    print(f"# bench-routing: MuSiQue ({args.questions} questions), {args.requests} requests "
          f"per cell, chunk {args.chunk_size}, L1 {args.l1_chunks} chunks per instance, "
          f"ours {ours_policy(args)}, "
          f"seed {args.seed}; {machine_description()}", flush=True)
    table = run_all(args)
    print()
    print_table(table, args)
    if str(args.plot) != "none":
        plot(table, args, args.plot)
    print(f"\n# {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
