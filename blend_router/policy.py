"""The choice of instance for one request: where its first token is predicted to come
soonest, counting the delay its service causes the requests that queue behind it, from
the coordinator's scores and the work queued at each instance (docs/DESIGN.md, "Routing").

`choose_instance` is the router's one call into the policy (blend_router/app.py): the rest
of the router neither ranks nor balances. `make bench-routing` runs this same function in
its queueing simulation (benchmarks/routing_sim.py), whose GPUs serve at the same
`ServiceRates` the router predicts with by default.

The estimate, in seconds, for instance i:

    cost(i) = queued_s(i) + decode_s * waiting(i)       the wait: service and decode ahead
            + (1 + delay_weight * behind(i)) * service_s(i)   this request's own service

`waiting(i)` counts the requests this router sent to i that have not had their first
piece back (queued or in prefill), `queued_s(i)` their predicted service (`Fleet`), and
`decode_s` the GPU time each one's decode then takes from the next prefill. `service_s(i)`
is the request's prefill of the tokens it recomputes at i plus the loading of those it
reuses from where they are: its prefix and own-L1 chunks at the L1 rate, shared-tier and
peer chunks at theirs, CacheBlend recomputing a share of every reused non-prefix token (the
score's split: `prefix_tokens`, `l1_tokens`, `shared_tokens`, `peer_tokens`), and the
leading chunks it shares with a request still waiting at i (`chunk_hashes`, same model and
salt) counted as i's prefix: that one's prefill will have stored them by the time this one
is served, which the coordinator cannot know yet. With `delay_weight` 0 the cost is the
request's predicted time to first token. Each second of
its service also delays the requests that will queue behind it at i; `behind(i)`, the
requests waiting at i plus those waiting per instance across the fleet, stands for how
many: idle, the choice is the request's own fastest first token; busy, reuse weighs more
(work the fleet does not do), and most at the busiest instances, which keeps long
recomputations off the queues of cheap, well-reused requests. The instance with the
lowest cost wins, among those with at most `max_imbalance` more requests waiting than the
least (no bound by default); ties go to fewer requests in flight, then round-robin. With no
score every instance's service is the whole prefill, so the choice is by load alone.
`CACHE_GREEDY` (`--cache-greedy`) is the router before load-aware routing: the best score
wins, load only breaks ties.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from blend_router.fleet import Fleet
from blend_wire import BlendScoreReply, InstanceScore


@dataclass(frozen=True)
class ServiceRates:
    """One instance's speeds, for predicting a request's service there. Defaults: Llama-3-8B
    on one A100-SXM 80 GB (`--prefill-rate`, ... ; where each figure comes from:
    benchmarks/routing_sim.py's docstring, the simulation's GPUs)."""

    #: Prompt tokens prefilled per second.
    prefill_tokens_s: float = 10_000.0
    #: Tokens of KV loaded per second from the instance's own CPU L1 (PCIe).
    l1_load_tokens_s: float = 190_000.0
    #: ... from a shared tier, and from a peer's L1 (both over a 100 Gb/s network).
    shared_load_tokens_s: float = 95_000.0
    peer_load_tokens_s: float = 95_000.0
    #: Share of reused non-prefix tokens CacheBlend recomputes.
    blend_recompute: float = 0.15
    #: GPU seconds one request's decode takes from the next prefill: 64 output tokens at
    #: 40 tokens/s in a batch of 32.
    decode_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_s", "l1_load_tokens_s", "shared_load_tokens_s",
                     "peer_load_tokens_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number of tokens/s > 0, got "
                                 f"{getattr(self, name)}")
        if not 0 <= self.blend_recompute <= 1:
            raise ValueError(f"blend_recompute must be in [0, 1], got {self.blend_recompute}")
        if not 0 <= self.decode_s < math.inf:
            raise ValueError(f"decode_s must be finite seconds >= 0, got {self.decode_s}")

    def service_s(self, tokens: int, reuse: InstanceScore | None) -> float:
        """Seconds from a request's service start to its first token at an instance that
        reuses `reuse` of its `tokens` (None: nothing)."""
        if reuse is None:
            return tokens / self.prefill_tokens_s
        blended = reuse.l1_tokens + reuse.shared_tokens + reuse.peer_tokens
        recomputed = max(tokens - reuse.prefix_tokens - blended, 0)
        return ((recomputed + self.blend_recompute * blended) / self.prefill_tokens_s
                + (reuse.prefix_tokens + reuse.l1_tokens) / self.l1_load_tokens_s
                + reuse.shared_tokens / self.shared_load_tokens_s
                + reuse.peer_tokens / self.peer_load_tokens_s)


@dataclass(frozen=True)
class RoutingPolicy:
    """How the choice weighs queued work against reuse. The defaults are the router's
    (`--prefill-rate` ..., `--delay-weight`, `--max-imbalance`, `--cache-greedy`), chosen
    in `make bench-routing`'s simulation."""

    rates: ServiceRates = field(default_factory=ServiceRates)
    #: Each second of this request's service at i also delays the requests that will
    #: queue behind it there: its service counts `1 + delay_weight * w` times, w the
    #: requests waiting at i now plus those waiting per instance across the fleet (0: this
    #: request's own time to first token only).
    delay_weight: float = 4.0
    #: An instance with more than this many requests prefilling above the least-loaded one
    #: is not chosen, whatever its prediction (None: no bound).
    max_imbalance: int | None = None
    #: False: cache-greedy, the router before load-aware routing: the best score wins, load
    #: only breaks ties (the other fields are not used).
    load_aware: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.delay_weight < math.inf:
            raise ValueError(f"delay_weight must be finite and >= 0, got {self.delay_weight}")
        if self.max_imbalance is not None and self.max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {self.max_imbalance}")


#: The router before load-aware routing: the best score wins, load only breaks ties.
CACHE_GREEDY = RoutingPolicy(load_aware=False)

_turns: Iterator[int] = itertools.count()
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd, 64-bit: the chunk hash's polynomial base


def chunk_hashes(tokens: np.ndarray, chunk_size: int, namespace: str = "") -> np.ndarray:
    """One 64-bit hash per whole chunk of `tokens` (a polynomial of its ids, wrapping, mixed
    with the `namespace`: model and salt, so another tenant's prompt never matches), to
    compare prompts' leading chunks in the router: not LMCache's keys."""
    whole = tokens[:tokens.size // chunk_size * chunk_size].astype(np.uint64)
    if not whole.size:
        return whole
    powers = np.cumprod(np.full(chunk_size, _MULTIPLIER, np.uint64), dtype=np.uint64)
    salt = np.uint64(int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=8)
                                    .digest(), "little"))
    return (whole.reshape(-1, chunk_size) @ powers) ^ salt



def _pending_prefix(fleet: Fleet, instance: str, chunks: np.ndarray) -> int:
    """Leading chunks of `chunks` that a request waiting at `instance` starts with too:
    what it will hold once that one's prefill is stored."""
    best = 0
    for other in fleet.waiting.get(instance, ()):
        n = min(other.chunks.size, chunks.size)
        if n > best:
            differ = np.flatnonzero(other.chunks[:n] != chunks[:n])
            best = max(best, n if differ.size == 0 else int(differ[0]))
    return best


def _with_pending(reuse: InstanceScore | None, pending_tokens: int, instance: str
                  ) -> InstanceScore | None:
    """`reuse` with its prefix grown to `pending_tokens`. Which of its blended chunks the
    longer prefix covers the score does not say: the slowest to load (peers', then the
    shared tier's) are taken first, the estimate's optimistic side."""
    prefix = 0 if reuse is None else reuse.prefix_tokens
    if pending_tokens <= prefix:
        return reuse
    more = pending_tokens - prefix
    l1, shared, peer = (0, 0, 0) if reuse is None else \
        (reuse.l1_tokens, reuse.shared_tokens, reuse.peer_tokens)
    peer_less = min(peer, more)
    shared_less = min(shared, more - peer_less)
    l1_less = min(l1, more - peer_less - shared_less)
    return InstanceScore(instance_id=instance, prefix_tokens=pending_tokens,
                         l1_tokens=l1 - l1_less, shared_tokens=shared - shared_less,
                         peer_tokens=peer - peer_less, score=0.0 if reuse is None else reuse.score)


def choose_instance(fleet: Fleet, scores: BlendScoreReply | None, *, unscored_reason: str,
                    request_tokens: int, policy: RoutingPolicy = RoutingPolicy(),
                    chunks: np.ndarray | None = None
                    ) -> tuple[str | None, str, float]:
    """`(instance, reason, service_s)`: the instance to send to (None: no instance known),
    the `X-Route-Reason` naming why, and the request's predicted service there in seconds
    (what `Fleet.begin` counts as queued). `scores` is None when the request was not
    scored, for `unscored_reason` (`unscored`, `coordinator-unavailable`);
    `request_tokens` is the prompt's length (0 when unknown); `chunks` its `chunk_hashes`
    (None: the prompts waiting at each instance are not compared with it)."""
    ids = list(fleet.urls)
    if not ids:
        return None, unscored_reason, 0.0
    reuse = {} if scores is None else {s.instance_id: s for s in scores.instances}
    requests, waiting, queued = fleet.in_flight, fleet.prefilling, fleet.queued_s
    if policy.load_aware and policy.max_imbalance is not None:
        bound = min(waiting.get(i, 0) for i in ids) + policy.max_imbalance
        ids = [i for i in ids if waiting.get(i, 0) <= bound]
    start = next(_turns) % len(ids)  # round-robin among equals: start the scan in turn
    ids = ids[start:] + ids[:start]
    rates = policy.rates
    per_instance = sum(waiting.get(i, 0) for i in fleet.urls) / len(fleet.urls)

    def service(i: str) -> float:
        held = reuse.get(i)
        if chunks is not None and scores is not None:
            held = _with_pending(held, _pending_prefix(fleet, i, chunks) * scores.chunk_size, i)
        return rates.service_s(request_tokens, held)

    def predicted(i: str) -> tuple[float, int]:
        if not policy.load_aware:
            return -_score(reuse.get(i)), requests.get(i, 0)
        ahead = queued.get(i, 0.0) + rates.decode_s * waiting.get(i, 0)
        behind = per_instance + waiting.get(i, 0)
        return ahead + (1 + policy.delay_weight * behind) * service(i), requests.get(i, 0)

    chosen = min(ids, key=predicted)
    best = max((_score(reuse.get(i)) for i in fleet.urls), default=0.0)
    if scores is None:
        reason = unscored_reason
    elif best <= 0:
        reason = "nothing-cached"
    else:  # "load": a better-scored instance was passed over for the work queued there
        reason = "score" if _score(reuse.get(chosen)) >= best else "load"
    return chosen, reason, service(chosen)


def _score(reuse: InstanceScore | None) -> float:
    return 0.0 if reuse is None else reuse.score
