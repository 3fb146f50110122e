"""`StoredChunks`: the chunks this serving process stores, by namespace, fed to the local
matcher and reported as cache events (STORE with tokens and offsets, DELETE).

`BlendPlugin.on_store` / `on_evict` validate their input (bytes hashes, a range inside the
key's tokens) and hand it here. Each chunk remembers the namespace(s) storing it, so an
eviction is reported under each. Design: docs/DESIGN.md, "Plugin".
"""

from __future__ import annotations

import collections
import threading
from typing import Sequence

import numpy as np

from blend_wire import BlendNamespace
from local_matcher import LocalMatcher
from plugin.reporter import CacheEventReporter


class StoredChunks:
    """The local matcher's chunks and the reporter's events for them (module doc)."""

    def __init__(self, matcher: LocalMatcher, reporter: CacheEventReporter | None,
                 chunk_size: int) -> None:
        self._matcher = matcher
        self._reporter = reporter
        self._size = chunk_size
        self._lock = threading.Lock()
        # chunk -> the namespace storing it; a frozenset in the rare case of several. No set
        # per chunk: this map holds every chunk the process stores.
        self._owners: dict[bytes, BlendNamespace | frozenset[BlendNamespace]] = {}

    def add(self, namespace: BlendNamespace, tokens: np.ndarray, hashes: list[bytes],
            start: int) -> None:
        """Chunk i of `hashes` is `tokens[start + i*C : start + (i+1)*C]` (checked by the
        caller to lie inside `tokens`)."""
        size = self._size
        with self._lock:
            owners = self._owners
            for chunk_hash in hashes:
                known = owners.setdefault(chunk_hash, namespace)
                if known != namespace and not (type(known) is frozenset and namespace in known):
                    owners[chunk_hash] = (known if type(known) is frozenset
                                          else frozenset((known,))) | {namespace}
        self._matcher.register(tokens[start:start + len(hashes) * size], hashes,
                               position_offset=start, namespace=namespace)
        if self._reporter is not None:
            # Slices of the caller's buffer: the reporter copies them when it queues them.
            offsets = range(start, start + len(hashes) * size, size)
            self._reporter.report_store(namespace, hashes,
                                        [tokens[o:o + size] for o in offsets], offsets)

    def remove(self, hashes: Sequence[bytes]) -> None:
        """Evicted chunks leave the matcher (every namespace); a DELETE per namespace."""
        by_namespace: dict[BlendNamespace, list[bytes]] = collections.defaultdict(list)
        with self._lock:
            for chunk_hash in hashes:
                owner = self._owners.pop(chunk_hash, None)
                for namespace in (owner if type(owner) is frozenset else
                                  () if owner is None else (owner,)):
                    by_namespace[namespace].append(chunk_hash)
        self._matcher.evict(hashes)
        if self._reporter is not None:
            for namespace, owned in by_namespace.items():
                self._reporter.report_delete(namespace, owned)
