"""The choice of instance for one request: the coordinator's score minus the cost of the work
already queued at each instance, within a bound on imbalance (docs/DESIGN.md, "Routing").

`choose_instance` is the router's one call into the policy (blend_router/app.py): the rest
of the router neither ranks nor balances. `make bench-routing` runs this same function in
its queueing simulation (benchmarks/routing_sim.py), with other `LoadCost`s for the
baselines.

The estimate, in prompt tokens (a token to prefill is the unit of work):

    cost(i) = (request_tokens - score(i))                   this request's own prefill at i
            + queued_weight * (prefill_tokens(i)            the prefill queued before it
                               + per_request_tokens * prefilling(i))   and those requests' decode

where `prefilling(i)` counts the requests this router sent to i that have not had their
first piece back (queued or in prefill) and `prefill_tokens(i)` their tokens to prefill
(`Fleet`). The instance with the lowest cost wins, among those with at most `max_imbalance`
more requests prefilling than the least; ties go to fewer requests in flight, then
round-robin. With no score every instance's own prefill is the whole request, so the choice
is by load alone. `queued_weight` < 1 leans to reuse: a token this request recomputes is
work the whole fleet does, a token queued ahead of it only delays it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

from blend_router.fleet import Fleet
from blend_wire import BlendScoreReply


@dataclass(frozen=True)
class LoadCost:
    """How much queued work weighs against reuse. The defaults are the router's (and
    `--inflight-cost`, `--max-imbalance`), tuned in `make bench-routing`'s simulation."""

    #: Tokens one request waiting for its first piece costs its instance beyond its prefill:
    #: its decode, which shares the GPU with the next prefill.
    per_request_tokens: float = 512.0
    #: Weight of a token queued for prefill at an instance against one of this request's own.
    queued_weight: float = 0.25
    #: An instance with more than this many requests prefilling above the least-loaded one
    #: is not chosen, whatever its score (None: no bound).
    max_imbalance: int | None = 8

    def __post_init__(self) -> None:
        if not 0 <= self.per_request_tokens < float("inf") or \
                not 0 <= self.queued_weight < float("inf"):
            raise ValueError("per_request_tokens and queued_weight must be finite and >= 0")
        if self.max_imbalance is not None and self.max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {self.max_imbalance}")


#: Today's policy before load-aware routing: the best score wins, load only breaks ties.
CACHE_GREEDY = LoadCost(per_request_tokens=0.0, queued_weight=0.0, max_imbalance=None)

_turns: Iterator[int] = itertools.count()


def choose_instance(fleet: Fleet, scores: BlendScoreReply | None, *, unscored_reason: str,
                    request_tokens: int, cost: LoadCost = LoadCost()
                    ) -> tuple[str | None, str, int]:
    """`(instance, reason, prefill_tokens)`: the instance to send to (None: no instance
    known), the `X-Route-Reason` naming why, and the tokens it is expected to prefill (the
    request's tokens less its score there: what `Fleet.begin` counts as queued). `scores`
    is None when the request was not scored, for `unscored_reason` (`unscored`,
    `coordinator-unavailable`); `request_tokens` is the prompt's length (0 when unknown)."""
    ids = list(fleet.urls)
    if not ids:
        return None, unscored_reason, 0
    score = {} if scores is None else {s.instance_id: s.score for s in scores.instances}
    requests, waiting, queued = fleet.in_flight, fleet.prefilling, fleet.prefill_tokens
    if cost.max_imbalance is not None:
        bound = min(waiting.get(i, 0) for i in ids) + cost.max_imbalance
        ids = [i for i in ids if waiting.get(i, 0) <= bound]
    start = next(_turns) % len(ids)  # round-robin among equals: start the scan in turn
    ids = ids[start:] + ids[:start]

    def estimate(i: str) -> tuple[float, int]:
        own = max(request_tokens - score.get(i, 0.0), 0.0)
        ahead = queued.get(i, 0) + cost.per_request_tokens * waiting.get(i, 0)
        return own + cost.queued_weight * ahead, requests.get(i, 0)

    chosen = min(ids, key=estimate)
    best = max((score.get(i, 0.0) for i in fleet.urls), default=0.0)
    if scores is None:
        reason = unscored_reason
    elif best <= 0:
        reason = "nothing-cached"
    else:  # "load": a better-scored instance was passed over for the work queued there
        reason = "score" if score.get(chosen, 0.0) >= best else "load"
    return chosen, reason, int(round(max(request_tokens - score.get(chosen, 0.0), 0.0)))
