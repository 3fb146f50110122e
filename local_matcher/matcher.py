"""The local matcher: the chunks one serving process stored, found in its requests.

`LocalMatcher` is a `ContentIndex` fed by the store path. One serving process needs one:
chunks are registered and matched under a namespace (one implicit namespace unless the
caller names them, e.g. per tenant), and an evicted hash leaves every namespace.
Registration must never slow that path, so `register` and `evict` only enqueue; a
background task on an executor applies the queue, and `match` drains whatever is still
pending first, so a chunk stored just before a lookup is found. Queued operations apply
in the order they were made (`_drain_lock`).

Background work follows the project's one pattern: tasks on an executor, shut down by
whoever created it. A matcher given an executor (the plugin passes its worker pool)
never shuts it down; one given none makes a one-thread pool of its own (its thread
starts with the first store) and shuts it down in `close()`.
"""

from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from itertools import chain
from threading import Lock
from typing import Hashable, Iterable, Sequence

import numpy as np

from blend_wire.tokens import as_tokens
from local_matcher.index import ContentIndex
from local_matcher.types import CBMatchResult, ContentCandidates

log = logging.getLogger(__name__)

_LOCAL = "local"
_COALESCE_DELAY_S = 0.002
_MAX_COALESCED = 256  # registrations per index batch: bounds how long a drain holds the lock


class LocalMatcher:
    """Chunks stored by this process, matched at any offset of a request.

    Thread-safe. Chunk `i` of a registered range is `token_ids[i*C:(i+1)*C]`, stored
    at position `position_offset + i*C`; trailing tokens short of a chunk are ignored.
    """

    def __init__(self, chunk_size: int = 256, probe_stride: int = 1, *,
                 fingerprint_key: tuple[int, int] | None = None,
                 executor: Executor | None = None) -> None:
        # A pool starts no thread until its first task: an unused matcher costs none.
        self._owns_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=1,
                                                        thread_name_prefix="local-matcher")
        self._index = ContentIndex(chunk_size, probe_stride, fingerprint_key=fingerprint_key)
        self.chunk_size = chunk_size
        self._pending: collections.deque = collections.deque()
        self._drain_lock = Lock()
        self._scheduled = False

    def register(self, token_ids, chunk_hashes: Sequence[Hashable], position_offset: int = 0,
                 *, namespace: Hashable = _LOCAL) -> None:
        """Queue chunks of a stored range for indexing under `namespace` (returns at once)."""
        chunk_hashes = list(chunk_hashes)
        tokens = as_tokens(token_ids).ravel()
        count = min(len(chunk_hashes), tokens.size // self.chunk_size)
        if count < len(chunk_hashes):
            log.warning("register: %d chunk hashes but only %d full chunks of tokens; "
                        "the extra hashes are ignored", len(chunk_hashes), count)
        if count == 0:
            return
        # A bytes copy: numpy would drop the GIL for a copy this size, and getting it back
        # from the background indexer costs the store path far more than the copy.
        rows = tokens[: count * self.chunk_size].tobytes()
        offsets = range(position_offset, position_offset + count * self.chunk_size,
                        self.chunk_size)
        self._enqueue((rows, chunk_hashes[:count], offsets, namespace))

    def evict(self, chunk_hashes: Iterable[Hashable]) -> None:
        """Queue chunks for removal from every namespace; unknown hashes are ignored."""
        self._enqueue(list(chunk_hashes))

    def match(self, token_ids, *, namespace: Hashable = _LOCAL) -> list[CBMatchResult]:
        """Chunks registered under `namespace` found in `token_ids`, ascending by `cur_st`."""
        self.flush()
        hashes, old_st, cur_st = self._index.match_columns(token_ids, namespace)
        size = self.chunk_size
        return list(map(CBMatchResult, old_st, [st + size for st in old_st], cur_st,
                        [st + size for st in cur_st], hashes))

    def candidates(self, token_ids, *, namespace: Hashable = _LOCAL) -> list[ContentCandidates]:
        """Every position of `token_ids` where content registered under `namespace` occurs,
        with the chunks holding it (`ContentIndex.candidates`): one chunk per position at
        most, as every chunk of one process is held in the same place (no spare needed)."""
        self.flush()
        return self._index.candidates(token_ids, namespace, spare_chunks=0)

    def flush(self) -> None:
        """Apply every queued registration and eviction now."""
        with self._drain_lock:
            while self._pending:
                operation = self._pending.popleft()
                if isinstance(operation, list):
                    self._index.remove_chunks(operation)
                    continue
                # Consecutive registrations of one namespace go to the index as one batch.
                namespace = operation[3]
                batch = [operation]
                while (len(batch) < _MAX_COALESCED and self._pending
                       and isinstance(self._pending[0], tuple)
                       and self._pending[0][3] == namespace):
                    batch.append(self._pending.popleft())
                rows, hashes, offsets, _ = zip(*batch)
                self._index.add_many(
                    np.frombuffer(b"".join(rows), dtype=np.uint32).reshape(-1, self.chunk_size),
                    list(chain.from_iterable(hashes)), list(chain.from_iterable(offsets)),
                    namespace)

    def stats(self) -> dict[str, int]:
        return {**self._index.stats(), "pending": len(self._pending)}

    def close(self) -> None:
        """Apply what is queued and stop the thread the matcher made for itself, if any.

        The matcher stays usable: later stores are applied by the next `match` or `flush`.
        """
        self.flush()
        if self._owns_executor:
            self._executor.shutdown(wait=True)

    def _enqueue(self, operation) -> None:
        self._pending.append(operation)
        if not self._scheduled:
            self._scheduled = True
            try:
                self._executor.submit(self._drain_in_background)
            except RuntimeError:  # executor shut down (closed): the next match drains it
                self._scheduled = False

    def _drain_in_background(self) -> None:
        # A short wait lets a burst of stores coalesce into one batch: draining each store
        # alone would hand the GIL back and forth with the store path on every call.
        time.sleep(_COALESCE_DELAY_S)
        self._scheduled = False  # cleared first: what arrives during the drain reschedules
        try:
            self.flush()
        except Exception:  # the worker must survive; the failed operation is dropped
            log.exception("local matcher: background indexing failed")
