"""`make bench-routing`'s queueing simulation on inputs small enough to reason about: what it
must show when it works (load-blind policies pile up, reuse is counted where it happens),
not its figures."""

from __future__ import annotations

import numpy as np

from benchmarks import bench_routing
from benchmarks.routing_sim import (
    Rates,
    Simulation,
    arrivals,
    least_loaded,
    policies,
    round_robin,
    router,
    summary,
)
from blend_router.policy import CACHE_GREEDY, RoutingPolicy

LANE = "unit"

C = 256
rng = np.random.default_rng(31)


def tokens(n: int) -> np.ndarray:
    return rng.integers(1000, 60000, n).astype(np.uint32)


def run(prompts, instances: int, rate: float, policy):
    sim = Simulation(instances, l1_chunks=1000, chunk_size=C, rates=Rates())
    return summary(sim.run(arrivals(prompts, rate, C, seed=5), policy), warmup=0)


def test_least_loaded_beats_round_robin_when_sizes_follow_the_turn():
    # Long and short prompts alternate: round-robin sends every long one to instance 0,
    # busy all the time at this rate, while the fleet has a third of its time to spare.
    prompts = [tokens(8192) if n % 2 == 0 else tokens(C) for n in range(200)]
    rr = run(prompts, 2, 2.3, round_robin)
    ll = run(prompts, 2, 2.3, least_loaded)
    assert ll["p99"] < 0.7 * rr["p99"]
    assert rr["reused"] == ll["reused"] == 0  # nothing repeats: nothing to reuse


def test_a_policy_that_ignores_load_piles_up_and_ours_does_not():
    # One instance serves the document first; then it is in every request, 15 a second:
    # more than one instance can serve even with all of it reused (~0.1 s each).
    document = tokens(16 * C)
    prompts = [np.concatenate([document, tokens(C)]) for _ in range(300)]

    def after_the_first(policy):
        requests = arrivals(prompts, 15.0, C, seed=5)
        for request in requests[1:]:
            request.arrival += 2.0
        sim = Simulation(4, l1_chunks=1000, chunk_size=C, rates=Rates())
        return summary(sim.run(requests, policy), warmup=1)

    greedy = after_the_first(router(CACHE_GREEDY))
    ours = after_the_first(router(RoutingPolicy()))
    assert greedy["max_share"] == 1.0  # every request to the instance holding the document
    assert ours["max_share"] < 0.6
    assert ours["p99"] < greedy["p99"] / 5 and ours["mean"] < greedy["mean"] / 5
    # Both reuse the document: most of each prompt.
    assert greedy["reused"] > 0.9 and ours["reused"] > 0.85


def test_reuse_is_counted_on_the_serving_instance():
    document = tokens(8 * C)
    sim = Simulation(2, l1_chunks=1000, chunk_size=C, rates=Rates())
    requests = arrivals([document, document], 0.01, C, seed=1)  # far apart: no queueing
    served = sorted(sim.run(requests, round_robin), key=lambda s: s.n)
    assert [s.instance for s in served] == [0, 1]
    assert served[0].reused == 0
    # Instance 1 reads the document from its peer: reused, not from its own L1.
    assert served[1].reused == 8 * C and served[1].local == 0
    assert served[1].ttft < served[0].ttft
    again = Simulation(2, l1_chunks=1000, chunk_size=C, rates=Rates())
    local = sorted(again.run(arrivals([document, document], 0.01, C, seed=1),
                             router(CACHE_GREEDY)), key=lambda s: s.n)
    assert [s.instance for s in local][1] == local[0].instance
    assert local[1].local == 8 * C and local[1].ttft < served[1].ttft


def test_an_l1_keeps_only_its_capacity():
    sim = Simulation(1, l1_chunks=4, chunk_size=C, rates=Rates())
    first, second = tokens(4 * C), tokens(4 * C)
    served = sorted(sim.run(arrivals([first, second, first], 0.01, C, seed=1), round_robin),
                    key=lambda s: s.n)
    assert [s.reused for s in served] == [0, 0, 0]  # `second` evicted `first`
    assert len(sim.instances[0].l1) == 4


def test_the_quick_run_prints_every_policy(capsys):
    assert bench_routing.main(["--quick"]) == 0
    out = capsys.readouterr().out
    for name in policies(RoutingPolicy()):
        assert f"| {name} |" in out
    assert "ours lowest mean and p99 TTFT in" in out


def test_prefix_only_weighs_its_prefix_against_queued_prefill_and_kv_as_dynamo_does():
    # Dynamo's cost: overlap_weight * (prefill queued + this one's uncached tokens) + the KV
    # of the requests in flight: the holder of the prefix wins idle, loses once the work
    # queued there outweighs the prefix.
    document = tokens(8 * C)
    sim = Simulation(2, l1_chunks=1000, chunk_size=C, rates=Rates())
    sim.run(arrivals([document], 0.01, C, seed=1), round_robin)  # instance 0 holds it
    request = arrivals([np.concatenate([document, tokens(C)])], 0.01, C, seed=1)[0]
    choose = policies(RoutingPolicy())["prefix-only"]
    index, _, prefill = choose(sim, request, 0)
    assert (index, prefill) == (0, C)  # only the tokens past its cached prefix
    sim.prefill_pending[0] = 4 * C  # queued prefill still below the 8 chunks it saves
    assert choose(sim, request, 0)[0] == 0
    sim.kv_tokens[0] = 5 * C  # with the KV in flight there, more than it saves
    assert choose(sim, request, 0)[0] == 1
