"""Where the coordinator's CPU goes, per lookup and per ingested chunk (`bench_coordinator
--profile`).

The whole is what the benchmark measured in the same run: the coordinator process's CPU
time per lookup (8 clients) and per ingested chunk. The parts are measured here, each
stage alone with the same bodies, by CPU time (`time.thread_time`, one thread at a time):

- HTTP parsing: aiohttp's request parser (the one the coordinator's server uses) fed the
  request's bytes, the body read from its payload stream;
- HTTP serving: a server set up as the coordinator's (`benchmarks.http_floor`) answering
  canned replies of the same size, driven like the coordinator (8 clients for lookups,
  one connection per emitter for ingest): its process CPU per request is the whole HTTP
  cost (parsing included), socket calls and the event loop's turns;
- body decoding and validation: the blend-lookup shape (`Coordinator.parse_lookup`), the
  tokens (`decode_tokens`); for `/events`, the body's outline, then each batch decoded
  and validated (`CacheEventBatch`, its token lists parsed by the kernel);
- hand-off: a job sent to the ingest scheduler and its result awaited on the event loop,
  with no work in it (process CPU: the loop and the worker). A lookup takes no hand-off
  here: the benchmark's lookups are matched on the loop (the match pool is idle); what
  the pool's hand-off would cost is printed below the breakdown, for reference;
- kernel: the match itself (`KeyDirectory.match`, the floor), and for ingest the
  directory applying a batch (`KeyDirectory.ingest`: gating, placements, index adds);
- reply: building the reply value and encoding it.

Each figure is printed as a share of the whole and as a multiple of the floor; what the
parts do not account for (thread switches, GIL hand-offs, the loop's bookkeeping under
concurrency) is the remainder.
"""

from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import dataclass, field

import numpy as np
import psutil

from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_parser import HttpRequestParser
from aiohttp.web_protocol import RequestPayloadError

from blend_wire import (BlendLookupReply, WireBlendMatch,
                        decode_tokens, encode)
from coordinator_stub.config import CoordinatorConfig
from coordinator_stub.directory import Tally
from coordinator_stub.writes.fair_ingest import FairIngest
from coordinator_stub.writes.validation import decode_raw_batch, outline
from coordinator_stub.service.matchpool import FairPool
from coordinator_stub.http.metrics import CoordinatorMetrics
from coordinator_stub.launch.process import start_coordinator
from coordinator_stub.service.coordinator import Coordinator


@dataclass
class Breakdown:
    """µs per unit (one lookup, or one ingested chunk) of each stage, in order."""

    unit: str
    whole: float
    stages: dict[str, float] = field(default_factory=dict)
    floor_stage: str = ""
    aside: dict[str, float] = field(default_factory=dict)  # not on the path measured


def _split(request: bytes) -> bytes:
    return request[request.index(b"\r\n\r\n") + 4:]


def _cpu(fn, *args) -> tuple[float, object]:
    started = time.thread_time()
    result = fn(*args)
    return time.thread_time() - started, result


# --- in-process stages ---------------------------------------------------------------------


class _Unpaused(BaseProtocol):
    """A protocol with no transport: its payload streams are read at once, never paused."""

    def pause_reading(self) -> None:
        pass

    def resume_reading(self, resume_parser: bool = True) -> None:
        pass


def http_parse_us(requests: list[bytes], repeat: int = 1) -> float:
    """aiohttp's request parser on each request, body read from its stream: µs each."""
    async def run() -> float:
        loop = asyncio.get_running_loop()
        parser = HttpRequestParser(_Unpaused(loop), loop, 2**16, max_line_size=8190,
                                   max_field_size=8190, max_headers=128,
                                   payload_exception=RequestPayloadError,
                                   auto_decompress=True, max_msg_queue_size=32)
        spent = 0.0
        for _ in range(repeat):
            for request in requests:
                started = time.thread_time()
                messages, _, _ = parser.feed_data(request)
                body = await messages[0][1].read()
                spent += time.thread_time() - started
                assert len(body) == len(_split(request))
        return spent * 1e6 / (repeat * len(requests))
    return asyncio.run(run())


def ingest_stages(coordinator: Coordinator, per_instance: list[list[bytes]]) -> dict:
    """Apply every body in process, emitters taking turns as on the wire; seconds of CPU
    per stage, in all, and the chunks applied."""
    spent = dict.fromkeys(("outline", "decode", "apply", "reply"), 0.0)
    chunks = 0
    rounds = max(map(len, per_instance))
    for r in range(rounds):
        for requests in per_instance:
            if r >= len(requests):
                continue
            took, raws = _cpu(outline, _split(requests[r]))
            spent["outline"] += took
            tally = Tally()
            for i, raw in enumerate(raws):
                took, batch = _cpu(decode_raw_batch, raw, i)
                spent["decode"] += took
                # What the local write path does with a validated batch.
                took, reply = _cpu(coordinator.ingest, [batch])
                spent["apply"] += took
                tally.add(reply)
                chunks += len(batch.entries)
                assert reply.applied == 1, reply
            took, _ = _cpu(lambda: encode(tally.reply()))
            spent["reply"] += took
    return {"seconds": spent, "chunks": chunks}


def lookup_stages(coordinator: Coordinator, requests: list[bytes], repeat: int = 2) -> dict:
    """Each lookup's stages in process: µs per lookup of each."""
    metrics = CoordinatorMetrics(coordinator.directory, lambda: 0)
    spent = dict.fromkeys(("parse", "tokens", "match", "reply", "encode", "metrics"), 0.0)
    bodies = [_split(r) for r in requests]
    for _ in range(repeat):
        for body in bodies:
            took, request = _cpu(coordinator.parse_lookup, body)
            spent["parse"] += took
            took, tokens = _cpu(decode_tokens, request.tokens_b64)
            spent["tokens"] += took
            took, _ = _cpu(coordinator.directory.match, tokens, request.namespace)
            spent["match"] += took
            took, found = _cpu(coordinator.directory.match, tokens, request.namespace)
            took, reply = _cpu(_reply_of, found)
            spent["reply"] += took
            took, _ = _cpu(encode, reply)
            spent["encode"] += took
            took, _ = _cpu(metrics.observe_lookup, "blend-lookup", 0.001, len(reply.matches))
            spent["metrics"] += took
    n = repeat * len(bodies)
    return {name: seconds * 1e6 / n for name, seconds in spent.items()}


def _reply_of(found: list) -> BlendLookupReply:
    """The reply value as `Coordinator.matches` builds it from the index's matches."""
    return BlendLookupReply(matches=[
        WireBlendMatch(chunk_hash=m.chunk_hash.hex(), old_st=m.old_st, cur_st=m.cur_st)
        for m in found])


def handoff_us(rounds: int = 3000) -> tuple[float, float]:
    """(match pool, ingest scheduler): process CPU µs of one empty job sent from the event
    loop and its result awaited there (the pool's: what a lookup the loop does not match
    itself pays)."""
    process = psutil.Process()

    def cpu() -> float:
        times = process.cpu_times()
        return times.user + times.system

    async def through_pool() -> float:
        pool = FairPool(1, "profile-match")
        try:
            await pool.submit_async(("peer", "x"), 40_000, int)
            started = cpu()
            for _ in range(rounds):
                await pool.submit_async(("peer", "x"), 40_000, int)
            return (cpu() - started) * 1e6 / rounds
        finally:
            pool.shutdown()

    async def through_ingest() -> float:
        ingest = FairIngest(lambda batches, scope=None: Tally())
        ingest.start()
        body = b'{"batches": []}'
        try:
            await asyncio.wrap_future(ingest.submit(body))
            started = cpu()
            for _ in range(rounds):
                await asyncio.wrap_future(ingest.submit(body))
            return (cpu() - started) * 1e6 / rounds
        finally:
            ingest.close()

    return asyncio.run(through_pool()), asyncio.run(through_ingest())


# --- HTTP serving alone, in a child --------------------------------------------------------


def http_serving_us(per_instance: list[list[bytes]], lookups: list[bytes], clients: int,
                    duration: float, matches: int) -> tuple[float, float, int]:
    """(µs per lookup request, s for all the ingest bodies, bodies) of the HTTP floor
    server's process CPU, driven as the benchmark drives the coordinator."""
    from benchmarks.bench_coordinator import Query, run_ingest, run_lookups

    running = start_coordinator("--matches", str(matches), module="benchmarks.http_floor")
    try:
        child = psutil.Process(running.process.pid)

        def cpu() -> float:
            times = child.cpu_times()
            return times.user + times.system

        started = cpu()
        asyncio.run(run_ingest(running.host, running.port, per_instance))
        ingest_cpu = cpu() - started
        started = cpu()
        samples = asyncio.run(run_lookups(running.host, running.port,
                                          [Query(r, set()) for r in lookups], clients,
                                          duration))
        lookup_cpu = cpu() - started
    finally:
        running.stop()
    bodies = sum(len(requests) for requests in per_instance)
    return lookup_cpu * 1e6 / max(len(samples), 1), ingest_cpu, bodies


# --- the whole run -------------------------------------------------------------------------


def profile(per_instance: list[list[bytes]], lookups: list[bytes], chunk_size: int,
            chunks: int, clients: int, duration: float, whole_lookup_us: float,
            whole_chunk_us: float) -> tuple[Breakdown, Breakdown]:
    """Both breakdowns (see the module doc); `whole_*` are the benchmark's figures."""
    gc.set_threshold(50_000, 20, 10)  # as the coordinator process runs (its __main__)
    coordinator = Coordinator(CoordinatorConfig(enable_blend_lookup=True,
                                                chunk_size=chunk_size))
    ingest = ingest_stages(coordinator, per_instance)
    assert ingest["chunks"] == chunks, (ingest["chunks"], chunks)
    gc.collect()
    gc.freeze()
    lookup = lookup_stages(coordinator, lookups)
    pool_us, ingest_handoff_us = handoff_us()
    flat = [r for requests in per_instance for r in requests]
    parse_lookup_us = http_parse_us(lookups[:200], repeat=5)
    parse_body_us = http_parse_us(flat[:40])
    matches = int(round(np.mean([len(decode_reply.matches) for decode_reply in
                                 [coordinator.matches(coordinator.parse_lookup(_split(r)))
                                  for r in lookups[:50]]])))
    serve_lookup_us, serve_ingest_s, bodies = http_serving_us(per_instance, lookups, clients,
                                                              min(duration, 5.0), matches)
    per_chunk = 1e6 / chunks
    seconds = ingest["seconds"]
    lookup_breakdown = Breakdown("lookup", whole_lookup_us, {
        "HTTP parsing (aiohttp's parser, in process)": parse_lookup_us,
        "HTTP serving, all of it (canned-reply server)": serve_lookup_us,
        "decode + validate the body (msgspec)": lookup["parse"],
        "decode tokens_b64 (kernel)": lookup["tokens"],
        "match (kernel): the floor": lookup["match"],
        "build the reply value": lookup["reply"],
        "encode the reply": lookup["encode"],
        "metrics (latency histogram, matches)": lookup["metrics"],
    }, "match (kernel): the floor",
        {"hand-off to the match pool and back (a lookup not matched on the loop)": pool_us})
    ingest_breakdown = Breakdown("ingested chunk", whole_chunk_us, {
        "HTTP parsing (aiohttp's parser, in process)": parse_body_us * bodies / chunks,
        "HTTP serving, all of it (canned-reply server)": serve_ingest_s * per_chunk,
        "outline scan (kernel)": seconds["outline"] * per_chunk,
        "decode + validate batches (msgspec + token-list kernel)":
            seconds["decode"] * per_chunk,
        "hand-off to the ingest thread and back": ingest_handoff_us * bodies / chunks,
        "apply (directory + index add): the floor": seconds["apply"] * per_chunk,
        "encode the reply": seconds["reply"] * per_chunk,
    }, "apply (directory + index add): the floor")
    return lookup_breakdown, ingest_breakdown


def report(breakdown: Breakdown) -> None:
    floor = breakdown.stages[breakdown.floor_stage]
    print(f"  where one {breakdown.unit} goes: whole {breakdown.whole:,.1f} us of coordinator "
          f"CPU (measured above, same run); floor {floor:,.1f} us "
          f"(whole = {breakdown.whole / floor:.1f}x the floor)")
    counted = 0.0
    for name, us in breakdown.stages.items():
        inside = name.startswith("HTTP parsing")  # part of the serving figure below it
        if not inside:
            counted += us
        print(f"    {name:<58} {us:9.1f} us {us / breakdown.whole:6.1%} "
              f"{us / floor:6.2f}x floor{'  (inside the next line)' if inside else ''}")
    rest = breakdown.whole - counted
    print(f"    {'remainder (switches, GIL, loop under concurrency)':<58} {rest:9.1f} us "
          f"{rest / breakdown.whole:6.1%} {rest / floor:6.2f}x floor")
    for name, us in breakdown.aside.items():
        print(f"    not on this path: {name} {us:.1f} us")
