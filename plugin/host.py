"""What belongs to the serving engine: the prefix lookup and the sparse prefetch.

The plugin reaches the engine only through `ServingHost`, a small typed protocol of four
non-blocking calls: `submit_*` starts an operation for a request id, `poll_*` returns None
while it is pending and its result once (the result is handed out a single time, then
forgotten). Neither may block the caller on I/O.

A host may also offer `cancel(request_id)`: forget every operation of a request the engine
aborted. The plugin calls it, when present, whenever it lets a lookup go unfinished. A host
whose cancel cannot always release at once (a load still in flight) may offer `settle() ->
int`: release what cancelled operations hold if it now can, and return how many still wait;
the plugin's sweep task calls it, from a worker thread, until it answers 0.

`InMemoryHost` is the reference implementation for tests, examples and benchmarks. It keeps
stored chunks in a dict (chunk hash -> the chunk's tokens, standing in for its KV). Several
hosts can share one dict as a shared L2, so a chunk one server stored can be fetched by
another; by default each host has its own. An optional artificial delay makes the pending
paths observable without threads: an operation completes on the first poll at or after
`submit time + delay`, measured on the host's clock. Its memory is bounded whatever the
plugin does: at most `max_pending_ops` operations per kind wait to be polled (the oldest
is forgotten first), and the request history it records for tests keeps the last
`history` requests.

Chunk hashes are prefix-chained (`chunk_hashes`): chunk i's hash covers every token before
it and the namespace, so the same text behind two prefixes, or in two tenants, is two chunks.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Callable, Collection, Hashable, MutableMapping, Protocol, Sequence, runtime_checkable

import numpy as np

from plugin.types import CBMatchResult, LookupKey
from blend_wire import BlendNamespace


@runtime_checkable
class ServingHost(Protocol):
    """The serving engine's side of a unified lookup. Every call returns without waiting."""

    def submit_prefix_lookup(self, key: LookupKey, tp_size: int) -> None:
        """Start finding the longest cached prefix of `key.token_ids`."""

    def poll_prefix_lookup(self, request_id: str) -> Sequence[Hashable] | None:
        """None while pending; then the prefix chunks found, in order (possibly none)."""

    def submit_prefetch(self, request_id: str, segments: Sequence[CBMatchResult]) -> None:
        """Start loading the chunks named by `segments` (one sparse prefetch per lookup)."""

    def poll_prefetch(self, request_id: str) -> Collection[Hashable] | None:
        """None while pending; then the hashes of the chunks the prefetch found."""


def chunk_hashes(token_ids: Sequence[int], namespace: BlendNamespace, chunk_size: int) -> list[bytes]:
    """Prefix-chained 16-byte hashes of every full chunk of `token_ids` (aligned at 0)."""
    tokens = np.ascontiguousarray(np.asarray(token_ids, dtype=np.uint32))
    seed = hashlib.blake2b(repr(tuple(namespace)).encode(), digest_size=16).digest()
    hashes, previous = [], seed
    for start in range(0, len(tokens) - chunk_size + 1, chunk_size):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(tokens[start:start + chunk_size].tobytes())
        previous = digest.digest()
        hashes.append(previous)
    return hashes


class InMemoryHost:
    """A `ServingHost` over a dict of stored chunks, optionally shared and optionally slow."""

    def __init__(self, chunk_size: int = 256, *,
                 shared_l2: MutableMapping[Hashable, np.ndarray] | None = None,
                 delay_s: float = 0.0, prefix_delay_s: float | None = None,
                 prefetch_delay_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, max_pending_ops: int = 4096,
                 history: int = 1024) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size} must be >= 1")
        if max_pending_ops < 1 or history < 1:
            raise ValueError("max_pending_ops and history must be >= 1")
        self.max_pending_ops = max_pending_ops
        self.history = history
        self.chunk_size = chunk_size
        self.store_map: MutableMapping[Hashable, np.ndarray] = {} if shared_l2 is None else shared_l2
        self.prefix_delay_s = delay_s if prefix_delay_s is None else prefix_delay_s
        self.prefetch_delay_s = delay_s if prefetch_delay_s is None else prefetch_delay_s
        self._clock = clock
        self._lock = threading.Lock()
        # request id -> (ready_at, result); popped by the poll that hands the result out.
        self._prefix_ops: dict[str, tuple[float, list[Hashable]]] = {}
        self._prefetch_ops: dict[str, tuple[float, set[Hashable]]] = {}
        # What the plugin asked for, for tests and demos: (request id, argument); at least
        # the last `history` requests (trimmed in bulk, so appending stays O(1)).
        self.prefix_requests: list[tuple[str, int]] = []
        self.prefetch_requests: list[tuple[str, list[CBMatchResult]]] = []
        self.dropped_ops = 0  # operations forgotten unpolled to respect max_pending_ops

    # --- what the engine does when it saves or drops KV ---------------------------------

    def chunk_hashes(self, key: LookupKey) -> list[bytes]:
        """The hashes this host gives the full chunks of `key.token_ids`."""
        return chunk_hashes(key.token_ids, key.namespace, self.chunk_size)

    def store(self, key: LookupKey, chunk_hashes: Sequence[Hashable], start: int = 0) -> None:
        """Save chunk i of the range, tokens `[start + i*C, start + (i+1)*C)`, under its hash."""
        tokens = np.asarray(key.token_ids, dtype=np.uint32)
        size = self.chunk_size
        if start < 0 or start + len(chunk_hashes) * size > len(tokens):
            raise ValueError(f"range of {len(chunk_hashes)} chunks at {start} does not fit in "
                             f"{len(tokens)} tokens with chunk_size={size}")
        with self._lock:
            for i, chunk_hash in enumerate(chunk_hashes):
                at = start + i * size
                self.store_map[chunk_hash] = tokens[at:at + size].copy()

    def evict(self, chunk_hashes: Sequence[Hashable]) -> None:
        """Drop chunks; unknown hashes are ignored."""
        with self._lock:
            for chunk_hash in chunk_hashes:
                self.store_map.pop(chunk_hash, None)

    def __contains__(self, chunk_hash: Hashable) -> bool:
        return chunk_hash in self.store_map

    def __len__(self) -> int:
        return len(self.store_map)

    # --- ServingHost ------------------------------------------------------------------------

    def submit_prefix_lookup(self, key: LookupKey, tp_size: int) -> None:
        found: list[Hashable] = []
        with self._lock:
            for chunk_hash in self.chunk_hashes(key):
                if chunk_hash not in self.store_map:
                    break
                found.append(chunk_hash)
            self._record(self.prefix_requests, (key.request_id, tp_size))
            self._put(self._prefix_ops, key.request_id,
                      (self._clock() + self.prefix_delay_s, found))

    def poll_prefix_lookup(self, request_id: str) -> Sequence[Hashable] | None:
        return self._poll(self._prefix_ops, request_id)

    def submit_prefetch(self, request_id: str, segments: Sequence[CBMatchResult]) -> None:
        with self._lock:
            found = {s.hash for s in segments if s.hash in self.store_map}
            self._record(self.prefetch_requests, (request_id, list(segments)))
            self._put(self._prefetch_ops, request_id,
                      (self._clock() + self.prefetch_delay_s, found))

    def poll_prefetch(self, request_id: str) -> Collection[Hashable] | None:
        return self._poll(self._prefetch_ops, request_id)

    def cancel(self, request_id: str) -> None:
        """Forget every operation of `request_id` (the engine aborted it)."""
        with self._lock:
            self._prefix_ops.pop(request_id, None)
            self._prefetch_ops.pop(request_id, None)

    @property
    def pending_ops(self) -> int:
        with self._lock:
            return len(self._prefix_ops) + len(self._prefetch_ops)

    def _put(self, ops: dict, request_id: str, op: tuple) -> None:
        ops.pop(request_id, None)  # a resubmission is the newest
        ops[request_id] = op
        while len(ops) > self.max_pending_ops:
            del ops[next(iter(ops))]
            self.dropped_ops += 1

    def _record(self, requests: list, item: tuple) -> None:
        requests.append(item)
        if len(requests) > 2 * self.history:
            del requests[:-self.history]

    def _poll(self, ops: dict, request_id: str):
        with self._lock:
            op = ops.get(request_id)
            if op is None:
                # Never submitted (or already handed out): nothing will ever complete, so say
                # so loudly rather than leave the caller polling forever.
                raise KeyError(f"no operation submitted for request {request_id!r}")
            ready_at, result = op
            if self._clock() < ready_at:
                return None
            del ops[request_id]
            return result
