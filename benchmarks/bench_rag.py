"""Reuse on real RAG prompts: ours vs LMCache 0.5.6's lookups vs two brute forces.

    python -m benchmarks.bench_rag [--data DIR] [--chunk-sizes 256 64] [--queries N]

The prompts are CacheBlend's own MuSiQue subset, shipped in benchmarks/data/musique/
(`benchmarks.musique_data.MUSIQUE_DATA_DIR`, or `--data DIR`; see the data's README.md): 150
questions, each a prompt of `system`, its 10 retrieved passages concatenated, then the
question (~5,800 tokens). Retrieved passages overlap (windows of one text), so one run of
text can sit at two offsets of one prompt.

A fleet of 4 servers (`InMemoryHost`s sharing one L2, so the prefix lookup and the sparse
prefetch see every chunk the fleet stored) and one bundled coordinator process (blend
lookup on, the run's chunk size). Two workloads, each at every chunk size:

- A, CacheBlend's use: each distinct passage stored once, alone, as its own sequence
  (passage i on server i % 4), then prompt q asked on server q % 4.
- B: prompt q stored on server q % 4, then asked again on server (q + 1) % 4 with its
  passages shuffled (one fixed-seed permutation per question, `--seed`).

Reused tokens (the prefix coverage plus every segment) as % of the prompt tokens, summed
over the queries, for:

- ours, unified: `BlendPlugin.cb_unified_lookup`, local matcher and coordinator legs;
- ours, local-only: a plugin with no coordinator URL on the same host, fed the same stores;
- ours, fleet leg alone: a plugin on the same host whose local matcher holds nothing (it is
  never told of a store), so its result is the coordinator's reply through the plugin's own
  prefix drop, selection and prefetch;
- LMCache, coordinator mode: LMCache 0.5.6's coordinator `KeyDirectory` (its `BlendIndex`
  behind it, blend lookup on) in this process, fed the same STORE events (the wire shapes
  our reporter posts, parsed by LMCache's own `/events` request schema), its `blend_match`
  answer, then what LMCache's built-in `cb_unified_lookup` does with a coordinator reply
  (facts read from `lmcache/v1/multiprocess/modules/blend/lookup.py`): one segment per
  match, drop those starting inside the prefix, keep the ones the sparse prefetch finds,
  then ascending `cur_st`, keep a segment when it starts at or after the end of the last
  kept one;
- LMCache's local matcher (`BlendTokenRangeMatcher`, one per server, fed that server's
  stored sequences from chunk 0, as `bench_local_matcher` feeds it), with the same steps;
- "reusable, each chunk once" and "brute force", computed from the stored chunks alone
  (`reusable_tokens`): see there.

Also: per workload, the queries on which unified reuses less than the fleet leg alone,
unified lookup p50/p99 (first call to result, polled as a scheduler does), the same in a
second pass of unified lookups alone (the first interleaves every system's lookups in this
process), its CPU time (this process and the coordinator's, over that second pass), and the
coordinator's reply bytes to `POST /directory/blend-lookup` in its default form and with
`"candidates": true` (a coordinator without the candidates form answers that request in
its default form: said so). Every returned segment is checked against the stored chunk it
names (tokens, no chunk twice, no overlap, none inside the prefix); the exit code is 1 if
any is wrong. Tables are Markdown.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Iterable, Mapping, Sequence

import numpy as np
import psutil

from benchmarks.bench_unified_lookup import MODEL, save, timed_lookup
from benchmarks.common import machine_description, percentile_ms
from benchmarks.lmcache_reference import lmcache_version
from benchmarks.lookup_forms import FormPrice, forms_table, price_forms
from benchmarks.musique_data import DATA_FILE, MUSIQUE_DATA_DIR, read_tokens
from blend_wire import (BLEND_LOOKUP_PATH, CacheEventBatch, CacheEventEntry, EventsRequest,
                        encode, encode_tokens)
from coordinator_stub.launch.process import start_coordinator
from plugin import BlendPlugin, InMemoryHost, LookupKey, PluginConfig
from plugin.http import coordinator_http
from plugin.reporter import encode_key

INSTANCES = 4

SYSTEMS = ["unified", "local", "fleet", "lmcache_coordinator", "lmcache_local", "once",
           "brute", "ceiling"]
LABELS = {
    "unified": "ours (unified)", "local": "ours local-only", "fleet": "ours fleet leg alone",
    "lmcache_coordinator": "LMCache, coordinator mode", "lmcache_local": "LMCache local matcher",
    "once": "reusable, each chunk once", "brute": "brute force", "ceiling": "token ceiling",
}


# --- the data and the workloads -----------------------------------------------------------------


@dataclass
class Question:
    passages: list[np.ndarray]
    question: np.ndarray


def load_musique(data_dir: Path) -> tuple[np.ndarray, list[Question]]:
    """`system` and the questions of `musique_tokens.json.gz`, token lists as uint32."""
    path = data_dir / DATA_FILE
    if not path.is_file():
        raise SystemExit(f"{path} not found: pass --data DIR, the folder holding {DATA_FILE} "
                         f"(default: {MUSIQUE_DATA_DIR}, shipped with the checkout)")
    data = read_tokens(data_dir)
    as_array = lambda ids: np.asarray(ids, dtype=np.uint32)  # noqa: E731
    return as_array(data["system"]), [
        Question([as_array(p) for p in q["passages"]], as_array(q["question"]))
        for q in data["questions"]]


def prompt(system: np.ndarray, passages: Iterable[np.ndarray], question: np.ndarray) -> np.ndarray:
    return np.concatenate([system, *passages, question])


@dataclass
class Workload:
    name: str
    description: str
    stores: list[tuple[int, np.ndarray]]   # (server, the stored sequence), in order
    queries: list[tuple[int, np.ndarray]]  # (server asked, the prompt)
    # Per query, the token span [start, end) that stored text holds at some alignment (its
    # passages; in B the system too, stored at the same place): what `token_ceiling` counts.
    held: list[tuple[int, int]]


def workload_a(system: np.ndarray, questions: Sequence[Question]) -> Workload:
    distinct: dict[bytes, np.ndarray] = {}
    for q in questions:
        for p in q.passages:
            distinct.setdefault(p.tobytes(), p)
    stores = [(i % INSTANCES, p) for i, p in enumerate(distinct.values())]
    queries = [(i % INSTANCES, prompt(system, q.passages, q.question))
               for i, q in enumerate(questions)]
    held = [(len(system), len(system) + sum(map(len, q.passages))) for q in questions]
    return Workload("A", "each distinct passage stored once, alone (CacheBlend's use), then "
                    "the prompts", stores, queries, held)


def workload_b(system: np.ndarray, questions: Sequence[Question], seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    stores, queries = [], []
    for i, q in enumerate(questions):
        stores.append((i % INSTANCES, prompt(system, q.passages, q.question)))
        order = rng.permutation(len(q.passages))
        queries.append(((i + 1) % INSTANCES,
                        prompt(system, [q.passages[j] for j in order], q.question)))
    held = [(0, len(system) + sum(map(len, q.passages))) for q in questions]
    return Workload("B", "each prompt stored, then asked again on the next server with its "
                    "passages shuffled", stores, queries, held)


# --- the brute forces --------------------------------------------------------------------------


def reusable_tokens(query: np.ndarray, prefix_tokens: int, chunk: int,
                    stored: Mapping[bytes, int], once: bool) -> int:
    """Tokens of `query` reusable from the stored chunks, the prefix coverage included.

    `stored`: each stored content (a chunk's tokens as uint32 bytes) -> how many distinct
    stored chunks hold it. Every position at or after `prefix_tokens` whose window equals a
    stored content (dict lookup on the window's bytes: an exact compare) is a candidate;
    ascending, a position is kept when it starts at or after the end of the last kept one
    and, with `once`, some chunk of its content is not used yet (one is then used up).
    """
    query = np.ascontiguousarray(query, dtype=np.uint32)
    left = dict(stored)
    kept, end = 0, prefix_tokens
    for position in range(prefix_tokens, len(query) - chunk + 1):
        if position < end:
            continue
        content = query[position:position + chunk].tobytes()
        if left.get(content, 0) < 1:
            continue
        if once:
            left[content] -= 1
        kept += 1
        end = position + chunk
    return prefix_tokens + kept * chunk


def token_ceiling(prefix_tokens: int, held: tuple[int, int]) -> int:
    """Tokens any chunk size could reuse: the prefix coverage, and every token of the span
    `held` (stored text at some alignment), whatever the chunk grid: |[0, prefix) U held|."""
    start, end = held
    return prefix_tokens + max(0, end - max(start, prefix_tokens))


def stored_contents(store: Mapping[Hashable, np.ndarray]) -> dict[bytes, int]:
    """Content -> number of distinct chunks holding it, from a host's chunk store."""
    counts: dict[bytes, int] = {}
    for tokens in store.values():
        content = np.ascontiguousarray(tokens, dtype=np.uint32).tobytes()
        counts[content] = counts.get(content, 0) + 1
    return counts


# --- LMCache's built-in lookup, what it does after its matcher or coordinator answers --------


def lmcache_selection(cur_starts_and_hashes: Iterable[tuple[int, bytes]], prefix_tokens: int,
                      chunk: int, fetchable) -> list[tuple[int, bytes]]:
    """Prefix drop, then the chunks the sparse prefetch finds, then ascending `cur_st`
    (stable), keep one starting at or after the end of the last kept (LMCache 0.5.6,
    `cb_unified_lookup` and `_non_overlapping_after_prefix`)."""
    candidates = [(st, h) for st, h in cur_starts_and_hashes
                  if st >= prefix_tokens and fetchable(h)]
    kept, end = [], -1
    for st, h in sorted(candidates, key=lambda c: c[0]):
        if st >= end:
            kept.append((st, h))
            end = st + chunk
    return kept


class LMCacheReference:
    """LMCache 0.5.6's coordinator directory and per-server local matchers, in process."""

    def __init__(self, chunk: int) -> None:
        os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
        from lmcache.v1.mp_coordinator.api import BlendNamespace
        from lmcache.v1.mp_coordinator.schemas import CacheEventsRequest
        from lmcache.v1.mp_coordinator.views.key_directory import KeyDirectory
        from lmcache.v1.multiprocess.modules.blend.matcher import BlendTokenRangeMatcher

        logging.getLogger(BlendTokenRangeMatcher.__module__).setLevel(logging.WARNING)
        self.chunk = chunk
        self.directory = KeyDirectory()
        self.directory.enable_blend_lookup(chunk_size=chunk, probe_stride=1)
        self.matchers = [BlendTokenRangeMatcher(chunk_size=chunk) for _ in range(INSTANCES)]
        self._parse_events = CacheEventsRequest.model_validate_json
        self.namespace = BlendNamespace(model_name=MODEL, cache_salt="", world_size=1)
        self._seq = [0] * INSTANCES

    def store(self, server: int, key: LookupKey, hashes: list[bytes]) -> None:
        tokens = np.asarray(key.token_ids, dtype=np.uint32)
        c = self.chunk
        self._seq[server] += 1
        # The STORE batch our reporter posts for this range (plugin.reporter: one entry per
        # chunk, its tokens and offset), through LMCache's own /events request schema.
        body = encode(EventsRequest(batches=[CacheEventBatch(
            instance_id=f"rag-{server}", incarnation=1, seq=self._seq[server],
            event_type="store", tier="l1", backend="dram", entries=[
                CacheEventEntry(key=encode_key(key.namespace, h), token_ids=tokens[i * c:(i + 1) * c],
                                token_offset=i * c) for i, h in enumerate(hashes)])]))
        for batch in self._parse_events(body).batches:
            self.directory.consume(batch)
        self.matchers[server].on_new_token_hashes(tokens[:len(hashes) * c].tolist(), hashes, 0, 0)

    def coordinator_matches(self, tokens: np.ndarray) -> list[tuple[int, bytes]]:
        return [(m.cur_st, m.chunk_hash)
                for m in self.directory.blend_match(tokens, self.namespace)]

    def local_matches(self, server: int, tokens: np.ndarray) -> list[tuple[int, bytes]]:
        return [(r.cur_st, r.hash) for r in self.matchers[server].match_sub_sequence(tokens.tolist())]


# --- one run: a workload at one chunk size -------------------------------------------------------


@dataclass
class Run:
    workload: str
    chunk: int
    queries: int = 0
    prompt_tokens: int = 0
    reused: dict[str, list[int]] = field(default_factory=lambda: {s: [] for s in SYSTEMS})
    latencies: list[float] = field(default_factory=list)
    # The same lookups again in a pass of unified lookups alone, polled every millisecond
    # (the first pass interleaves the other systems' lookups in this process).
    latencies_alone: list[float] = field(default_factory=list)
    default_bytes: list[int] = field(default_factory=list)
    candidates_bytes: list[int] = field(default_factory=list)
    candidates_form: bool = False
    wrong: dict[str, int] = field(default_factory=dict)
    fleet_statuses: dict[str, int] = field(default_factory=dict)
    stored_chunks: int = 0
    cpu_plugin_ms: float = 0.0       # per unified lookup: this process (plugin + workers)
    cpu_coordinator_ms: float = 0.0  # per unified lookup: the coordinator process
    # Per reply form (`benchmarks.lookup_forms`): bytes, coordinator and plugin CPU.
    forms: dict[str, FormPrice] = field(default_factory=dict)

    def percent(self, system: str) -> float:
        return 100.0 * sum(self.reused[system]) / self.prompt_tokens

    def below_fleet(self) -> int:
        return sum(u < f for u, f in zip(self.reused["unified"], self.reused["fleet"]))


def check_segments(segments: Sequence[tuple[int, bytes]], tokens: np.ndarray, prefix: int,
                   chunk: int, store: Mapping[Hashable, np.ndarray]) -> int:
    """How many segments are wrong: not the named chunk's tokens at that position, a chunk
    named twice, overlapping the previous one, or inside the prefix."""
    wrong, seen, end = 0, set(), prefix
    for st, h in sorted(segments, key=lambda s: s[0]):
        held = store.get(h)
        wrong += (held is None or not np.array_equal(tokens[st:st + chunk], held)
                  or h in seen or st < end)
        seen.add(h)
        end = max(end, st + chunk)
    return wrong


def segments_of(plugin: BlendPlugin, request_id: str) -> list[tuple[int, bytes]]:
    trace = plugin.trace(request_id)
    return [(s.cur_st, s.hash) for s in trace.segments]


def run_one(work: Workload, chunk: int, lmcache: bool, warmup: int, *,
            cpu_rounds: int = 1) -> Run:
    """`work` at `chunk` tokens per chunk; the CPU per lookup over `cpu_rounds` passes."""
    run = Run(work.name, chunk)
    coordinator = start_coordinator("--enable-blend-lookup", "--chunk-size", str(chunk),
                                    "--log-level", "WARNING", stderr=subprocess.DEVNULL)
    l2: dict = {}
    hosts = [InMemoryHost(chunk, shared_l2=l2) for _ in range(INSTANCES)]
    # A generous budget: a slow round-trip on shared cores must not turn into a lost fleet leg.
    fleet = dict(coordinator_url=coordinator.url, event_reporting=True, chunk_size=chunk,
                 blend_timeout=10.0, event_flush_interval=0.2)
    unified = [BlendPlugin(PluginConfig(instance_id=f"rag-{k}", **fleet), hosts[k])
               for k in range(INSTANCES)]
    local = [BlendPlugin(PluginConfig(instance_id=f"rag-{k}-local", chunk_size=chunk), hosts[k])
             for k in range(INSTANCES)]
    fleet_only = [BlendPlugin(PluginConfig(instance_id=f"rag-{k}-fleet", **fleet), hosts[k],
                              report_events=False) for k in range(INSTANCES)]
    reference = LMCacheReference(chunk) if lmcache else None
    http = coordinator_http(coordinator.url, timeout=30.0)
    try:
        for i, (server, tokens) in enumerate(work.stores):
            if len(tokens) < chunk:
                continue  # no full chunk: nothing to store
            request_id = f"store-{i}"
            save(hosts[server], [unified[server], local[server]], request_id, tokens)
            if reference is not None:
                key = LookupKey(request_id, tokens, MODEL)
                reference.store(server, key, hosts[server].chunk_hashes(key))
        for plugin in unified:
            if not plugin.flush():
                raise RuntimeError("cache events did not reach the coordinator")
        run.stored_chunks = len(l2)
        indexed = http.get("/directory/stats").json()["blend"]["num_chunks"]
        if indexed != len(l2):
            raise RuntimeError(f"the coordinator indexed {indexed} chunks of {len(l2)} stored")
        contents = stored_contents(l2)

        for w in range(min(warmup, len(work.queries))):  # numba kernels, connections
            server, tokens = work.queries[w]
            timed_lookup(unified[server], LookupKey(f"warm-{w}", tokens, MODEL))

        for q, (server, tokens) in enumerate(work.queries):
            run.queries += 1
            run.prompt_tokens += len(tokens)
            rid = f"{work.name}-{chunk}-q{q}"
            seconds, covered = timed_lookup(unified[server], LookupKey(rid, tokens, MODEL))
            run.latencies.append(seconds)
            trace = unified[server].trace(rid)
            prefix = trace.prefix_tokens
            run.fleet_statuses[str(trace.fleet_status)] = (
                run.fleet_statuses.get(str(trace.fleet_status), 0) + 1)
            answers = {"unified": (covered, segments_of(unified[server], rid))}
            for name, plugins in (("local", local), ("fleet", fleet_only)):
                _, got = timed_lookup(plugins[server], LookupKey(rid, tokens, MODEL))
                answers[name] = (got, segments_of(plugins[server], rid))
                if plugins[server].trace(rid).prefix_tokens != prefix:
                    raise RuntimeError(f"{rid}: prefix coverage differs between plugins")
            if reference is not None:
                fetchable = l2.__contains__
                for name, matches in (
                        ("lmcache_coordinator", reference.coordinator_matches(tokens)),
                        ("lmcache_local", reference.local_matches(server, tokens))):
                    kept = lmcache_selection(matches, prefix, chunk, fetchable)
                    answers[name] = (prefix + len(kept) * chunk, kept)
            for name, (reused, segments) in answers.items():
                run.reused[name].append(reused)
                run.wrong[name] = (run.wrong.get(name, 0)
                                   + check_segments(segments, tokens, prefix, chunk, l2))
            run.reused["once"].append(reusable_tokens(tokens, prefix, chunk, contents, True))
            run.reused["brute"].append(reusable_tokens(tokens, prefix, chunk, contents, False))
            run.reused["ceiling"].append(token_ceiling(prefix, work.held[q]))

            body = {"tokens_b64": encode_tokens(tokens), "model_name": MODEL, "world_size": 1,
                    "cache_salt": ""}
            default = http.post(BLEND_LOOKUP_PATH, json=body)
            candidates = http.post(BLEND_LOOKUP_PATH, json={**body, "candidates": True})
            for reply in (default, candidates):
                reply.raise_for_status()
            run.default_bytes.append(len(default.content))
            run.candidates_bytes.append(len(candidates.content))
            run.candidates_form |= "candidates" in candidates.json()

        # CPU per unified lookup, steadier than wall time on shared cores: this process (the
        # plugin and its worker threads) and the coordinator process, over one more pass of
        # unified lookups alone, polled every millisecond (a busy poll would count as CPU).
        coordinator_cpu = psutil.Process(coordinator.process.pid)
        own, theirs = time.process_time(), sum(coordinator_cpu.cpu_times()[:2])
        cpu_pass = [(r, q, query) for r in range(cpu_rounds)
                    for q, query in enumerate(work.queries)]
        for r, q, (server, tokens) in cpu_pass:
            key = LookupKey(f"{work.name}-{chunk}-cpu{r}-{q}", tokens, MODEL)
            started = time.perf_counter()
            while unified[server].cb_unified_lookup(key, 1) is None:
                time.sleep(0.001)
            run.latencies_alone.append(time.perf_counter() - started)
        run.cpu_plugin_ms = (time.process_time() - own) / len(cpu_pass) * 1e3
        run.cpu_coordinator_ms = ((sum(coordinator_cpu.cpu_times()[:2]) - theirs)
                                  / len(cpu_pass) * 1e3)
        run.forms = price_forms(
            http, coordinator.process.pid, [tokens for _, tokens in work.queries],
            [{"tokens_b64": encode_tokens(tokens), "model_name": MODEL, "world_size": 1,
              "cache_salt": ""} for _, tokens in work.queries], chunk,
            [f"rag-{server}" for server, _ in work.queries], cpu_rounds)
    finally:
        http.close()
        for plugin in unified + local + fleet_only:
            plugin.close()
        coordinator.stop()
    return run


# --- report --------------------------------------------------------------------------------------


def reuse_table(runs: list[Run], systems: list[str]) -> list[str]:
    head = ["workload", "chunk"] + [LABELS[s] for s in systems] + [
        "unified / each chunk once", "LMCache coord. / each chunk once"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in runs:
        cells = [r.workload, str(r.chunk)] + [f"{r.percent(s):.1f}%" for s in systems]
        once = r.percent("once")
        cells.append(f"{r.percent('unified') / once:.3f}")
        cells.append(f"{r.percent('lmcache_coordinator') / once:.3f}"
                     if "lmcache_coordinator" in systems else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def detail_table(runs: list[Run]) -> list[str]:
    head = ["workload", "chunk", "queries", "prompt tokens", "stored chunks",
            "queries unified < fleet leg", "unified lookup p50 / p99 ms",
            "p50 / p99 ms, unified lookups alone",
            "unified lookup CPU ms: plugin + coordinator",
            "reply B default p50 / total", "reply B candidates p50 / total",
            "candidates / default (total)"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in runs:
        p50 = lambda v: int(np.percentile(v, 50))  # noqa: E731
        candidates = (f"{p50(r.candidates_bytes):,} / {sum(r.candidates_bytes):,}"
                      if r.candidates_form else "no candidates form")
        ratio = (f"{sum(r.candidates_bytes) / sum(r.default_bytes):.2f}x"
                 if r.candidates_form else "-")
        lines.append("| " + " | ".join([
            r.workload, str(r.chunk), str(r.queries), f"{r.prompt_tokens:,}",
            f"{r.stored_chunks:,}", f"{r.below_fleet()} of {r.queries}",
            f"{percentile_ms(r.latencies, 50):.2f} / {percentile_ms(r.latencies, 99):.2f}",
            f"{percentile_ms(r.latencies_alone, 50):.2f} / "
            f"{percentile_ms(r.latencies_alone, 99):.2f}",
            f"{r.cpu_plugin_ms:.2f} + {r.cpu_coordinator_ms:.2f}",
            f"{p50(r.default_bytes):,} / {sum(r.default_bytes):,}", candidates, ratio]) + " |")
    return lines


def chunk_sizes(text: str) -> list[int]:
    """`--chunk-sizes` value: one size or a comma-separated list of them."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"chunk sizes are positive integers: {text!r}")
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"chunk sizes are positive integers: {text!r}")
    return sizes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_rag",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=MUSIQUE_DATA_DIR,
                        help=f"folder holding {DATA_FILE} (default: {MUSIQUE_DATA_DIR})")
    parser.add_argument("--chunk-sizes", type=chunk_sizes, nargs="+", default=[[256, 64]],
                        help="tokens per chunk, each a run: 256 64 or 256,64,32 "
                             "(default: 256 64)")
    parser.add_argument("--workloads", nargs="+", choices=["A", "B"], default=["A", "B"])
    parser.add_argument("--queries", type=int, default=150,
                        help="the first N questions (default: all 150)")
    parser.add_argument("--seed", type=int, default=0, help="passage shuffle of workload B")
    parser.add_argument("--warmup", type=int, default=5, help="untimed lookups per run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    system, questions = load_musique(args.data)
    questions = questions[:args.queries]
    version = lmcache_version()
    print(f"machine: {machine_description()}")
    print(f"data: {args.data / DATA_FILE}: {len(questions)} questions, prompts of "
          f"{np.mean([len(prompt(system, q.passages, q.question)) for q in questions]):,.0f} "
          f"tokens on average; {INSTANCES} servers sharing one L2, one coordinator process")
    if version is None:
        print("LMCache is not importable here: its columns are left out")
    else:
        print(f"LMCache {version}: KeyDirectory/BlendIndex and BlendTokenRangeMatcher in "
              "this process, fed the same stores")
    workloads = {"A": lambda: workload_a(system, questions),
                 "B": lambda: workload_b(system, questions, args.seed)}
    runs = []
    for chunk in [size for sizes in args.chunk_sizes for size in sizes]:
        for name in args.workloads:
            work = workloads[name]()
            started = time.perf_counter()
            run = run_one(work, chunk, version is not None, args.warmup)
            runs.append(run)
            print(f"{name} ({work.description}), chunk {chunk}: {len(work.stores)} stored "
                  f"sequences, {run.stored_chunks:,} chunks, {run.queries} queries in "
                  f"{time.perf_counter() - started:.1f} s", flush=True)
    systems = [s for s in SYSTEMS if version is not None or not s.startswith("lmcache")]
    print("\nreused tokens, % of prompt tokens (prefix coverage + segments, summed over "
          "queries):\n")
    print("\n".join(reuse_table(runs, systems)))
    print()
    print("\n".join(detail_table(runs)))
    print("\nblend-lookup reply forms (benchmarks.lookup_forms: one pass each; CPU per lookup):\n")
    print("\n".join(forms_table([(r.workload, r.chunk, r.forms) for r in runs])))
    if not all(r.candidates_form for r in runs):
        print("\nthe coordinator has no candidates form yet: it answers "
              '"candidates": true in its default form')
    print()
    missed = []
    for r in runs:
        share = r.percent("unified") / r.percent("once")
        if share < 0.99:
            missed.append(f"{r.workload}/{r.chunk}: unified {share:.3f} of each-chunk-once")
        if r.below_fleet():
            missed.append(f"{r.workload}/{r.chunk}: unified below the fleet leg on "
                          f"{r.below_fleet()} queries")
        if r.candidates_form and sum(r.candidates_bytes) > 3 * sum(r.default_bytes):
            missed.append(f"{r.workload}/{r.chunk}: candidates reply over 3x the default")
    print("targets (issue 18: unified >= 0.99 of each-chunk-once, never below the fleet leg, "
          "candidates reply <= 3x the default; lookup p50 <= 1.2x compares two runs): "
          + ("all met" if not missed else "MISSED: " + "; ".join(missed)))
    bad = False
    for r in runs:
        statuses = {s: n for s, n in r.fleet_statuses.items() if s != "ok"}
        if statuses:
            print(f"{r.workload}/{r.chunk}: unified lookups whose fleet leg was not ok: {statuses}")
        wrong = {s: n for s, n in r.wrong.items() if n}
        if wrong:
            bad = True
            print(f"{r.workload}/{r.chunk}: WRONG segments (content, repeat, overlap or "
                  f"prefix): {wrong}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
