"""The local matcher: the chunks one serving process stored, found in its requests.

`LocalMatcher` is a `ContentIndex` fed by the store path. One serving process needs one:
chunks are registered and matched under a namespace (one implicit namespace unless the
caller names them, e.g. per tenant), and an evicted hash leaves every namespace.
Registration must never slow that path, so `register` and `evict` only enqueue (`register`
copies the tokens into a staging buffer the matcher reuses); a background task on an
executor applies the queue, and `match` drains whatever is still pending first, so a chunk
stored just before a lookup is found. Queued operations apply in the order they were made
(`_drain_lock`).

Background work follows the project's one pattern: tasks on an executor, shut down by
whoever created it. A matcher given an executor (the plugin passes its worker pool)
never shuts it down; one given none makes a one-thread pool of its own (its thread
starts with the first store) and shuts it down in `close()`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from threading import Lock
from typing import Hashable, Iterable, Sequence

import numpy as np

from blend_wire.tokens import as_tokens
from local_matcher import kernels
from local_matcher.index import ContentIndex
from local_matcher.types import CandidateColumns, CBMatchResult, ContentCandidates

log = logging.getLogger(__name__)

_LOCAL = "local"
_COALESCE_DELAY_S = 0.002
# Tokens per index batch: bounds how long a drain holds the index's lock (about 2 ms at
# 256-token chunks).
_BATCH_TOKENS = 1 << 18
_match_result = partial(tuple.__new__, CBMatchResult)  # no Python-level __new__ per match


class _Staged:
    """Registrations of one namespace queued together: rows [start, end) of `buffer`."""

    __slots__ = ("namespace", "buffer", "start", "end", "hashes", "offsets")

    def __init__(self, namespace: Hashable, buffer: np.ndarray, start: int) -> None:
        self.namespace, self.buffer, self.start, self.end = namespace, buffer, start, start
        self.hashes: list[Hashable] = []
        self.offsets: list[int] = []


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
        # Queued operations, in order: `_Staged` registrations and eviction lists. They,
        # the staging buffer and the rows used in it change only under `_queue_lock`, which
        # a drain holds just to take the queue: the store path never waits for indexing.
        self._pending: list = []
        self._queue_lock = Lock()
        self._drain_lock = Lock()
        self._scheduled = False
        # Staging buffers are as large as the store's blocks: big enough for the kernel to
        # back them with huge pages (a burst of stores fills many, and faulting in fresh
        # memory page by page costs more than the copy), reused once drained.
        self._stage_rows = kernels.BLOCK_ROWS
        self._batch_rows = max(1, _BATCH_TOKENS // chunk_size)
        self._spare: np.ndarray | None = None
        self._use_stage(np.empty((0, chunk_size), dtype=np.uint32))

    def register(self, token_ids, chunk_hashes: Sequence[Hashable], position_offset: int = 0,
                 *, namespace: Hashable = _LOCAL) -> None:
        """Queue chunks of a stored range for indexing under `namespace` (returns at once)."""
        chunk_hashes = list(chunk_hashes)
        tokens = as_tokens(token_ids).ravel()
        size = self.chunk_size
        count = min(len(chunk_hashes), tokens.size // size)
        if count < len(chunk_hashes):
            log.warning("register: %d chunk hashes but only %d full chunks of tokens; "
                        "the extra hashes are ignored", len(chunk_hashes), count)
            del chunk_hashes[count:]
        if count == 0:
            return
        data = memoryview(tokens).cast("B")
        row_bytes = 4 * size
        with self._queue_lock:
            staged = self._pending[-1] if self._pending else None
            start = self._staged
            if (type(staged) is not _Staged or staged.buffer is not self._stage
                    or staged.namespace != namespace or start + count > len(self._stage)):
                staged = self._stage_for(count, namespace)
                start = self._staged
            # A memoryview copy keeps the GIL (numpy would drop it for a copy this size, and
            # getting it back from the background indexer costs the store path far more).
            self._stage_bytes[start * row_bytes:(start + count) * row_bytes] = \
                data[:count * row_bytes]
            self._staged = staged.end = start + count
            staged.hashes += chunk_hashes
            staged.offsets += range(position_offset, position_offset + count * size, size)
            self._schedule()

    def evict(self, chunk_hashes: Iterable[Hashable]) -> None:
        """Queue chunks for removal from every namespace; unknown hashes are ignored."""
        chunk_hashes = list(chunk_hashes)
        with self._queue_lock:
            self._pending.append(chunk_hashes)
            self._schedule()

    def match(self, token_ids, *, namespace: Hashable = _LOCAL) -> list[CBMatchResult]:
        """Chunks registered under `namespace` found in `token_ids`, ascending by `cur_st`."""
        self.flush()
        hashes, old_st, cur_st = self._index.match_columns(token_ids, namespace)
        size = self.chunk_size
        return list(map(_match_result, zip(old_st, [st + size for st in old_st], cur_st,
                                           [st + size for st in cur_st], hashes)))

    def candidates(self, token_ids, *, namespace: Hashable = _LOCAL) -> list[ContentCandidates]:
        """Every position of `token_ids` where content registered under `namespace` occurs,
        with the chunks holding it (`ContentIndex.candidates`): one chunk per position at
        most, as every chunk of one process is held in the same place (no spare needed)."""
        self.flush()
        return self._index.candidates(token_ids, namespace, spare_chunks=0)

    def candidate_columns(self, token_ids, *, namespace: Hashable = _LOCAL
                          ) -> CandidateColumns:
        """`candidates` as columns (`ContentIndex.candidate_columns`)."""
        self.flush()
        return self._index.candidate_columns(token_ids, namespace, spare_chunks=0)

    def flush(self) -> None:
        """Apply every queued registration and eviction now."""
        with self._drain_lock:
            with self._queue_lock:
                pending, self._pending = self._pending, []
                if self._staged:  # those rows are read below: the store path moves on
                    self._use_stage(self._spare if self._spare is not None else
                                    np.empty((self._stage_rows, self.chunk_size), np.uint32))
                    self._spare = None
            index = self._index
            for done, operation in enumerate(pending, 1):
                try:
                    if type(operation) is list:
                        index.remove_chunks(operation)
                    else:
                        self._add(operation)
                except BaseException:  # the failed operation is dropped, the rest kept
                    with self._queue_lock:
                        self._pending[:0] = pending[done:]
                    raise
            # A drained buffer of the usual size is the next one the store path fills.
            reusable = [operation.buffer for operation in pending if type(operation) is not
                        list and len(operation.buffer) == self._stage_rows]
            if reusable:
                with self._queue_lock:
                    if self._spare is None and reusable[-1] is not self._stage:
                        self._spare = reusable[-1]

    def stats(self) -> dict[str, int]:
        return {**self._index.stats(), "pending": len(self._pending)}

    def close(self) -> None:
        """Apply what is queued and stop the thread the matcher made for itself, if any.

        The matcher stays usable: later stores are applied by the next `match` or `flush`.
        """
        self.flush()
        if self._owns_executor:
            self._executor.shutdown(wait=True)

    def _add(self, staged: _Staged) -> None:
        """Index staged registrations, in batches of at most `_batch_rows` rows."""
        step, base = self._batch_rows, staged.start
        for first in range(0, staged.end - base, step):
            last = min(first + step, staged.end - base)
            self._index.add_many(staged.buffer[base + first:base + last],
                                 staged.hashes[first:last], staged.offsets[first:last],
                                 staged.namespace)

    def _use_stage(self, buffer: np.ndarray) -> None:
        """Stage the rows of later registrations in `buffer` (caller holds `_queue_lock`)."""
        self._stage, self._staged = buffer, 0
        self._stage_bytes = memoryview(buffer).cast("B") if buffer.size else memoryview(b"")

    def _stage_for(self, count: int, namespace: Hashable) -> _Staged:
        """A new queued registration with room for `count` rows after the last; a full
        buffer is left to its queued rows (caller holds `_queue_lock`)."""
        if self._staged + count > len(self._stage):
            if count > self._stage_rows:  # one long range: a buffer of its own
                self._use_stage(np.empty((count, self.chunk_size), dtype=np.uint32))
            elif self._spare is not None:
                self._use_stage(self._spare)
                self._spare = None
            else:
                self._use_stage(np.empty((self._stage_rows, self.chunk_size), np.uint32))
        staged = _Staged(namespace, self._stage, self._staged)
        self._pending.append(staged)
        return staged

    def _schedule(self) -> None:
        """Start a background drain unless one is due (caller holds `_queue_lock`)."""
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
