"""A discrete-event queueing simulation of a fleet behind the router (`make bench-routing`).

Deterministic for a seed, in process. Each policy routes the same arrivals; what each
instance holds comes from the simulation itself: every instance has an L1 of
`l1_chunks` chunks (LRU); when a request's prefill ends, its chunks (named as LMCache names
them) are stored in the serving instance's L1 and reported, evictions too, to an in-process
coordinator (`coordinator_stub.service.Coordinator`, the same directory, content index and
`/directory/blend-score` code the coordinator process runs). The router's policies are
called as the router calls them (`blend_router.policy.choose_instance` on the coordinator's
`BlendScoreReply` and a `blend_router.fleet.Fleet` kept by the same begin / first piece /
end hooks), so ours and cache-greedy are the router's own code, not a re-derivation.
Prefix-only (Dynamo's KV router cost) keeps the load its own way: the tokens to prefill and
the KV in flight per instance.

The service model (one instance = one GPU, one FCFS server of GPU time):

- a request's reuse is what the coordinator scores for the serving instance when its
  service starts (`prefix_tokens`, `l1_tokens`, `peer_tokens`; this fleet has no shared
  tier); its first token comes after
  `prefill(recomputed + BLEND_RECOMPUTE * non-prefix reused) + load(own L1) + load(peers)`;
- then the GPU spends the request's share of batched decode (`output_tokens` at
  `decode_tokens_s` each, `decode_batch` requests decoding together) before the next
  request's prefill starts; the router sees the stream end `output_tokens /
  decode_tokens_s` after the first token.

Rates, Llama-3-8B on one A100-SXM 80 GB (`Rates`; the service figures are
`blend_router.policy.ServiceRates`, the router's defaults, so ours predicts with the
simulated GPUs' own rates): prefill 10,000 tokens/s (2 x 8.0e9 FLOP
per token, the 2N rule of Kaplan et al. 2020, at ~50% of the A100's 312 TFLOPS dense BF16
from NVIDIA's A100 datasheet); KV 128 KiB per token (Llama-3-8B's config.json: 32 layers x 8
KV heads x 128 dims x K and V x 2 bytes), loaded from the instance's CPU L1 over PCIe 4.0 x16
(~25 GB/s of its 32: ~190,000 tokens/s) and from a peer over 100 Gb/s (12.5 GB/s: ~95,000
tokens/s; a shared tier, which this fleet has not, over the same network); CacheBlend recomputes 15% of reused non-prefix tokens (its paper's operating
point, Yao et al., EuroSys 2025); decode 40 tokens/s per request in a batch of 32 (25 ms per
step, vLLM's range for an 8B model at that batch on an A100), 64 output tokens (MuSiQue's
answers are a few words).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from blend_router.fleet import Fleet, InFlight
from blend_router.policy import (
    CACHE_GREEDY,
    RoutingPolicy,
    ServiceRates,
    chunk_hashes,
    choose_instance,
)
from blend_wire import (
    BlendScoreReply,
    BlendScoreRequest,
    EventsRequest,
    InstanceScore,
    RegisterRequest,
    decode,
    encode,
    encode_tokens,
    pack_kv_rank,
    prefix_chunk_hashes,
)
from coordinator_stub.config import CoordinatorConfig
from coordinator_stub.service.coordinator import Coordinator

MODEL = "musique"
POLICIES = ["round-robin", "least-loaded", "prefix-only", "cache-greedy", "ours"]


@dataclass(frozen=True)
class Rates:
    """One instance's speeds (the module docstring says where each comes from): the
    router's `ServiceRates` (prefill, loads, CacheBlend's recompute; the same figures are
    the router's defaults) and the decode they share the GPU with."""

    service: ServiceRates = field(default_factory=ServiceRates)
    output_tokens: int = 64
    decode_tokens_s: float = 40.0
    decode_batch: int = 32

    def __post_init__(self) -> None:
        if abs(self.service.decode_s - self.decode_gpu_s) > 1e-9:
            raise ValueError(f"service.decode_s {self.service.decode_s} is not the decode's "
                             f"GPU time {self.decode_gpu_s}")

    def first_token_s(self, tokens: int, s: InstanceScore | None) -> float:
        """Seconds from service start to the first token, with `s`'s reuse."""
        return self.service.service_s(tokens, s)

    @property
    def decode_gpu_s(self) -> float:
        """GPU seconds a request's decode takes from the next prefill (its batch share)."""
        return self.output_tokens / (self.decode_tokens_s * self.decode_batch)

    @property
    def stream_s(self) -> float:
        return self.output_tokens / self.decode_tokens_s

    def capacity_per_instance(self, mean_tokens: float) -> float:
        """Requests/s one instance serves with nothing reused: the load's 100%."""
        return 1.0 / (mean_tokens / self.service.prefill_tokens_s + self.decode_gpu_s)


@dataclass
class Request:
    n: int  # its place in arrival order
    arrival: float
    tokens: np.ndarray
    tokens_b64: str
    hashes: list[bytes]
    chunks: np.ndarray | None = None  # the router's chunk hashes, once it chose


@dataclass
class Served:
    """One request's outcome."""

    n: int
    ttft: float
    tokens: int
    reused: int  # not recomputed: own L1 and peers
    local: int  # of it, from the instance's own L1
    instance: int
    gpu_s: float  # GPU time it took: prefill, loads and its share of decode


@dataclass
class Instance:
    l1: OrderedDict = field(default_factory=OrderedDict)  # chunk hash -> tokens, LRU order
    queue: deque = field(default_factory=deque)
    busy: bool = False
    seq: int = 0


#: A policy: (simulation, request, its place) -> (instance index, its predicted service
#: there for the router's `Fleet`, its tokens to prefill there for Dynamo's bookkeeping).
Policy = Callable[["Simulation", Request, int], tuple[int, float, int]]


class Simulation:
    """One fleet, one policy, one arrival sequence."""

    def __init__(self, instances: int, l1_chunks: int, chunk_size: int, rates: Rates) -> None:
        self.rates, self.chunk_size, self.l1_chunks = rates, chunk_size, l1_chunks
        self.ids = [f"inst-{i}" for i in range(instances)]
        self.coordinator = Coordinator(CoordinatorConfig(
            enable_blend_lookup=True, chunk_size=chunk_size, enable_metrics=False))
        for i, name in enumerate(self.ids):
            self.coordinator.register(RegisterRequest(instance_id=name, ip="127.0.0.1",
                                                      http_port=8000 + i))
        self.fleet = Fleet()
        self.fleet.urls = {name: "" for name in self.ids}
        self.instances = [Instance() for _ in self.ids]
        #: Per instance, as Dynamo's KV router counts load: the tokens still to prefill of
        #: the requests sent there before their first token, and the KV (prompt tokens) of
        #: those in flight.
        self.prefill_pending = [0] * instances
        self.kv_tokens = [0] * instances
        self.served: list[Served] = []
        self._events: list = []
        self._order = itertools.count()
        self._version = 0  # bumped by every batch the directory applies
        #: Per request (by `n`), its last scores of every instance and the version they read.
        self._scored: dict[int, tuple[int, BlendScoreReply]] = {}

    # --- what the coordinator says ----------------------------------------------------------

    def scores(self, request: Request) -> BlendScoreReply:
        """Every instance scored, as the router asks (`POST /directory/blend-score`)."""
        reply = self.coordinator.scores(BlendScoreRequest(
            tokens_b64=request.tokens_b64, model_name=MODEL), wait=True)
        self._scored[request.n] = (self._version, reply)
        return reply

    def reuse(self, request: Request, index: int) -> InstanceScore:
        """What instance `index` reuses of `request` now (its score's split), from the
        request's last scores while the directory has not changed since."""
        version, reply = self._scored.pop(request.n, (-1, None))
        if version != self._version:
            reply = self.coordinator.scores(BlendScoreRequest(
                tokens_b64=request.tokens_b64, model_name=MODEL,
                instance_ids=[self.ids[index]]), wait=True)
        return next(s for s in reply.instances if s.instance_id == self.ids[index])

    # --- events -----------------------------------------------------------------------------

    def _at(self, time: float, action: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (time, next(self._order), action))

    def run(self, requests: list[Request], policy: Policy) -> list[Served]:
        for n, request in enumerate(requests):
            self._at(request.arrival, lambda now, r=request, n=n: self._arrive(now, r, n, policy))
        while self._events:
            time, _, action = heapq.heappop(self._events)
            action(time)
        return self.served

    def _arrive(self, now: float, request: Request, n: int, policy: Policy) -> None:
        index, service_s, prefill = policy(self, request, n)
        in_flight = self.fleet.begin(self.ids[index], service_s, request.chunks)
        self.prefill_pending[index] += prefill
        self.kv_tokens[index] += len(request.tokens)
        instance = self.instances[index]
        instance.queue.append((request, in_flight, prefill))
        if not instance.busy:
            self._start(now, index)

    def _start(self, now: float, index: int) -> None:
        instance = self.instances[index]
        if not instance.queue:
            instance.busy = False
            return
        instance.busy = True
        request, in_flight, prefill = instance.queue.popleft()
        reuse = self.reuse(request, index)
        took = self.rates.first_token_s(len(request.tokens), reuse)
        self.served.append(Served(
            request.n, now + took - request.arrival, len(request.tokens),
            reuse.prefix_tokens + reuse.l1_tokens + reuse.shared_tokens + reuse.peer_tokens,
            reuse.prefix_tokens + reuse.l1_tokens, index, took + self.rates.decode_gpu_s))
        self._at(now + took, lambda t: self._first_token(t, index, request, in_flight, prefill))

    def _first_token(self, now: float, index: int, request: Request, in_flight: InFlight,
                     prefill: int) -> None:
        self.fleet.first_piece(in_flight)
        self.prefill_pending[index] -= prefill
        self._store(index, request)
        self._at(now + self.rates.decode_gpu_s, lambda t: self._start(t, index))
        self._at(now + self.rates.stream_s, lambda t: self._end(index, request, in_flight))

    def _end(self, index: int, request: Request, in_flight: InFlight) -> None:
        self.fleet.end(in_flight)
        self.kv_tokens[index] -= len(request.tokens)

    # --- the instances' L1 -----------------------------------------------------------------

    def _store(self, index: int, request: Request) -> None:
        """The request's chunks into the instance's L1 (LRU), reported as an engine does:
        a store batch of the new chunks, a delete batch of the evicted ones."""
        l1, size = self.instances[index].l1, self.chunk_size
        stored = []
        for k, chunk_hash in enumerate(request.hashes):
            if chunk_hash in l1:
                l1.move_to_end(chunk_hash)
            else:
                l1[chunk_hash] = None
                stored.append(_entry(chunk_hash, request.tokens[k * size:(k + 1) * size],
                                     k * size))
        evicted = []
        while len(l1) > self.l1_chunks:
            chunk_hash, _ = l1.popitem(last=False)
            evicted.append(_entry(chunk_hash, None, 0))
        for event_type, entries in (("store", stored), ("delete", evicted)):
            if entries:
                self._report(index, event_type, entries)

    def _report(self, index: int, event_type: str, entries: list[dict]) -> None:
        instance = self.instances[index]
        instance.seq += 1
        body = {"batches": [{"instance_id": self.ids[index], "seq": instance.seq,
                             "event_type": event_type, "tier": "l1", "backend": "dram",
                             "entries": entries}]}
        reply = self.coordinator.directory.ingest(decode(encode(body), EventsRequest).batches)
        assert reply.applied == 1, reply
        self._version += 1


def _entry(chunk_hash: bytes, tokens: np.ndarray | None, offset: int) -> dict:
    return {"key": {"chunk_hash_hex": chunk_hash.hex(), "model_name": MODEL,
                    "kv_rank": pack_kv_rank(1)},
            "size_bytes": 1, "token_ids": [] if tokens is None else tokens.tolist(),
            "token_offset": offset}


# --- the policies -----------------------------------------------------------------------------

def round_robin(sim: Simulation, request: Request, n: int) -> tuple[int, float, int]:
    return n % len(sim.ids), sim.rates.first_token_s(len(request.tokens), None), \
        len(request.tokens)


def least_loaded(sim: Simulation, request: Request, n: int) -> tuple[int, float, int]:
    """The router's fallback: fewest requests in flight, round-robin among equals."""
    return sim.ids.index(sim.fleet.least_loaded()), \
        sim.rates.first_token_s(len(request.tokens), None), len(request.tokens)


def router(policy: RoutingPolicy) -> Policy:
    """The router's own `choose_instance` on the coordinator's scores, with `policy`."""
    def choose(sim: Simulation, request: Request, n: int) -> tuple[int, float, int]:
        reply = sim.scores(request)
        chunks = chunk_hashes(request.tokens, sim.chunk_size)
        instance, _, service_s = choose_instance(
            sim.fleet, reply, unscored_reason="unscored", request_tokens=len(request.tokens),
            policy=policy, chunks=chunks)
        request.chunks = chunks
        prefix = next(s.prefix_tokens for s in reply.instances if s.instance_id == instance)
        return sim.ids.index(instance), service_s, len(request.tokens) - prefix
    return choose


def dynamo_prefix(overlap_weight: float = 1.0) -> Policy:
    """Prefix-only, as Dynamo's KV router chooses (its documented cost function, default
    `overlap_score_weight` 1.0): the lowest `overlap_weight * prefill + decode`, with
    prefill = the tokens still to prefill of the requests sent to the instance before their
    first token plus this request's tokens past its cached prefix there, and decode = the KV
    of the requests in flight there plus this one's (tokens: Dynamo counts blocks, the same
    ratio). The prefix is the instance's own (its L1 here, the only local tier: what a
    prefix index of the instance's cache events finds); a peer's cache is not theirs to
    use. Ties: round-robin."""
    def choose(sim: Simulation, request: Request, n: int) -> tuple[int, float, int]:
        reply = sim.scores(request)
        prefix = {s.instance_id: s.prefix_tokens for s in reply.instances}
        size = len(request.tokens)
        costs = [overlap_weight * (sim.prefill_pending[k] + size - prefix.get(name, 0))
                 + sim.kv_tokens[k] + size for k, name in enumerate(sim.ids)]
        least = min(costs)
        tied = [k for k, c in enumerate(costs) if c == least]
        index = tied[n % len(tied)]
        return index, sim.rates.first_token_s(size, None), size - prefix.get(sim.ids[index], 0)
    return choose


def policies(ours: RoutingPolicy) -> dict[str, Policy]:
    """The benchmark's policies by name (POLICIES)."""
    return {"round-robin": round_robin, "least-loaded": least_loaded,
            "prefix-only": dynamo_prefix(), "cache-greedy": router(CACHE_GREEDY),
            "ours": router(ours)}


# --- workloads --------------------------------------------------------------------------------

def arrivals(prompts: list[np.ndarray], rate: float, chunk_size: int, seed: int
             ) -> list[Request]:
    """Poisson arrivals at `rate` per second, one per prompt, in order."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(prompts))
    b64: dict[int, tuple[str, list[bytes]]] = {}
    requests = []
    for n, (when, tokens) in enumerate(zip(np.cumsum(gaps).tolist(), prompts)):
        if id(tokens) not in b64:
            b64[id(tokens)] = (encode_tokens(tokens), prefix_chunk_hashes(tokens, chunk_size))
        text, hashes = b64[id(tokens)]
        requests.append(Request(n, when, tokens, text, hashes))
    return requests


def summary(served: list[Served], warmup: int) -> dict[str, float]:
    """Mean and p99 TTFT (s) and the reused share of prompt tokens, past the first
    `warmup` requests served (caches filling)."""
    kept = [s for s in served if s.n >= warmup]
    ttft = np.asarray([s.ttft for s in kept])
    return {"mean": float(ttft.mean()), "p99": float(np.percentile(ttft, 99)),
            "reused": sum(s.reused for s in kept) / sum(s.tokens for s in kept),
            "local": sum(s.local for s in kept) / sum(s.tokens for s in kept),
            "max_share": float(np.bincount([s.instance for s in kept]).max() / len(kept))}
