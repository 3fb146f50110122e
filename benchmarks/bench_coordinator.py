"""Benchmark of the bundled coordinator against LMCache 0.5.6's, through real HTTP.

Run: `python -m benchmarks.bench_coordinator [--chunks N] [--clients 8] [--duration 10] ...`
(`--help` lists every size). What it does, all on 127.0.0.1:

1. starts `python -m coordinator_stub --enable-blend-lookup` as a subprocess;
2. ingest: feeds N stored chunks (sequences of 16 chunks of 256 tokens, prefix-chained
   hashes, tenants t0..t3 as cache salts, token ids as JSON lists, 512 entries per batch)
   through `POST /events`, one connection per emitting instance, and reports chunks/s;
3. memory: the coordinator's resident-set growth over the ingest, per indexed chunk;
4. lookups: queries of about 8,000 tokens, each holding 16 stored chunks of the
   requester's tenant at random offsets, from 8 concurrent clients for 10 s: lookups/s,
   p50, p99 and recall (every planted chunk must come back with its stored offset);
5. prints the figures next to LMCache 0.5.6's coordinator measured on the same kind of
   2-core machine (issue 3) with our ratio to them, and the load generator's own CPU use.

The load generator is this process: every request (HTTP head and JSON body) is encoded
before the clock starts and sent over a minimal keep-alive HTTP/1.1 client on asyncio
streams, so what is timed is the coordinator, not the client. Replies are checked after
the timed window.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import resource
import sys
import time
from dataclasses import dataclass

import msgspec
import numpy as np
import psutil

from benchmarks.common import machine_description
from coordinator_stub.process import start_coordinator
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

#: LMCache 0.5.6's coordinator on this 2-core machine, load generator on the same cores.
REFERENCE = {"ingest_chunks_s": 8100.0, "lookups_s": 728.0, "p50_ms": 10.6, "p99_ms": 20.6,
             "bytes_per_chunk": 3.9e3}
#: What issue 3 asks of ours.
TARGET = {"ingest_ratio": 3.0, "lookups_ratio": 3.0, "p99_ratio": 1 / 3,
          "bytes_per_chunk": 2048.0}

MODEL = "bench-model"
VOCAB = 128_256  # Llama-3 vocabulary size: realistic token-id range (17 bits)


# --- the machine and the process under test -------------------------------------------------


def cpu_seconds_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --- a minimal keep-alive HTTP/1.1 client (loopback only) -----------------------------------


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, host: str, port: int) -> "Connection":
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        return cls(reader, writer)

    async def roundtrip(self, request: bytes) -> tuple[int, bytes]:
        self.writer.write(request)
        await self.writer.drain()
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        at = head.lower().find(b"content-length:")
        length = int(head[at + 15:head.index(b"\r\n", at)])
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


def http_request(method: str, path: str, host: str, port: int, body: bytes = b"") -> bytes:
    head = (f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode("ascii") + body


async def get_json(host: str, port: int, path: str) -> dict:
    connection = await Connection.open(host, port)
    try:
        status, body = await connection.roundtrip(http_request("GET", path, host, port))
        assert status == 200, (path, status, body[:200])
        return msgspec.json.decode(body)
    finally:
        connection.close()


# --- the workload -----------------------------------------------------------------------------


@dataclass
class Corpus:
    tokens: np.ndarray  # (N, C) uint32
    hashes: list[bytes]
    offsets: np.ndarray  # stored offset of each chunk
    tenant: np.ndarray  # tenant index of each chunk
    instance: np.ndarray  # emitting instance of each chunk


def build_corpus(n: int, chunk_size: int, per_seq: int, tenants: int, instances: int,
                 rng: np.random.Generator) -> Corpus:
    tokens = rng.integers(0, VOCAB, size=(n, chunk_size), dtype=np.uint32)
    hashes, offsets = [], np.empty(n, dtype=np.int64)
    seq_of = np.arange(n) // per_seq
    previous = b""
    for i in range(n):
        position = i % per_seq
        if position == 0:
            previous = b""
        # Prefix-chained like a serving process's chunk hashes: the same text behind
        # another prefix is another chunk.
        previous = hashlib.blake2b(previous + tokens[i].tobytes(), digest_size=32).digest()
        hashes.append(previous)
        offsets[i] = position * chunk_size
    return Corpus(tokens, hashes, offsets, (seq_of % tenants).astype(np.int64),
                  (seq_of % instances).astype(np.int64))


def ingest_requests(corpus: Corpus, batch_size: int, instances: int, host: str, port: int
                    ) -> list[list[bytes]]:
    """Per instance, its `POST /events` requests in seq order (one batch each)."""
    kv_rank = pack_kv_rank(1)
    per_instance: list[list[bytes]] = []
    for inst in range(instances):
        rows = np.flatnonzero(corpus.instance == inst)
        requests = []
        for seq, start in enumerate(range(0, len(rows), batch_size), start=1):
            entries = [{
                "key": {"chunk_hash_hex": corpus.hashes[i].hex(), "model_name": MODEL,
                        "kv_rank": kv_rank, "object_group_id": 0,
                        "cache_salt": f"t{corpus.tenant[i]}"},
                "size_bytes": 1 << 20,
                "token_ids": corpus.tokens[i].tolist(),
                "token_offset": int(corpus.offsets[i]),
            } for i in rows[start:start + batch_size]]
            batch = {"instance_id": f"server-{inst}", "incarnation": 0, "seq": seq,
                     "event_type": "store", "tier": "l1", "backend": "dram",
                     "entries": entries, "ts": time.time()}
            body = encode({"batches": [batch]})
            requests.append(http_request("POST", EVENTS_PATH, host, port, body))
        per_instance.append(requests)
    return per_instance


@dataclass
class Query:
    request: bytes
    expected: set[tuple[str, int, int]]  # (chunk_hash hex, old_st, cur_st)


def build_queries(corpus: Corpus, count: int, length: int, planted: int, tenants: int,
                  host: str, port: int, rng: np.random.Generator) -> list[Query]:
    chunk_size = corpus.tokens.shape[1]
    filler_total = max(0, length - planted * chunk_size)
    by_tenant = [np.flatnonzero(corpus.tenant == t) for t in range(tenants)]
    queries = []
    for _ in range(count):
        tenant = int(rng.integers(tenants))
        chosen = rng.choice(by_tenant[tenant], size=planted, replace=False)
        # Random gaps of filler around the planted chunks: random offsets, no overlap.
        cuts = np.sort(rng.integers(0, filler_total + 1, size=planted))
        gaps = np.diff(np.concatenate([[0], cuts, [filler_total]]))
        parts, expected, position = [], set(), 0
        for gap, row in zip(gaps[:-1], chosen):
            parts.append(rng.integers(0, VOCAB, size=gap, dtype=np.uint32))
            position += int(gap)
            parts.append(corpus.tokens[row])
            expected.add((corpus.hashes[row].hex(), int(corpus.offsets[row]), position))
            position += chunk_size
        parts.append(rng.integers(0, VOCAB, size=gaps[-1], dtype=np.uint32))
        body = encode({"tokens_b64": encode_tokens(np.concatenate(parts)), "model_name": MODEL,
                       "world_size": 1, "cache_salt": f"t{tenant}"})
        queries.append(Query(http_request("POST", BLEND_LOOKUP_PATH, host, port, body),
                             expected))
    return queries


# --- phases -------------------------------------------------------------------------------


async def run_ingest(host: str, port: int, per_instance: list[list[bytes]]) -> list[bytes]:
    async def one_instance(requests: list[bytes]) -> list[bytes]:
        connection = await Connection.open(host, port)
        replies = []
        try:
            for request in requests:
                status, body = await connection.roundtrip(request)
                if status != 200:
                    raise RuntimeError(f"ingest answered {status}: {body[:300]!r}")
                replies.append(body)
        finally:
            connection.close()
        return replies

    results = await asyncio.gather(*(one_instance(r) for r in per_instance))
    return [reply for replies in results for reply in replies]


async def run_lookups(host: str, port: int, queries: list[Query], clients: int,
                      duration: float) -> list[tuple[float, int, bytes]]:
    """(latency s, query index, reply body) of every lookup completed in the window."""
    samples: list[tuple[float, int, bytes]] = []
    connections = [await Connection.open(host, port) for _ in range(clients)]
    deadline = time.perf_counter() + duration

    async def client(number: int, connection: Connection) -> None:
        index = number
        while time.perf_counter() < deadline:
            query = index % len(queries)
            started = time.perf_counter()
            status, body = await connection.roundtrip(queries[query].request)
            elapsed = time.perf_counter() - started
            if status != 200:
                raise RuntimeError(f"lookup answered {status}: {body[:300]!r}")
            samples.append((elapsed, query, body))
            index += clients

    try:
        await asyncio.gather(*(client(i, c) for i, c in enumerate(connections)))
    finally:
        for connection in connections:
            connection.close()
    return samples


def recall_of(samples, queries: list[Query]) -> tuple[float, int]:
    """(fraction of planted chunks returned with the right offsets, unexpected matches)."""
    found = wanted = extra = 0
    for _, index, body in samples:
        reply = decode(body, BlendLookupReply)
        got = {(m.chunk_hash, m.old_st, m.cur_st) for m in reply.matches}
        expected = queries[index].expected
        wanted += len(expected)
        found += len(got & expected)
        extra += len(got - expected)
    return (found / wanted if wanted else 0.0), extra


# --- main ------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_coordinator",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=200_000, help="stored chunks N")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk")
    parser.add_argument("--chunks-per-sequence", type=int, default=16)
    parser.add_argument("--batch-entries", type=int, default=512, help="entries per batch")
    parser.add_argument("--tenants", type=int, default=4, help="cache salts t0..t(k-1)")
    parser.add_argument("--instances", type=int, default=4,
                        help="emitting instances, one connection each during ingest")
    parser.add_argument("--query-tokens", type=int, default=8000, help="tokens per lookup")
    parser.add_argument("--planted", type=int, default=16, help="stored chunks per lookup")
    parser.add_argument("--queries", type=int, default=1000, help="distinct lookup bodies")
    parser.add_argument("--clients", type=int, default=8, help="concurrent lookup clients")
    parser.add_argument("--duration", type=float, default=10.0, help="lookup window, seconds")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def ratio_line(name: str, ours: float, reference: float, unit: str, better: str,
               target: str) -> str:
    ratio = ours / reference
    return (f"  {name:<22} {ours:>12,.1f} {unit:<10} LMCache 0.5.6 {reference:>9,.1f}   "
            f"ratio {ratio:6.2f}x ({better}; target {target})")


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    print(f"machine: {machine_description()}")
    print(f"workload: {args.chunks:,} chunks of {args.chunk_size} tokens in sequences of "
          f"{args.chunks_per_sequence}, {args.batch_entries} entries/batch, "
          f"{args.tenants} tenants, {args.instances} instances; lookups of "
          f"{args.query_tokens} tokens holding {args.planted} chunks, {args.clients} clients, "
          f"{args.duration:.0f} s", flush=True)

    started = time.perf_counter()
    corpus = build_corpus(args.chunks, args.chunk_size, args.chunks_per_sequence, args.tenants,
                          args.instances, rng)
    running = start_coordinator("--enable-blend-lookup", "--chunk-size", str(args.chunk_size),
                                "--log-level", "WARNING")
    host, port = running.host, running.port
    coordinator = psutil.Process(running.process.pid)
    try:
        per_instance = ingest_requests(corpus, args.batch_entries, args.instances, host, port)
        queries = build_queries(corpus, args.queries, args.query_tokens, args.planted,
                                args.tenants, host, port, rng)
        body_bytes = sum(len(r) for rs in per_instance for r in rs)
        print(f"prepared {sum(map(len, per_instance))} ingest requests "
              f"({body_bytes / 2**20:.0f} MiB) and {len(queries)} lookups in "
              f"{time.perf_counter() - started:.1f} s", flush=True)

        asyncio.run(get_json(host, port, HEALTH_PATH))
        time.sleep(0.5)
        rss_before = coordinator.memory_info().rss

        # (1) ingest
        gen_cpu, coord_cpu = cpu_seconds_self(), sum(coordinator.cpu_times()[:2])
        t0 = time.perf_counter()
        replies = asyncio.run(run_ingest(host, port, per_instance))
        ingest_s = time.perf_counter() - t0
        ingest_gen_cpu = (cpu_seconds_self() - gen_cpu) / ingest_s
        ingest_coord_cpu = (sum(coordinator.cpu_times()[:2]) - coord_cpu) / ingest_s
        applied = sum(decode(r, EventsReply).applied for r in replies)
        assert applied == len(replies), f"only {applied} of {len(replies)} batches applied"
        time.sleep(0.5)
        stats = asyncio.run(get_json(host, port, STATS_PATH))
        indexed = stats["blend"]["num_chunks"]
        assert stats["num_keys"] == args.chunks and indexed == args.chunks, stats
        rss_after = coordinator.memory_info().rss
        per_chunk = (rss_after - rss_before) / indexed
        ingest_rate = args.chunks / ingest_s

        # (2) lookups
        gen_cpu, coord_cpu = cpu_seconds_self(), sum(coordinator.cpu_times()[:2])
        t0 = time.perf_counter()
        samples = asyncio.run(run_lookups(host, port, queries, args.clients, args.duration))
        lookup_s = time.perf_counter() - t0
        lookup_gen_cpu = (cpu_seconds_self() - gen_cpu) / lookup_s
        lookup_coord_cpu = (sum(coordinator.cpu_times()[:2]) - coord_cpu) / lookup_s
        latencies = np.array([s[0] for s in samples])
        p50, p99 = (float(np.percentile(latencies, q)) * 1e3 for q in (50, 99))
        recall, extra = recall_of(samples, queries)
        lookup_rate = len(samples) / lookup_s
    finally:
        exit_code = running.stop(timeout=30)

    print()
    print(f"ingest:  {args.chunks:,} chunks in {ingest_s:.2f} s = {ingest_rate:,.0f} chunks/s "
          f"({len(replies)} batches); coordinator CPU {ingest_coord_cpu:.0%} of one core, "
          f"load generator CPU {ingest_gen_cpu:.0%}")
    print(f"memory:  RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB = "
          f"{per_chunk:,.0f} bytes per indexed chunk (index itself reports "
          f"{stats['blend']['bytes'] / indexed:,.0f} bytes/chunk)")
    print(f"lookups: {len(samples):,} in {lookup_s:.1f} s = {lookup_rate:,.0f}/s, "
          f"p50 {p50:.2f} ms, p99 {p99:.2f} ms, recall {recall:.3f} "
          f"({extra} unexpected matches); coordinator CPU {lookup_coord_cpu:.0%} of one core, "
          f"load generator CPU {lookup_gen_cpu:.0%}")
    print(f"coordinator exit code on SIGTERM: {exit_code}")
    print()
    print("against LMCache 0.5.6's coordinator (same 2-core machine, issue 3):")
    print(ratio_line("ingest", ingest_rate, REFERENCE["ingest_chunks_s"], "chunks/s",
                     "higher is better", ">= 3x"))
    print(ratio_line("lookups", lookup_rate, REFERENCE["lookups_s"], "lookups/s",
                     "higher is better", ">= 3x"))
    print(ratio_line("p50 latency", p50, REFERENCE["p50_ms"], "ms", "lower is better", "-"))
    print(ratio_line("p99 latency", p99, REFERENCE["p99_ms"], "ms", "lower is better",
                     "<= 0.33x"))
    print(ratio_line("memory per chunk", per_chunk, REFERENCE["bytes_per_chunk"], "bytes",
                     "lower is better", "<= 2,048 bytes"))
    verdicts = {
        "ingest >= 3x": ingest_rate >= TARGET["ingest_ratio"] * REFERENCE["ingest_chunks_s"],
        "lookups >= 3x": lookup_rate >= TARGET["lookups_ratio"] * REFERENCE["lookups_s"],
        "p99 <= 1/3": p99 <= TARGET["p99_ratio"] * REFERENCE["p99_ms"],
        "memory <= 2 KB/chunk": per_chunk <= TARGET["bytes_per_chunk"],
        "recall 1.000": recall == 1.0 and extra == 0,
    }
    print("targets: " + ", ".join(f"{name} {'met' if ok else 'MISSED'}"
                                  for name, ok in verdicts.items()))
    # A missed performance target is reported above; only a wrong answer (recall) or an
    # unclean shutdown fails the run, so `make bench` goes on to the other benchmarks.
    return 0 if verdicts["recall 1.000"] and exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
