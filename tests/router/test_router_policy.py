"""The router's choice of instance (`blend_router.policy.choose_instance`) on scores and
load set by hand: what an operator relies on, not the weights' values."""

from __future__ import annotations

import pytest

from blend_router.__main__ import build_parser, routing_policy
from blend_router.fleet import Fleet
from blend_router.policy import CACHE_GREEDY, RoutingPolicy, ServiceRates, choose_instance
from blend_wire import BlendScoreReply, InstanceScore

LANE = "unit"

TOKENS = 8192


def fleet_of(*ids: str) -> Fleet:
    fleet = Fleet()
    fleet.urls = {i: f"http://127.0.0.1:{8000 + n}" for n, i in enumerate(ids)}
    return fleet


def reply(**held: dict) -> BlendScoreReply:
    """Scores: per instance its split (prefix, l1, shared, peer tokens), score as the
    coordinator's default weights give it."""
    rows = []
    for instance, split in held.items():
        prefix, l1, shared, peer = (split.get(k, 0) for k in ("prefix", "l1", "shared", "peer"))
        rows.append(InstanceScore(instance_id=instance, prefix_tokens=prefix, l1_tokens=l1,
                                  shared_tokens=shared, peer_tokens=peer,
                                  score=prefix + l1 + 0.5 * shared + 0.25 * peer))
    return BlendScoreReply(chunk_size=256, instances=rows)


def choose(fleet, scores, policy=RoutingPolicy()):
    return choose_instance(fleet, scores, unscored_reason="unscored", request_tokens=TOKENS,
                           policy=policy)


# A holds 6,144 of the request's tokens as its prefix; B and C would load them from A.
HELD = reply(A={"prefix": 6144}, B={"peer": 6144}, C={"peer": 6144})


def test_with_equal_load_the_request_goes_where_its_kv_is():
    for _ in range(3):  # whichever instance the round-robin scan starts at
        instance, reason, service_s = choose(fleet_of("A", "B", "C"), HELD)
        assert (instance, reason) == ("A", "score")
        # Its predicted service there: the 2,048 tokens it recomputes and the prefix loaded.
        assert service_s == pytest.approx(2048 / 10_000 + 6144 / 190_000)


def test_a_queue_that_makes_the_holder_slower_sends_the_request_elsewhere():
    fleet = fleet_of("A", "B", "C")
    ahead = [fleet.begin("A", 0.8) for _ in range(3)]  # loading from A at B beats waiting
    instance, reason, _ = choose(fleet, HELD)
    assert (instance, reason) in (("B", "load"), ("C", "load"))
    for request in ahead:  # their first pieces back, A's queue is empty: the KV wins again
        fleet.first_piece(request)
    assert choose(fleet, HELD)[:2] == ("A", "score")
    # The same with the request's own time to first token alone (no delay weight): one
    # short request ahead leaves A the soonest, three long ones do not.
    fleet.begin("A", 0.01)
    assert choose(fleet, HELD, RoutingPolicy(delay_weight=0.0))[0] == "A"
    for _ in range(3):
        fleet.begin("A", 0.8)
    assert choose(fleet, HELD, RoutingPolicy(delay_weight=0.0))[0] != "A"


def test_with_no_delay_weight_the_choice_is_the_soonest_predicted_first_token():
    fleet = fleet_of("A", "B", "C")
    scores = reply(A={"prefix": 4096}, B={"l1": 6144}, C={"peer": 8192})
    fleet.begin("B", 0.3)
    rates, policy = ServiceRates(), RoutingPolicy(delay_weight=0.0)
    predicted = {}
    for row in scores.instances:
        wait = fleet.queued_s.get(row.instance_id, 0.0) + \
            rates.decode_s * fleet.prefilling.get(row.instance_id, 0)
        predicted[row.instance_id] = wait + rates.service_s(TOKENS, row)
    assert choose(fleet, scores, policy)[0] == min(predicted, key=predicted.get)


def test_a_busy_fleet_weighs_reuse_more():
    # Idle, B's peer load is the sooner first token; with requests queued everywhere, A's
    # cheaper service (its own L1) is worth the longer wait: it delays those behind less.
    scores = reply(A={"prefix": 7680}, B={"peer": 7680})
    idle = fleet_of("A", "B")
    idle.begin("A", 0.25)
    assert choose(idle, scores)[0] == "B"
    busy = fleet_of("A", "B")
    for _ in range(4):
        busy.begin("B", 0.2)
    for _ in range(5):
        busy.begin("A", 0.2)
    assert choose(busy, scores, RoutingPolicy(delay_weight=0.0))[0] == "B"
    assert choose(busy, scores)[0] == "A"


def test_cache_greedy_ignores_load():
    fleet = fleet_of("A", "B")
    for _ in range(50):
        fleet.begin("A", 1.0)
    assert choose(fleet, HELD, CACHE_GREEDY)[:2] == ("A", "score")


def test_unscored_requests_go_where_least_work_is_queued():
    fleet = fleet_of("A", "B", "C")
    fleet.begin("A", 0.5)
    fleet.begin("B", 0.2)
    instance, reason, service_s = choose_instance(
        fleet, None, unscored_reason="coordinator-unavailable", request_tokens=TOKENS)
    assert (instance, reason) == ("C", "coordinator-unavailable")
    assert service_s == pytest.approx(TOKENS / 10_000)
    assert choose_instance(fleet_of(), None, unscored_reason="unscored",
                           request_tokens=TOKENS) == (None, "unscored", 0.0)


def test_the_imbalance_bound_excludes_the_busiest():
    fleet = fleet_of("A", "B")
    for _ in range(3):
        fleet.begin("A", 0.0)
    assert choose(fleet, HELD, CACHE_GREEDY)[0] == "A"
    assert choose(fleet, HELD, RoutingPolicy(max_imbalance=2))[0] == "B"


def test_the_flags_set_the_rates_and_refuse_nonsense():
    args = build_parser().parse_args(["--coordinator-url", "http://127.0.0.1:1",
                                      "--prefill-rate", "20000", "--peer-load-rate", "50000",
                                      "--decode-cost", "0.02", "--delay-weight", "1",
                                      "--max-imbalance", "3"])
    policy = routing_policy(args)
    assert policy.rates == ServiceRates(prefill_tokens_s=20000, peer_load_tokens_s=50000,
                                        decode_s=0.02)
    assert (policy.delay_weight, policy.max_imbalance, policy.load_aware) == (1.0, 3, True)
    default = routing_policy(build_parser().parse_args(["--coordinator-url", "http://x:1"]))
    assert default == RoutingPolicy()
    greedy = build_parser().parse_args(["--coordinator-url", "http://x:1", "--cache-greedy"])
    assert routing_policy(greedy).load_aware is False
    for flag, value in (("--prefill-rate", "0"), ("--blend-recompute", "1.5"),
                        ("--decode-cost", "-1"), ("--delay-weight", "nan")):
        with pytest.raises(ValueError):
            routing_policy(build_parser().parse_args(
                ["--coordinator-url", "http://x:1", flag, value]))


def test_a_prompt_waiting_at_an_instance_counts_as_held_there_within_its_namespace():
    # Nobody holds the document yet; one request for it waits at B. The next one for it
    # goes to B, which will hold it once that prefill is stored: a wait of one prefill
    # there beats a whole prefill anywhere else. Another tenant's copy of the same text
    # does not count (its salt is part of the hash).
    import numpy as np

    from blend_router.policy import chunk_hashes
    prompt = np.arange(TOKENS, dtype=np.uint32)
    mine, theirs = (chunk_hashes(prompt, 256, f"model\0{salt}") for salt in ("a", "b"))
    nothing = reply(A={}, B={}, C={})
    fleet = fleet_of("A", "B", "C")
    first = fleet.begin("B", TOKENS / 10_000, mine)
    assert choose_instance(fleet, nothing, unscored_reason="unscored", request_tokens=TOKENS,
                           chunks=mine)[0] == "B"
    assert choose_instance(fleet, nothing, unscored_reason="unscored", request_tokens=TOKENS,
                           chunks=theirs)[0] != "B"
    assert choose_instance(fleet, nothing, unscored_reason="unscored",
                           request_tokens=TOKENS)[0] != "B"
    fleet.first_piece(first)  # stored now: the coordinator's score says so from here on
    assert fleet.waiting["B"] == []
