"""`make bench-routing`: where to send a request, on CacheBlend's MuSiQue prompts (issue 23).

A fleet of 4 instances and the bundled coordinator process. A third of the distinct
passages sit in a shared L2 (stored once each, on their own, as CacheBlend stores passages).
Requests: every question's prompt once, then every question again in a shuffled order, half
of them the same prompt (a follow-up on the same context) and half with the passages
shuffled (the retriever ranked them differently). Each request is stored where it is served,
as a serving engine does: its chunks, named as LMCache names them, go to the serving
instance's L1 and are reported to the coordinator (`POST /events`).

Policies, each on a fresh coordinator, the same requests:
- `round-robin`: request i to instance i mod 4;
- `prefix-only`: the instance with the most cached prefix (`prefix_tokens` of
  `/directory/blend-score`: its own L1 or a shared tier), what prefix-aware routers do;
- `routed by score`: the best `score` of `/directory/blend-score` (WIRE.md).
Ties (e.g. a request nobody holds) go to the instance that has served fewest, then the
lowest index, for both scored policies.

Reuse is measured on the serving instance, from the benchmark's own record of what each
instance's L1 and the shared tier hold (not from the coordinator's reply): its prefix leg
(leading chunks in its L1 or a shared tier), then the plugin's selection over every stored
chunk found in the request (`local_matcher.ContentIndex.candidates`, the one selection rule
`local_matcher.selection`, this instance's L1 first, shared next, peers last). Tokens are
reported as reused from the serving instance's own L1, from the shared tier, from peers (only
another instance's L1 holds them), and recomputed.

Then the cost of a score: every re-asked prompt scored for all 4 instances and looked up
(the blend lookup's candidates form, what the plugin sends, and its default form), over HTTP
to the same coordinator, alternating; p50 and the ratio.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from benchmarks.common import machine_description, percentile_ms
from benchmarks.bench_rag import load_musique, prompt
from benchmarks.musique_data import MUSIQUE_DATA_DIR
from blend_wire import (
    BLEND_LOOKUP_PATH,
    BLEND_SCORE_PATH,
    EVENTS_PATH,
    INSTANCES_PATH,
    encode,
    encode_tokens,
    pack_kv_rank,
    prefix_chunk_hashes,
)
from coordinator_stub.launch.process import launch_coordinator
from local_matcher import ContentIndex
from local_matcher.selection import select_offers

INSTANCES = 4
MODEL = "musique"
POLICIES = ["round-robin", "prefix-only", "score"]
LABELS = {"round-robin": "round-robin", "prefix-only": "prefix-only scoring",
          "score": "routed by score"}
_OWN, _SHARED, _PEER = 0, 1, 2


@dataclass
class Request:
    tokens: np.ndarray
    hashes: list[bytes]  # LMCache's names of its chunks


@dataclass
class Fleet:
    """What the benchmark knows is stored where (its own record, not the coordinator's)."""

    chunk_size: int
    l1: list[set[bytes]] = field(default_factory=lambda: [set() for _ in range(INSTANCES)])
    shared: set[bytes] = field(default_factory=set)
    index: ContentIndex = None
    indexed: set[bytes] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.index = ContentIndex(self.chunk_size)

    def add(self, tokens: np.ndarray, hashes: list[bytes]) -> None:
        size = self.chunk_size
        for i, chunk_hash in enumerate(hashes):
            if chunk_hash not in self.indexed:
                self.indexed.add(chunk_hash)
                self.index.add(tokens[i * size:(i + 1) * size], chunk_hash, i * size, MODEL)

    def reuse(self, server: int, request: Request) -> tuple[int, ...]:
        """Tokens if `server` serves it: (own L1, of it the prefix, shared, of it the prefix,
        peers, recomputed)."""
        size, own = self.chunk_size, self.l1[server]
        prefix_own = prefix_shared = 0
        for chunk_hash in request.hashes:
            if chunk_hash in own:
                prefix_own += size
            elif chunk_hash in self.shared:
                prefix_shared += size
            else:
                break
        prefix = prefix_own + prefix_shared
        leg = []
        for found in self.index.candidates(request.tokens, MODEL):
            groups: dict[int, list] = {}  # one selection group per place
            for h, old_st in found.chunks:
                place = _OWN if h in own else _SHARED if h in self.shared else _PEER
                groups.setdefault(place, []).append((h, old_st))
            leg += [(found.positions, place, tuple(chunks)) for place, chunks in groups.items()]
        by_place = [0, 0, 0]
        for _, _, _, place, _ in select_offers((leg,), prefix, size):
            by_place[place] += size
        recomputed = len(request.tokens) - prefix - sum(by_place)
        return (prefix_own + by_place[_OWN], prefix_own, prefix_shared + by_place[_SHARED],
                prefix_shared, by_place[_PEER], recomputed)


def requests_of(data: Path, chunk_size: int, seed: int, limit: int
                ) -> tuple[list[np.ndarray], list[Request]]:
    """(the passages in the shared L2, the requests in order)."""
    system, questions = load_musique(data)
    questions = questions[:limit]
    rng = np.random.default_rng(seed)
    distinct: dict[bytes, np.ndarray] = {}
    for q in questions:
        for p in q.passages:
            distinct.setdefault(p.tobytes(), p)
    shared = [p for i, p in enumerate(distinct.values()) if i % 3 == 0]
    first = [prompt(system, q.passages, q.question) for q in questions]
    again = []
    for n in rng.permutation(len(questions)):
        q = questions[n]
        if rng.random() < 0.5:
            again.append(first[n])
        else:
            again.append(prompt(system, [q.passages[j] for j in rng.permutation(len(q.passages))],
                                q.question))
    return shared, [Request(t, prefix_chunk_hashes(t, chunk_size)) for t in first + again]


def entries(tokens: np.ndarray, hashes: list[bytes], chunk_size: int) -> list[dict]:
    return [{"key": {"chunk_hash_hex": h.hex(), "model_name": MODEL,
                     "kv_rank": pack_kv_rank(1)},
             "size_bytes": 1, "token_ids": tokens[i * chunk_size:(i + 1) * chunk_size].tolist(),
             "token_offset": i * chunk_size} for i, h in enumerate(hashes)]


class Events:
    """Reports stores as serving instances do (one seq counter per instance)."""

    def __init__(self, http: httpx.Client) -> None:
        self.http, self.seq = http, {}

    def store(self, instance: str, tokens, hashes, chunk_size, tier="l1", shared=False) -> None:
        seq = self.seq[instance] = self.seq.get(instance, 0) + 1
        body = {"batches": [{"instance_id": instance, "seq": seq, "event_type": "store",
                             "tier": tier, "backend": "fs" if shared else "dram",
                             "shared": shared, "entries": entries(tokens, hashes, chunk_size)}]}
        response = self.http.post(EVENTS_PATH, content=encode(body))
        response.raise_for_status()
        assert response.json()["applied"] == 1, response.text


def instance_name(i: int) -> str:
    return f"inst-{i}"


def run(policy: str, shared: list[np.ndarray], requests: list[Request], chunk_size: int
        ) -> tuple[np.ndarray, list[int], dict]:
    """Serve every request under `policy`; per request the reuse row, and the servers."""
    fleet = Fleet(chunk_size)
    rows, servers = [], []
    served = [0] * INSTANCES
    cost: dict = {}
    with launch_coordinator("--enable-blend-lookup", "--chunk-size", str(chunk_size),
                            "--health-check-interval", "0",
                            stderr=subprocess.DEVNULL) as coordinator, \
            httpx.Client(base_url=coordinator.url, timeout=60.0) as http:
        for i in range(INSTANCES):
            http.post(INSTANCES_PATH, content=encode(
                {"instance_id": instance_name(i), "ip": "127.0.0.1", "http_port": 8000 + i})
            ).raise_for_status()
        events = Events(http)
        for passage in shared:
            hashes = prefix_chunk_hashes(passage, chunk_size)
            fleet.shared.update(hashes)
            fleet.add(passage, hashes)
            events.store("loader", passage, hashes, chunk_size, tier="l2", shared=True)
        for n, request in enumerate(requests):
            if policy == "round-robin":
                server = n % INSTANCES
            else:
                reply = http.post(BLEND_SCORE_PATH, content=encode(
                    {"tokens_b64": encode_tokens(request.tokens), "model_name": MODEL})).json()
                field_ = "prefix_tokens" if policy == "prefix-only" else "score"
                value = {s["instance_id"]: s[field_] for s in reply["instances"]}
                server = max(range(INSTANCES),
                             key=lambda i: (value[instance_name(i)], -served[i], -i))
            rows.append(fleet.reuse(server, request))
            servers.append(server)
            served[server] += 1
            fleet.l1[server].update(request.hashes)
            fleet.add(request.tokens, request.hashes)
            events.store(instance_name(server), request.tokens, request.hashes, chunk_size)
        if policy == "score":
            cost = measure_cost(http, requests[len(requests) // 2:])
    return np.asarray(rows), servers, cost


def measure_cost(http: httpx.Client, requests: list[Request]) -> dict:
    """Per request, a blend score (all instances), a candidates lookup and a default lookup."""
    samples: dict[str, list[float]] = {"score": [], "candidates": [], "default": []}
    for _ in range(2):  # the first pass warms connections and caches; the second is kept
        for kind in samples:
            samples[kind].clear()
        for request in requests:
            body = {"tokens_b64": encode_tokens(request.tokens), "model_name": MODEL}
            for kind, path, extra in (("default", BLEND_LOOKUP_PATH, {}),
                                      ("candidates", BLEND_LOOKUP_PATH, {"candidates": True}),
                                      ("score", BLEND_SCORE_PATH, {})):
                payload = encode({**body, **extra})
                started = time.perf_counter()
                http.post(path, content=payload).raise_for_status()
                samples[kind].append(time.perf_counter() - started)
    return {kind: percentile_ms(values, 50) for kind, values in samples.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_routing",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=MUSIQUE_DATA_DIR,
                        help="folder holding musique_tokens.json.gz (default: %(default)s)")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--questions", type=int, default=150,
                        help="questions used (default: all %(default)s)")
    parser.add_argument("--seed", type=int, default=23)
    args = parser.parse_args(argv)
    shared, requests = requests_of(args.data, args.chunk_size, args.seed, args.questions)
    total = sum(len(r.tokens) for r in requests)
    print(f"# bench-routing: MuSiQue, {len(requests)} requests ({total} tokens), "
          f"{INSTANCES} instances, chunk {args.chunk_size}, {len(shared)} passages in a shared "
          f"L2; {machine_description()}")
    results = {}
    for policy in POLICIES:
        started = time.perf_counter()
        rows, servers, cost = run(policy, shared, requests, args.chunk_size)
        results[policy] = (rows.sum(axis=0), np.bincount(servers, minlength=INSTANCES), cost)
        print(f"# {policy}: {time.perf_counter() - started:.1f} s", flush=True)
    print()
    print("| policy | own L1 | of it prefix | shared tier | of it prefix | peers | recomputed "
          "| own L1 vs round-robin | requests per instance |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = None
    for policy in POLICIES:
        (own, own_prefix, shared_t, shared_prefix, peer, recomputed), per_instance, _ = \
            results[policy]
        pct = lambda v: f"{v} ({100 * v / total:.1f}%)"  # noqa: E731
        base = base if base is not None else own
        print(f"| {LABELS[policy]} | {pct(own)} | {pct(own_prefix)} | {pct(shared_t)} | "
              f"{pct(shared_prefix)} | {pct(peer)} | {pct(recomputed)} | "
              f"{own / base:.2f}x | {'/'.join(map(str, per_instance))} |")
    cost = results["score"][2]
    print()
    print(f"Cost, p50 over HTTP of {len(requests) // 2} re-asked prompts, 4 instances: "
          f"blend score {cost['score']:.2f} ms, blend lookup candidates form "
          f"{cost['candidates']:.2f} ms ({cost['score'] / cost['candidates']:.2f}x), default "
          f"form {cost['default']:.2f} ms ({cost['score'] / cost['default']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
