"""`TierWatcher`: which of this server's tiers (L1, L2 per backend) hold each chunk the
local matcher indexed, from LMCache's event bus.

A chunk leaves the local matcher only when its last placement in any tier is gone (an L1
eviction with an L2 copy is not a loss). With a reporter (the ZMQ-only entry point, or
several coordinator URLs), each placement's appearance and disappearance is reported per
`(tier, backend)`. Design: docs/DESIGN.md, "Inside a real LMCache MP server".
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from lmcache.v1.mp_observability.event import EventType
from lmcache.v1.mp_observability.event_bus import EventSubscriber

from blend_wire import BlendNamespace
from plugin.reporter import CacheEventReporter

_TOKENS_STASH_LIMIT = 65536  # stored chunks awaiting their L1 write event (reporting only)


@dataclass(eq=False)
class _Chunk:
    # Each holder: (tier, backend, namespace, kv_rank, object_group_id) of one object key.
    holders: set = field(default_factory=set)


class TierWatcher(EventSubscriber):
    """Event-bus subscriber: L1/L2 placements of the chunks this server indexed.

    A chunk leaves the local matcher (`on_gone`) only when its last placement in any tier
    is gone. With a reporter, each placement's appearance / disappearance is reported per
    `(tier, backend)` (STORE with the chunk's tokens when the store path stashed them).
    Runs on the bus's drain thread; never calls out while holding its lock.
    """

    def __init__(self, on_gone, reporter: CacheEventReporter | None) -> None:
        self._on_gone = on_gone
        self._reporter = reporter
        self._lock = threading.Lock()
        self._chunks: dict[bytes, _Chunk] = {}
        # chunk hash -> (tokens, offset) from the store path, until its first L1 STORE report.
        self._tokens: collections.OrderedDict[bytes, tuple[np.ndarray, int]] = \
            collections.OrderedDict()

    def get_subscriptions(self) -> dict:
        return {
            EventType.L1_WRITE_FINISHED: self._on_l1_write,
            EventType.L1_WRITE_FINISHED_AND_READ_RESERVED: self._on_l1_write,
            EventType.L1_KEYS_EVICTED: self._on_l1_evicted,
            EventType.L2_KEYS_STORED: self._on_l2_stored,
            EventType.L2_KEYS_DELETED: self._on_l2_deleted,
        }

    def track(self, chunk_hashes: Sequence[bytes], tokens: np.ndarray, start: int, C: int) -> None:
        """Called by the store path before LMCache writes, so no placement event is missed."""
        with self._lock:
            for i, chunk_hash in enumerate(chunk_hashes):
                self._chunks.setdefault(chunk_hash, _Chunk())
                if self._reporter is not None:
                    at = start + i * C
                    self._tokens[chunk_hash] = (tokens[at:at + C], at)
                    self._tokens.move_to_end(chunk_hash)
            while len(self._tokens) > _TOKENS_STASH_LIMIT:
                self._tokens.popitem(last=False)

    @property
    def tracked(self) -> int:
        with self._lock:
            return len(self._chunks)

    def forget_all(self) -> None:
        with self._lock:
            self._chunks.clear()
            self._tokens.clear()

    def _on_l1_write(self, event) -> None:
        self._apply(True, [(k, "l1", m.backend.value) for k, m in
                           zip(event.metadata["keys"], event.metadata["meta"])])

    def _on_l1_evicted(self, event) -> None:
        self._apply(False, [(k, "l1", m.backend.value) for k, m in
                            zip(event.metadata["keys"], event.metadata["meta"])])

    def _on_l2_stored(self, event) -> None:
        backend = event.metadata["backend"]
        self._apply(True, [(k, "l2", backend) for k in event.metadata["keys"]])

    def _on_l2_deleted(self, event) -> None:
        backend = event.metadata["backend"]
        self._apply(False, [(k, "l2", backend) for k in event.metadata["keys"]])

    def _apply(self, placed: bool, keyed: list) -> None:
        stores: dict[tuple, list] = collections.defaultdict(list)
        deletes: dict[tuple, list] = collections.defaultdict(list)
        gone: list[bytes] = []
        with self._lock:
            for key, tier, backend in keyed:
                chunk = self._chunks.get(key.chunk_hash)
                if chunk is None:
                    continue  # not indexed here (e.g. a peer's chunk prefetched into L1)
                namespace = BlendNamespace(key.model_name, key.cache_salt, (key.kv_rank >> 24) & 0xFF)
                holder = (tier, backend, namespace, key.kv_rank, key.object_group_id)
                place = (tier, backend, namespace)
                had_place = any(h[:3] == place for h in chunk.holders)
                if placed:
                    chunk.holders.add(holder)
                    if not had_place:
                        tokens = self._tokens.pop(key.chunk_hash, None) if tier == "l1" else None
                        stores[place].append((key.chunk_hash, tokens))
                elif holder in chunk.holders:
                    chunk.holders.discard(holder)
                    if not any(h[:3] == place for h in chunk.holders):
                        deletes[place].append(key.chunk_hash)
                    if not chunk.holders:
                        del self._chunks[key.chunk_hash]
                        gone.append(key.chunk_hash)
        if gone:
            self._on_gone(gone)
        if self._reporter is None:
            return
        for (tier, backend, namespace), items in stores.items():
            self._reporter.report_store(
                namespace, [h for h, _ in items],
                [None if t is None else t[0] for _, t in items],
                [-1 if t is None else t[1] for _, t in items], tier=tier, backend=backend)
        for (tier, backend, namespace), hashes in deletes.items():
            self._reporter.report_delete(namespace, hashes, tier=tier, backend=backend)
