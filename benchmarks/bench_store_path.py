"""Store path benchmark: the CPU a serving process spends per stored chunk, ours vs LMCache's.

Both sides store the same requests (4,096 tokens: 16 chunks of 256) and deliver their
cache events to the same coordinator process (ours; it reads LMCache's `/events`), one
POST per `--flush-every` stores. Only this process's CPU is counted (process_time), so
the coordinator's share is left out on both sides.
- ours: `BlendPlugin.on_store` (local matcher registration, STORE events queued), the
  reporter's `flush()` (batches formed, token lists written by one kernel call per batch,
  the POST), and the local matcher's background indexing;
- LMCache 0.5.6: its local matcher's `on_new_token_hashes`, the token bindings its server
  publishes at store submission (`MP_TOKENS`), the L1 write-finished event, both through its
  own `CacheEventSubscriber` callbacks, and its `flush()` through `HttpCacheEventSink`
  (pydantic `model_dump`, httpx JSON).
Rounds alternate between the two (the machine is shared); the table gives each round.

    python -m benchmarks.bench_store_path [--stores 2000] [--flush-every 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import time

import numpy as np

from benchmarks.common import machine_description
from benchmarks.lmcache_reference import lmcache_version
from blend_wire import (CacheEventBatch, CacheEventEntry, EncodedObjectKey, EventsRequest,
                        encode, token_lists_to_json)
from coordinator_stub.launch.process import start_coordinator
from plugin import BlendPlugin, InMemoryHost, LookupKey, PluginConfig

CHUNK = 256
CHUNKS_PER_STORE = 16
MODEL = "bench-model"
VOCAB = 128_000


def requests(count: int, seed: int) -> list[list[int]]:
    """Each request's tokens as a list of ints: what LMCache's server holds (its events
    carry Python ints), and so what both sides are given."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, CHUNKS_PER_STORE * CHUNK, dtype=np.uint32).tolist()
            for _ in range(count)]


def ours(url: str, stores: list[list[int]], flush_every: int, tag: str) -> float:
    """CPU seconds per stored chunk of our plugin's store path."""
    host = InMemoryHost(CHUNK)
    plugin = BlendPlugin(PluginConfig(instance_id=f"store-bench-{tag}", coordinator_url=url,
                                      event_reporting=True, chunk_size=CHUNK,
                                      event_flush_interval=3600.0), host)
    keys = [LookupKey(f"{tag}-{i}", tokens, MODEL) for i, tokens in enumerate(stores)]
    hashes = [host.chunk_hashes(key) for key in keys]
    started = time.process_time()
    for i, (key, key_hashes) in enumerate(zip(keys, hashes)):
        plugin.on_store(key, key_hashes)
        if (i + 1) % flush_every == 0:
            plugin.flush()
    plugin.close()  # the last events, and what the local matcher's background task has left
    spent = time.process_time() - started
    if plugin.reporter.stats().pending:
        raise RuntimeError("our reporter could not deliver every event")
    return spent / (len(stores) * CHUNKS_PER_STORE)


def lmcache_path(url: str, stores: list[list[int]], flush_every: int, tag: str) -> float:
    """CPU seconds per stored chunk of LMCache 0.5.6's store path, same requests."""
    from lmcache.v1.distributed.api import L1BackendType, ObjectKey
    from lmcache.v1.distributed.internal_api import L1ObjectMeta
    from lmcache.v1.mp_coordinator.cache_events import (CacheEventSubscriber,
                                                        HttpCacheEventSink)
    from lmcache.v1.mp_observability.event import Event, EventType
    from lmcache.v1.multiprocess.modules.blend.matcher import BlendTokenRangeMatcher

    logging.getLogger("lmcache").setLevel(logging.WARNING)
    subscriber = CacheEventSubscriber(HttpCacheEventSink(url), instance_id=f"lmc-{tag}",
                                      incarnation=time.time_ns(), flush_interval=3600.0)
    on = subscriber.get_subscriptions()
    matcher = BlendTokenRangeMatcher(chunk_size=CHUNK)
    matcher.on_new_token_hashes(stores[0][:CHUNK], [b"warm-up"])  # compiles its kernels
    matcher.remove_chunks([b"warm-up"])
    hashes = [[os.urandom(32) for _ in range(CHUNKS_PER_STORE)] for _ in stores]
    meta = L1ObjectMeta(size_bytes=CHUNK * 4096, backend=L1BackendType.DRAM)
    offsets = list(range(0, CHUNKS_PER_STORE * CHUNK, CHUNK))
    started = time.process_time()
    for i, (tokens, key_hashes) in enumerate(zip(stores, hashes)):
        matcher.on_new_token_hashes(tokens, key_hashes)
        # What its server does at store submission (`_publish_token_bindings`) ...
        token_ids = list(tokens)
        on[EventType.MP_TOKENS](Event(EventType.MP_TOKENS, metadata={
            "chunk_hashes": key_hashes, "token_offsets": offsets,
            "token_chunks": [token_ids[o:o + CHUNK] for o in offsets],
            "parent_hashes": [None, *key_hashes[:-1]]}))
        # ... and when the write finishes.
        keys = [ObjectKey(chunk_hash=h, model_name=MODEL, kv_rank=0) for h in key_hashes]
        on[EventType.L1_WRITE_FINISHED](Event(EventType.L1_WRITE_FINISHED, metadata={
            "keys": keys, "meta": [meta] * len(keys)}))
        if (i + 1) % flush_every == 0:
            subscriber.flush()
    subscriber.flush()
    spent = time.process_time() - started
    subscriber.shutdown()
    return spent / (len(stores) * CHUNKS_PER_STORE)


def encoding_ms(entries: int = 512, rounds: int = 7) -> tuple[float, float]:
    """CPU ms to encode one POST body of `entries` STORE entries of 256 tokens: msgspec with
    each array turned into Python ints (`tolist`, the reporter's former way), and the
    token lists written by `token_lists_to_json` first (its way now). Best of `rounds`
    rounds of 5, the two ways alternating."""
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, VOCAB, CHUNK, dtype=np.uint32) for _ in range(entries)]
    key = EncodedObjectKey(chunk_hash_hex="ab" * 32, model_name=MODEL, kv_rank=0,
                           cache_salt="")

    listed = [CacheEventEntry(key=key, size_bytes=1, token_ids=t, token_offset=0)
              for t in arrays]
    batch = CacheEventBatch(instance_id="bench", seq=1, event_type="store", tier="l1",
                            backend="dram", ts=1.0)
    batch.entries = listed
    request = EventsRequest(batches=[batch])

    def with_tolist() -> bytes:
        for entry, array in zip(listed, arrays):
            entry.token_ids = array
        return encode(request)

    def with_kernel() -> bytes:  # the reset to arrays is counted too: a bound, not flattery
        for entry, array in zip(listed, arrays):
            entry.token_ids = array
        for entry, raw in zip(listed, token_lists_to_json(arrays)):
            entry.token_ids = raw
        return encode(request)

    if with_tolist() != with_kernel():
        raise AssertionError("token_lists_to_json does not write what msgspec writes")
    best = {}
    for _ in range(rounds):
        for name, way in (("tolist", with_tolist), ("kernel", with_kernel)):
            started = time.process_time()
            for _ in range(5):
                way()
            best[name] = min(best.get(name, 1e9), (time.process_time() - started) / 5)
    return best["tolist"] * 1e3, best["kernel"] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stores", type=int, default=2000)
    parser.add_argument("--flush-every", type=int, default=32,
                        help="stores per POST (32 stores = 512 chunks per body)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {machine_description()}")
    if lmcache_version() is None:
        raise SystemExit("LMCache is not importable here: `make test` installs it")
    print(f"workload: {args.stores} stores of {CHUNKS_PER_STORE} chunks x {CHUNK} tokens, "
          f"one POST per {args.flush_every} stores; CPU of this process only")
    tolist_ms, kernel_ms = encoding_ms()
    print(f"encoding one body of 512 x 256-token STORE entries (CPU, best of 7): msgspec with "
          f"tolist {tolist_ms:.2f} ms, token_lists_to_json + msgspec {kernel_ms:.2f} ms "
          f"({tolist_ms / kernel_ms:.1f}x); the same bytes")
    coordinator = start_coordinator("--chunk-size", str(CHUNK), "--log-level", "WARNING",
                                    stderr=subprocess.DEVNULL)
    try:
        print(f"{'round':>5} {'ours us/chunk':>14} {'LMCache us/chunk':>17} {'ratio':>7} "
              f"{'load':>5}")
        for r in range(args.rounds):
            stores = requests(args.stores, seed=r)
            mine = ours(coordinator.url, stores, args.flush_every, f"r{r}")
            theirs = lmcache_path(coordinator.url, stores, args.flush_every, f"r{r}")
            print(f"{r:>5} {mine * 1e6:>14.2f} {theirs * 1e6:>17.2f} "
                  f"{theirs / mine:>6.1f}x {os.getloadavg()[0]:>5.1f}", flush=True)
    finally:
        coordinator.stop()
    print("(ratio: LMCache's CPU per stored chunk over ours, measured in the same round)")


if __name__ == "__main__":
    main()
