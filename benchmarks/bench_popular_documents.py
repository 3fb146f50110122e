"""Popular documents: one document stored behind many prefixes, looked up many times.

Chunk hashes are chained over the prefix, so a document stored after P different prefixes
is P chunks per document chunk holding the same content: the normal CacheBlend workload.
This benchmark stores `--docs` documents of 8 chunks, each behind every one of P
prefixes (prefix p belongs to tenant `p % --tenants`, at stored offset `(1 + p % 8) * C`),
then asks queries assembling 10 documents (7 distinct, 3 of them again) separated by
short random filler, from tenants in turn. It runs, side by side in one process and one
run:

- our `ContentIndex` (namespaced, in process) and LMCache 0.5.6's `BlendIndex` (the
  coordinator's index, in process), namespaces = tenants;
- our bundled coordinator over HTTP (`python -m coordinator_stub`, events in, lookups out);
- our `LocalMatcher` and LMCache 0.5.6's local matcher (`BlendTokenRangeMatcher`), one
  process's view: every occupant in one namespace.

For each P in `--prefixes` (default 1 and 100) it reports lookup p50/p99, matches and
reply bytes per query, tokens covered per query (the union of matched windows; the most
a query can get is printed), and, where there are enough occupants, the time to delete
`--delete` occupants (the earliest stored: the heads of every list) next to deleting
one eighth as many, so linear work shows as equal time per occupant (over HTTP both
deletes run beside one client doing lookups, whose latency is printed). Then the ratios the
targets are about: lookup time and reply size at the largest P over the smallest
(target: within 1.5x), delete time per occupant large/small (target: ~1, linear), and
tokens covered against LMCache's (target: at least as many).

    python -m benchmarks.bench_popular_documents [--docs 2000] [--prefixes 1 100]
        [--tenants 4] [--queries 200] [--delete 100000] [--skip-http]

LMCache's classes are imported from the installed `lmcache` package when it is there; a
line says so when it is not, and their columns are left out.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import struct
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import psutil

from benchmarks.bench_coordinator import Connection, get_json, http_request
from benchmarks.common import machine_description, percentile_ms, release_free_memory
from blend_wire import (
    BLEND_LOOKUP_PATH,
    EVENTS_PATH,
    HEALTH_PATH,
    STATS_PATH,
    BlendLookupReply,
    EventsReply,
    decode,
    encode,
    encode_tokens,
    pack_kv_rank,
)
from coordinator_stub.launch.process import start_coordinator
from local_matcher import ContentIndex, LocalMatcher

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # its matcher logs every lookup
try:
    from lmcache.v1.mp_coordinator.blend_index import BlendIndex as LMCacheBlendIndex
except ImportError as exc:  # not installed: say so, run ours alone
    LMCacheBlendIndex, LMCACHE_MISSING = None, str(exc)
else:
    LMCACHE_MISSING = ""
try:
    from lmcache.v1.multiprocess.modules.blend.matcher import BlendTokenRangeMatcher
except ImportError as exc:
    BlendTokenRangeMatcher = None
    LMCACHE_MISSING = LMCACHE_MISSING or str(exc)

DOC_CHUNKS = 8
DISTINCT_PER_QUERY, REPEATS_PER_QUERY = 7, 3
VOCAB = 128_256
MODEL = "bench-model"
KV_RANK = pack_kv_rank(1)
BATCH_ENTRIES = 512
INSTANCES = 4


# --- the workload ---------------------------------------------------------------------------


@dataclass
class Workload:
    chunk: int
    docs: int
    prefixes: int
    tenants: int
    rows: np.ndarray  # (docs * DOC_CHUNKS, C): content of document d's chunk i at d*8+i
    # Per occupant o, stored in order o = (p * docs + d) * DOC_CHUNKS + i:
    content: np.ndarray
    prefix: np.ndarray
    offset: np.ndarray
    hashes: list[bytes]

    @property
    def occupants(self) -> int:
        return len(self.hashes)

    def tenant_of(self, occupant: int) -> int:
        return int(self.prefix[occupant]) % self.tenants


def build_workload(docs: int, prefixes: int, tenants: int, chunk: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, VOCAB, size=(docs * DOC_CHUNKS, chunk), dtype=np.uint32)
    n = docs * DOC_CHUNKS * prefixes
    o = np.arange(n, dtype=np.int64)
    content = o % (docs * DOC_CHUNKS)
    prefix = o // (docs * DOC_CHUNKS)
    offset = (1 + prefix % 8) * chunk + (content % DOC_CHUNKS) * chunk
    pack = struct.Struct("<III").pack
    # Opaque 32-byte hashes, distinct per (prefix, document, chunk), like prefix-chained ones.
    hashes = [hashlib.blake2b(pack(p, c // DOC_CHUNKS, c % DOC_CHUNKS), digest_size=32).digest()
              for p, c in zip(prefix.tolist(), content.tolist())]
    return Workload(chunk, docs, prefixes, tenants, rows, content, prefix, offset, hashes)


@dataclass
class Query:
    tokens: np.ndarray
    tenant: int
    doc_ids: list[int]
    best_tokens: int = 0  # most tokens any system can cover for this tenant
    best_tokens_one_namespace: int = 0


def build_queries(work: Workload, count: int, seed: int) -> list[Query]:
    rng = np.random.default_rng(seed + 1)
    chunk = work.chunk
    queries = []
    for q in range(count):
        distinct = rng.choice(work.docs, size=DISTINCT_PER_QUERY, replace=False)
        docs = list(distinct) + list(rng.choice(distinct, size=REPEATS_PER_QUERY))
        rng.shuffle(docs)
        parts = []
        for d in docs:
            parts.append(rng.integers(0, VOCAB, size=int(rng.integers(0, 64)), dtype=np.uint32))
            parts.append(work.rows[d * DOC_CHUNKS:(d + 1) * DOC_CHUNKS].ravel())
        tenant = q % min(work.tenants, work.prefixes)
        per_tenant = len(range(tenant, work.prefixes, work.tenants))
        seen: dict[int, int] = {}
        best = best_one = 0
        for d in docs:
            seen[d] = seen.get(d, 0) + 1
            best += DOC_CHUNKS * chunk * (seen[d] <= per_tenant)
            best_one += DOC_CHUNKS * chunk * (seen[d] <= work.prefixes)
        queries.append(Query(np.concatenate(parts), tenant, [int(d) for d in docs], best,
                             best_one))
    return queries


def covered_tokens(starts: list[int], chunk: int) -> int:
    """Tokens in the union of the windows [st, st + chunk)."""
    covered, end = 0, -1
    for start in sorted(starts):
        covered += min(chunk, start + chunk - max(start, end))
        end = max(end, start + chunk)
    return covered


def delete_sets(work: Workload, large: int) -> tuple[list[int], list[int]] | None:
    """The earliest-stored occupants (heads of every list): large // 8, then `large` more."""
    small = large // 8
    if small + large > work.occupants // 2:
        return None
    return list(range(small)), list(range(small, small + large))


# --- results -----------------------------------------------------------------------------


@dataclass
class Result:
    system: str
    prefixes: int
    occupants: int
    build_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    matches: list[int] = field(default_factory=list)
    reply_bytes: list[int] = field(default_factory=list)
    covered: list[int] = field(default_factory=list)
    best: list[int] = field(default_factory=list)
    wrong: int = 0  # a match whose window is not the chunk's content, or a chunk twice
    delete_small_s: float | None = None
    delete_large_s: float | None = None
    delete_small_n: int = 0
    delete_large_n: int = 0
    covered_after_delete: list[int] = field(default_factory=list)
    note: str = ""
    server_cpu_ms: float | None = None
    during_delete: list[float] = field(default_factory=list)


def record_lookups(result: Result, work: Workload, queries: list[Query], lookup,
                   one_namespace: bool, after_delete: bool = False) -> None:
    """Record `lookup(query) -> (list of (hash, old_st, cur_st), reply bytes, seconds)`
    per query and check every answer: each match's window holds its chunk's content,
    and no chunk is named twice."""
    content_of = {h: int(c) for h, c in zip(work.hashes, work.content.tolist())}
    chunk = work.chunk
    for query in queries:
        found, size, elapsed = lookup(query)
        for chunk_hash, _, cur_st in found:
            row = work.rows[content_of[chunk_hash]]
            if not np.array_equal(query.tokens[cur_st:cur_st + chunk], row):
                result.wrong += 1
        result.wrong += len(found) - len({m[0] for m in found})
        covered = covered_tokens([m[2] for m in found], chunk)
        if after_delete:
            result.covered_after_delete.append(covered)
            continue
        result.latencies.append(elapsed)
        result.matches.append(len(found))
        result.reply_bytes.append(size)
        result.covered.append(covered)
        result.best.append(query.best_tokens_one_namespace if one_namespace
                           else query.best_tokens)


def in_process(match):
    """A lookup for `record_lookups` from `match(query) -> [(hash, old_st, cur_st)]`."""
    def lookup(query: Query):
        started = time.perf_counter()
        found = match(query)
        return found, 0, time.perf_counter() - started
    return lookup


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


# --- in-process systems -----------------------------------------------------------------------


def run_content_index(work: Workload, queries: list[Query], large: int) -> Result:
    result = Result("ContentIndex (ours)", work.prefixes, work.occupants)
    index = ContentIndex(work.chunk)

    def build() -> None:
        for tenant in range(work.tenants):
            mine = np.flatnonzero(work.prefix % work.tenants == tenant)
            for start in range(0, len(mine), 4096):
                part = mine[start:start + 4096]
                index.add_many(work.rows[work.content[part]], [work.hashes[o] for o in part],
                               work.offset[part], f"t{tenant}")

    result.build_s = timed(build)
    lookup = in_process(lambda q: [(m.chunk_hash, m.old_st, m.cur_st)
                                   for m in index.match(q.tokens, f"t{q.tenant}")])
    record_lookups(result, work, queries, lookup, one_namespace=False)
    sets = delete_sets(work, large)
    if sets is not None:
        small, big = sets
        result.delete_small_n, result.delete_large_n = len(small), len(big)
        result.delete_small_s = timed(lambda: index.remove_chunks([work.hashes[o] for o in small]))
        result.delete_large_s = timed(lambda: index.remove_chunks([work.hashes[o] for o in big]))
        record_lookups(result, work, queries, lookup, one_namespace=False, after_delete=True)
    return result


def run_lmcache_blend_index(work: Workload, queries: list[Query], large: int) -> Result:
    result = Result("LMCache BlendIndex", work.prefixes, work.occupants)
    index = LMCacheBlendIndex(chunk_size=work.chunk)
    rows, hashes, offsets = work.rows, work.hashes, work.offset.tolist()
    contents, tenants = work.content.tolist(), (work.prefix % work.tenants).tolist()

    def build() -> None:
        for o in range(work.occupants):
            index.add(rows[contents[o]], hashes[o], offsets[o], f"t{tenants[o]}")

    result.build_s = timed(build)

    lookup = in_process(lambda q: [(m.chunk_hash, m.old_st, m.cur_st)
                                   for m in index.match(q.tokens, f"t{q.tenant}")])

    record_lookups(result, work, queries, lookup, one_namespace=False)
    sets = delete_sets(work, large)
    if sets is not None:
        def delete(occupants: list[int]) -> None:
            for o in occupants:
                index.remove_claim(rows[contents[o]], hashes[o], f"t{tenants[o]}")

        small, big = sets
        result.delete_small_n, result.delete_large_n = len(small), len(big)
        result.delete_small_s = timed(lambda: delete(small))
        result.delete_large_s = timed(lambda: delete(big))
        record_lookups(result, work, queries, lookup, one_namespace=False, after_delete=True)
    return result


def run_local_matcher(work: Workload, queries: list[Query], large: int) -> Result:
    result = Result("LocalMatcher (ours)", work.prefixes, work.occupants)
    matcher = LocalMatcher(work.chunk)
    per_doc = DOC_CHUNKS * work.chunk

    def build() -> None:
        for start in range(0, work.occupants, DOC_CHUNKS):  # one stored document at a time
            doc = int(work.content[start]) // DOC_CHUNKS
            matcher.register(work.rows[doc * DOC_CHUNKS:(doc + 1) * DOC_CHUNKS].reshape(per_doc),
                             work.hashes[start:start + DOC_CHUNKS],
                             position_offset=int(work.offset[start]))
        matcher.flush()

    result.build_s = timed(build)

    lookup = in_process(lambda q: [(m.hash, m.old_st, m.cur_st)
                                   for m in matcher.match(q.tokens)])

    record_lookups(result, work, queries, lookup, one_namespace=True)
    sets = delete_sets(work, large)
    if sets is not None:
        def delete(occupants: list[int]) -> None:
            matcher.evict([work.hashes[o] for o in occupants])
            matcher.flush()

        small, big = sets
        result.delete_small_n, result.delete_large_n = len(small), len(big)
        result.delete_small_s = timed(lambda: delete(small))
        result.delete_large_s = timed(lambda: delete(big))
        record_lookups(result, work, queries, lookup, one_namespace=True, after_delete=True)
    return result


def run_lmcache_local_matcher(work: Workload, queries: list[Query], large: int) -> Result:
    result = Result("LMCache local matcher", work.prefixes, work.occupants)
    matcher = BlendTokenRangeMatcher(chunk_size=work.chunk)
    per_doc = DOC_CHUNKS * work.chunk
    indexed = 0

    def build() -> None:
        nonlocal indexed
        for start in range(0, work.occupants, DOC_CHUNKS):
            doc = int(work.content[start]) // DOC_CHUNKS
            indexed += matcher.on_new_token_hashes(
                work.rows[doc * DOC_CHUNKS:(doc + 1) * DOC_CHUNKS].reshape(per_doc),
                work.hashes[start:start + DOC_CHUNKS], 0, int(work.offset[start]))

    # It logs a warning, then an error, per registration past 80% of its id space.
    logging.getLogger(BlendTokenRangeMatcher.__module__).setLevel(logging.CRITICAL)
    result.build_s = timed(build)
    if indexed < work.occupants:
        result.note = f"indexed {indexed:,} of {work.occupants:,} (its 2^20 id limit)"

    lookup = in_process(lambda q: [(m.hash, m.old_st, m.cur_st)
                                   for m in matcher.match_sub_sequence(q.tokens)])

    record_lookups(result, work, queries, lookup, one_namespace=True)
    sets = delete_sets(work, large)
    if sets is not None:
        small, big = sets
        result.delete_small_n, result.delete_large_n = len(small), len(big)
        result.delete_small_s = timed(
            lambda: matcher.remove_chunks([work.hashes[o] for o in small]))
        result.delete_large_s = timed(
            lambda: matcher.remove_chunks([work.hashes[o] for o in big]))
        record_lookups(result, work, queries, lookup, one_namespace=True, after_delete=True)
    return result


# --- the coordinator over HTTP ------------------------------------------------------------


class EventStream:
    """`POST /events` requests of the emitting instances (occupant o is stored by instance
    o % INSTANCES), numbered on per instance across calls."""

    def __init__(self, work: Workload, host: str, port: int) -> None:
        self.work, self.host, self.port = work, host, port
        self.seqs = [0] * INSTANCES
        self.token_json = [encode(row.tolist()) for row in work.rows]

    def requests(self, occupants: list[int], kind: str) -> list[list[bytes]]:
        """Per instance, its requests for `occupants`, one batch of up to BATCH_ENTRIES
        entries each; stores carry tokens and offsets, deletes only keys."""
        work = self.work
        per_instance: list[list[bytes]] = [[] for _ in range(INSTANCES)]
        entries: list[list[bytes]] = [[] for _ in range(INSTANCES)]

        def flush(inst: int) -> None:
            self.seqs[inst] += 1
            body = (b'{"batches":[{"instance_id":"server-%d","incarnation":0,"seq":%d,'
                    b'"event_type":"%s","tier":"l1","backend":"dram","entries":[%s]}]}'
                    % (inst, self.seqs[inst], kind.encode(), b",".join(entries[inst])))
            per_instance[inst].append(http_request("POST", EVENTS_PATH, self.host, self.port,
                                                   body))
            entries[inst].clear()

        for o in occupants:
            inst = o % INSTANCES
            key = (b'{"chunk_hash_hex":"%s","model_name":"%s","kv_rank":%d,'
                   b'"object_group_id":0,"cache_salt":"t%d"}'
                   % (work.hashes[o].hex().encode(), MODEL.encode(), KV_RANK,
                      work.tenant_of(o)))
            if kind == "delete":
                entries[inst].append(b'{"key":%s}' % key)
            else:
                entries[inst].append(b'{"key":%s,"size_bytes":1048576,"token_ids":%s,'
                                     b'"token_offset":%d}'
                                     % (key, self.token_json[work.content[o]],
                                        work.offset[o]))
            if len(entries[inst]) == BATCH_ENTRIES:
                flush(inst)
        for inst in range(INSTANCES):
            if entries[inst]:
                flush(inst)
        return per_instance


async def send_all(host: str, port: int, per_instance: list[list[bytes]]) -> int:
    async def one(requests: list[bytes]) -> int:
        connection = await Connection.open(host, port)
        applied = 0
        try:
            for request in requests:
                status, body = await connection.roundtrip(request)
                if status != 200:
                    raise RuntimeError(f"/events answered {status}: {body[:300]!r}")
                applied += decode(body, EventsReply).applied
        finally:
            connection.close()
        return applied

    return sum(await asyncio.gather(*(one(r) for r in per_instance)))


async def lookups_over_http(host: str, port: int, requests: list[bytes],
                            stop: asyncio.Event | None = None) -> list[tuple[float, bytes]]:
    """One client, one lookup at a time (latency, not throughput): every request once, or
    round and round until `stop` is set."""
    connection = await Connection.open(host, port)
    samples = []
    try:
        i = 0
        while True:
            if stop is None and i == len(requests):
                break
            if stop is not None and stop.is_set():
                break
            started = time.perf_counter()
            status, body = await connection.roundtrip(requests[i % len(requests)])
            samples.append((time.perf_counter() - started, body))
            if status != 200:
                raise RuntimeError(f"lookup answered {status}: {body[:300]!r}")
            i += 1
            if stop is not None:
                await asyncio.sleep(0)
    finally:
        connection.close()
    return samples


def run_coordinator(work: Workload, queries: list[Query], large: int) -> Result:
    result = Result("coordinator over HTTP (ours)", work.prefixes, work.occupants)
    running = start_coordinator("--enable-blend-lookup", "--chunk-size", str(work.chunk),
                                "--log-level", "WARNING")
    host, port = running.host, running.port
    server = psutil.Process(running.process.pid)
    try:
        asyncio.run(get_json(host, port, HEALTH_PATH))
        stream = EventStream(work, host, port)
        started = time.perf_counter()
        # A part at a time: the whole ingest would be gigabytes of JSON.
        part = BATCH_ENTRIES * INSTANCES * 16
        for start in range(0, work.occupants, part):
            occupants = list(range(start, min(work.occupants, start + part)))
            asyncio.run(send_all(host, port, stream.requests(occupants, "store")))
        result.build_s = time.perf_counter() - started
        stats = asyncio.run(get_json(host, port, STATS_PATH))
        if stats["blend"]["num_chunks"] != work.occupants:
            raise RuntimeError(f"indexed {stats['blend']['num_chunks']} of {work.occupants}")

        requests = [http_request("POST", BLEND_LOOKUP_PATH, host, port, encode({
            "tokens_b64": encode_tokens(q.tokens), "model_name": MODEL, "world_size": 1,
            "cache_salt": f"t{q.tenant}"})) for q in queries]

        def replayed(samples: list[tuple[float, bytes]]):
            """A lookup for `record_lookups` answering from round-trips already made."""
            replies = iter(samples)

            def lookup(query: Query):
                latency, body = next(replies)
                matches = decode(body, BlendLookupReply).matches
                return ([(bytes.fromhex(m.chunk_hash), m.old_st, m.cur_st) for m in matches],
                        len(body), latency)
            return lookup

        cpu = sum(server.cpu_times()[:2])
        samples = asyncio.run(lookups_over_http(host, port, requests))
        result.server_cpu_ms = (sum(server.cpu_times()[:2]) - cpu) / len(samples) * 1e3
        record_lookups(result, work, queries, replayed(samples), one_namespace=False)

        sets = delete_sets(work, large)
        if sets is not None:
            small, big = sets
            result.delete_small_n, result.delete_large_n = len(small), len(big)
            small_requests = stream.requests(small, "delete")
            big_requests = stream.requests(big, "delete")

            async def delete_while_looking_up(deletes: list[list[bytes]]
                                              ) -> tuple[float, list[float]]:
                """Both deletes run next to one lookup client, so their times compare."""
                stop = asyncio.Event()
                looking = asyncio.create_task(lookups_over_http(host, port, requests, stop))
                started = time.perf_counter()
                await send_all(host, port, deletes)
                elapsed = time.perf_counter() - started
                stop.set()
                return elapsed, [latency for latency, _ in await looking]

            result.delete_small_s, _ = asyncio.run(delete_while_looking_up(small_requests))
            result.delete_large_s, result.during_delete = asyncio.run(
                delete_while_looking_up(big_requests))
            samples = asyncio.run(lookups_over_http(host, port, requests))
            record_lookups(result, work, queries, replayed(samples), one_namespace=False,
                           after_delete=True)
    finally:
        code = running.stop(timeout=60)
    if code != 0:
        result.note = f"coordinator exit code {code}"
    return result


# --- report -----------------------------------------------------------------------------------


def summary(r: Result) -> dict:
    def mean(values):
        return float(np.mean(values)) if values else float("nan")

    per_op = lambda s, n: s / n * 1e6 if s is not None and n else None  # noqa: E731
    return {
        "p50": percentile_ms(r.latencies, 50), "p99": percentile_ms(r.latencies, 99),
        "matches": mean(r.matches), "bytes": mean(r.reply_bytes),
        "covered": mean(r.covered), "best": mean(r.best),
        "after": mean(r.covered_after_delete),
        "small_us": per_op(r.delete_small_s, r.delete_small_n),
        "large_us": per_op(r.delete_large_s, r.delete_large_n),
    }


def print_table(results: list[Result]) -> None:
    print(f"{'system':<30} {'P':>4} {'occupants':>10} {'build s':>8} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'matches':>8} {'reply B':>8} {'covered':>8} {'of best':>8} "
          f"{'del n/8 s':>9} {'del n s':>8} {'us/op n/8':>9} {'us/op n':>8} {'covered':>8}")
    print(f"{'':<30} {'':>4} {'':>10} {'':>8} {'':>7} {'':>7} {'/query':>8} {'/query':>8} "
          f"{'tokens':>8} {'':>8} {'':>9} {'':>8} {'':>9} {'':>8} {'after del':>8}")
    for r in results:
        s = summary(r)
        fmt = lambda v, spec: "-" if v is None or v != v else format(v, spec)  # noqa: E731
        print(f"{r.system:<30} {r.prefixes:>4} {r.occupants:>10,} {r.build_s:>8.1f} "
              f"{s['p50']:>7.2f} {s['p99']:>7.2f} {s['matches']:>8.1f} "
              f"{fmt(s['bytes'] if r.reply_bytes and s['bytes'] else None, '8,.0f'):>8} "
              f"{s['covered']:>8,.0f} {s['covered'] / s['best']:>8.3f} "
              f"{fmt(r.delete_small_s, '9.2f'):>9} {fmt(r.delete_large_s, '8.2f'):>8} "
              f"{fmt(s['small_us'], '9.1f'):>9} {fmt(s['large_us'], '8.1f'):>8} "
              f"{fmt(s['after'], '8,.0f'):>8}"
              + (f"  [{r.note}]" if r.note else "") + (f"  wrong answers: {r.wrong}"
                                                       if r.wrong else ""))
        if r.server_cpu_ms is not None:
            during = (f"; lookups while deleting: p50 {percentile_ms(r.during_delete, 50):.2f} "
                      f"ms, p99 {percentile_ms(r.during_delete, 99):.2f} ms over "
                      f"{len(r.during_delete)}" if r.during_delete else "")
            print(f"{'':<30} (coordinator CPU {r.server_cpu_ms:.2f} ms per lookup{during})")


def print_ratios(results: list[Result]) -> list[str]:
    """The target lines; returns the names of targets missed."""
    missed = []
    by = {(r.system, r.prefixes): r for r in results}
    ps = sorted({r.prefixes for r in results})
    low, high = ps[0], ps[-1]
    print()
    for system in dict.fromkeys(r.system for r in results):
        a, b = by.get((system, low)), by.get((system, high))
        if a is None or b is None or low == high:
            continue
        sa, sb = summary(a), summary(b)
        p50_ratio = sb["p50"] / sa["p50"]
        size_ratio = sb["matches"] / sa["matches"] if sa["matches"] else float("inf")
        ours = "ours" in system
        print(f"{system:<30} P={high} over P={low}: lookup p50 x{p50_ratio:.2f}, "
              f"matches/query x{size_ratio:.2f}"
              + (" (target: within 1.5x)" if ours else ""))
        if ours and (p50_ratio > 1.5 or size_ratio > 1.5):
            missed.append(f"{system}: independent of prefixes")
    for r in results:
        s = summary(r)
        if s["small_us"] and s["large_us"]:
            ratio = s["large_us"] / s["small_us"]
            print(f"{r.system:<30} P={r.prefixes}: delete {r.delete_large_n:,} vs "
                  f"{r.delete_small_n:,}: per occupant x{ratio:.2f} (1 = linear)")
            if "ours" in r.system and ratio > 2.0:
                missed.append(f"{r.system}: delete linear")
    pairs = [("ContentIndex (ours)", "LMCache BlendIndex"),
             ("coordinator over HTTP (ours)", "LMCache BlendIndex"),
             ("LocalMatcher (ours)", "LMCache local matcher")]
    for p in ps:
        for ours, theirs in pairs:
            a, b = by.get((ours, p)), by.get((theirs, p))
            if a is None or b is None:
                continue
            sa, sb = summary(a), summary(b)
            print(f"covered tokens P={p}: {ours} {sa['covered']:,.0f} vs {theirs} "
                  f"{sb['covered']:,.0f} = x{sa['covered'] / sb['covered']:.2f}; lookup p50 "
                  f"x{sa['p50'] / sb['p50']:.2f} (target: covered >= x1.00)")
            if sa["covered"] < sb["covered"]:
                missed.append(f"{ours}: covered tokens >= {theirs}")
    return missed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_popular_documents",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--prefixes", type=int, nargs="+", default=[1, 100],
                        help="prefixes each document is stored behind (one run per value)")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--delete", type=int, default=100_000,
                        help="occupants deleted (after deleting an eighth as many)")
    parser.add_argument("--skip-http", action="store_true", help="no coordinator run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    print(f"machine: {machine_description()}")
    print(f"workload: {args.docs:,} documents of {DOC_CHUNKS} chunks x {args.chunk_size} "
          f"tokens, each behind P prefixes (P in {args.prefixes}), {args.tenants} tenants; "
          f"{args.queries} queries of {DISTINCT_PER_QUERY} documents + {REPEATS_PER_QUERY} "
          f"repeats with filler; lookups one at a time")
    if LMCACHE_MISSING:
        print(f"LMCache not importable ({LMCACHE_MISSING}): its columns are left out")
    else:
        print("LMCache 0.5.6 BlendIndex and BlendTokenRangeMatcher imported from the "
              "installed lmcache package")
    runners = [run_content_index, run_local_matcher]
    if LMCacheBlendIndex is not None:
        runners.insert(1, run_lmcache_blend_index)
    if BlendTokenRangeMatcher is not None:
        runners.append(run_lmcache_local_matcher)
    if not args.skip_http:
        runners.append(run_coordinator)
    results = []
    for prefixes in args.prefixes:
        work = build_workload(args.docs, prefixes, args.tenants, args.chunk_size, args.seed)
        queries = build_queries(work, args.queries, args.seed)
        print(f"P={prefixes}: {work.occupants:,} occupants of {len(work.rows):,} contents; "
              f"query ~{int(np.mean([q.tokens.size for q in queries])):,} tokens", flush=True)
        for runner in runners:
            release_free_memory()
            result = runner(work, queries, args.delete)
            results.append(result)
            s = summary(result)
            print(f"  {result.system}: built in {result.build_s:.1f} s, p50 {s['p50']:.2f} ms",
                  flush=True)
        del work, queries
    print()
    print_table(results)
    missed = print_ratios(results)
    print()
    print("targets: " + ("all met" if not missed else "MISSED: " + "; ".join(missed)))
    wrong = sum(r.wrong for r in results if "ours" in r.system)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
