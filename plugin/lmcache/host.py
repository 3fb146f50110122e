"""`LMCacheHost`: the plugin's `ServingHost` over a live LMCache `BlendModule`.

LMCache's own prefix leg and sparse prefetch serve the plugin's lookup, so found chunks stay
read-locked for the `cb_retrieve_pre_computed` that follows, stashed where LMCache's lookup
leaves them, and `segmented_prefix_segments` is filled as LMCache fills it. An abandoned
lookup's read locks are released by `cancel`, or by `settle` once a prefetch still in flight
lands. LMCache's private parts are reached through `plugin.lmcache.internals`.
Design: docs/DESIGN.md, "Inside a real LMCache MP server".
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any, Collection, Hashable, Sequence

from lmcache.v1.multiprocess.custom_types import CBMatchResult as LMCacheMatch
from lmcache.v1.multiprocess.custom_types import CBUnifiedLookupResult, IPCCacheServerKey
from lmcache.v1.multiprocess.token_hasher import TokenHasher

from plugin.lmcache.internals import BlendInternals, prefetched_keys, prefix_leg_hits
from plugin.lmcache.rpc import key_num_tokens
from plugin.types import CBMatchResult, CBUnifiedLookupResult as PluginResult, LookupKey

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Op:
    """What the server holds for one lookup between its submit and its hand-out."""

    key: IPCCacheServerKey
    tp_size: int
    prefix_job: Any = None               # LMCache's _CBUnifiedJob, prefix fields only
    segmented: bool = False
    prefix_done: bool = False
    leading: int = 0
    prefix_owners: dict | None = None    # L1 owners of the prefix leg's read locks
    retained: list[int] | None = None
    sparse: tuple | None = None          # (handle, matches, per_hash_keys, hash_to_col)
    found: set | None = None             # set when the sparse leg has been classified


class LMCacheHost:
    """`ServingHost` over a live `BlendModule`: its prefix leg and sparse prefetch.

    The adapter hands each request's LMCache key in with `begin(key, tp)` before the plugin
    calls the protocol methods, and collects the LMCache result with `finish`.
    """

    def __init__(self, blend) -> None:
        self._blend = BlendInternals(blend)
        self._ctx = blend.context
        self._storage = self._ctx.storage_manager
        self.chunk_size: int = self._ctx.chunk_size
        self._lock = threading.Lock()
        self._keys: dict[str, tuple[IPCCacheServerKey, int]] = {}
        self._ops: dict[str, _Op] = {}
        # Cancelled lookups whose prefetch was still in flight: released when it lands.
        self._zombies: list[_Op] = []
        self._stats = collections.Counter()

    # --- what the adapter does around the plugin ---------------------------------------------

    def begin(self, key: IPCCacheServerKey, tp_size: int) -> None:
        with self._lock:
            self._keys[key.request_id] = (key, tp_size)

    def finish(self, request_id: str, result: PluginResult) -> CBUnifiedLookupResult:
        """The LMCache result for a completed plugin lookup; forgets the request."""
        with self._lock:
            self._keys.pop(request_id, None)
            op = self._ops.pop(request_id, None)
            if op is not None and not (
                    op.prefix_done and (op.sparse is None or op.found is not None)
                    and result.prefix_coverage_tokens == op.leading * self.chunk_size):
                # The plugin gave up part-way (an internal error answers "no reuse"): the
                # engine will not retrieve, so release what is held.
                self._zombies.append(op)
        tail: list[LMCacheMatch] = []
        if op is not None and op.segmented and op.retained:
            C = self.chunk_size
            hashes = self._hashes(op.key, key_num_tokens(op.key) // C * C)
            tail = [LMCacheMatch(i * C, (i + 1) * C, i * C, (i + 1) * C, hashes[i])
                    for i in op.retained if op.leading <= i < len(hashes)]
        return CBUnifiedLookupResult(
            prefix_coverage_tokens=result.prefix_coverage_tokens,
            non_prefix_segments=[LMCacheMatch(s.old_st, s.old_ed, s.cur_st, s.cur_ed, s.hash)
                                 for s in result.non_prefix_segments],
            segmented_prefix_segments=tail)

    def _hashes(self, key: IPCCacheServerKey, end: int) -> list[bytes]:
        session = self._ctx.session_manager.get_or_create(key.request_id)
        return [TokenHasher.hash_to_bytes(h) for h in session.get_hashes(0, end)]

    # --- ServingHost ----------------------------------------------------------------------------

    def submit_prefix_lookup(self, key: LookupKey, tp_size: int) -> None:
        with self._lock:
            ipc_key, tp = self._keys[key.request_id]
        blend = self._blend
        segmented = blend.segmented_prefix(
            blend.read_layouts(ipc_key.model_name, ipc_key.world_size))
        job = blend.submit_prefix_leg(ipc_key, tp, key_num_tokens(ipc_key))
        with self._lock:
            self._ops[key.request_id] = _Op(ipc_key, tp, prefix_job=job, segmented=segmented)

    def poll_prefix_lookup(self, request_id: str) -> Sequence[Hashable] | None:
        op = self._op(request_id)
        polled = self._blend.poll_prefix_leg(op.prefix_job, request_id, op.segmented)
        if polled is None:
            return None
        op.leading, op.retained = polled
        session = self._ctx.session_manager.get(request_id)
        op.prefix_owners = (session.get_prefetch_owners() or None) if session else None
        op.prefix_done = True
        return self._hashes(op.key, op.leading * self.chunk_size)

    def submit_prefetch(self, request_id: str, segments: Sequence[CBMatchResult]) -> None:
        op = self._op(request_id)
        C = self.chunk_size
        retained = set(op.retained or ()) if op.segmented else set()
        # As LMCache: a same-position match the segmented prefix already retained rides the
        # segmented tail, so it is not fetched (nor scattered) twice.
        matches = [LMCacheMatch(s.old_st, s.old_ed, s.cur_st, s.cur_ed, s.hash) for s in segments
                   if not (s.old_st == s.cur_st and s.cur_st // C in retained)]
        key = op.key
        resolved = self._blend.read_layouts(key.model_name, key.world_size)
        if not matches or resolved is None:
            if resolved is None:
                log.error("no CB KV-cache layout registered for model %s world size %d: "
                          "nothing can be prefetched", key.model_name, key.world_size)
            op.found = set()
            return
        handle, per_hash, hash_to_col = self._blend.submit_sparse_prefetch(key, resolved, matches)
        op.sparse = (handle, matches, per_hash, hash_to_col)

    def poll_prefetch(self, request_id: str) -> Collection[Hashable] | None:
        op = self._op(request_id)
        if op.found is None:
            handle, matches, per_hash, hash_to_col = op.sparse
            status = self._storage.query_prefetch_status(handle)
            if status is None:
                return None
            # LMCache's classification: found chunks stay read-locked, stashed in the session
            # for the retrieve; partially loaded ones are released now.
            fetched = self._blend.classify_sparse(op.key, matches, status, per_hash,
                                                  hash_to_col)
            op.found = {m.hash for m in fetched}
        return op.found

    def cancel(self, request_id: str) -> None:
        """The lookup was abandoned: release its prefix and sparse read locks (now, or as
        soon as a prefetch still in flight lands)."""
        with self._lock:
            self._keys.pop(request_id, None)
            op = self._ops.pop(request_id, None)
            if op is not None:
                self._zombies.append(op)
                self._stats["cancelled"] += 1
        self.settle()

    def settle(self) -> int:
        """Release what cancelled lookups hold once their prefetches have landed; returns
        how many still wait for theirs (the plugin's sweep task calls again until none)."""
        with self._lock:
            zombies, self._zombies = self._zombies, []
        waiting = [op for op in zombies if not self._release(op)]
        with self._lock:
            self._zombies.extend(waiting)
            return len(self._zombies)

    def _release(self, op: _Op) -> bool:
        # True when everything the op held is released. Consumes each prefetch result once.
        job = op.prefix_job
        if job is not None:
            # The engine never got this lookup's answer, so it will neither retrieve the
            # prefix nor free its locks: release what the prefix leg locked.
            if op.prefix_done:
                leading, owners = op.leading, op.prefix_owners
                session = self._ctx.session_manager.get(op.key.request_id)
                if session is not None:
                    # Forget the recorded lock model, so a later free_lookup_locks for this
                    # request cannot release the same locks twice.
                    session.record_prefetch_result(-1, (), None)
            elif job.prefix_handle is None:
                leading, owners = 0, None
            else:
                status = self._storage.query_prefetch_status(job.prefix_handle)
                if status is None:
                    return False
                leading = prefix_leg_hits(status.hit_cells, job.prefix_windows)
                owners = status.l1_owners or None
            if leading:
                locked = dataclasses.replace(op.key, worker_id=None, start=0,
                                             end=leading * self.chunk_size)
                keys = prefetched_keys(self._ctx, locked, leading, job.prefix_lock_gids)
                self._storage.finish_read_prefetched(
                    keys, read_locks=op.key.require_num_kv_readers(), l1_owners=owners)
                self._stats["released_prefix_chunks"] += leading
            op.prefix_done = True
            op.prefix_job = None
        if op.sparse is not None and op.found is None:
            handle, matches, per_hash, hash_to_col = op.sparse
            status = self._storage.query_prefetch_status(handle)
            if status is None:
                return False
            keys = [keys_of_hash[row] for h, col in hash_to_col.items()
                    for keys_of_hash in (per_hash[h],)
                    for row, bitmap in enumerate(status.hit_cells) if bitmap.test(col)]
            if keys:
                self._storage.finish_read_prefetched(
                    keys, read_locks=op.key.require_num_kv_readers(),
                    l1_owners=status.l1_owners or None)
                self._stats["released_sparse_keys"] += len(keys)
            op.sparse = None
        elif op.found:
            # Classified: the found chunks' locks are stashed in the session for a retrieve
            # that will never come. Release them as LMCache does when a session ends.
            session = self._ctx.session_manager.get(op.key.request_id)
            stash = self._blend.pop_unretrieved(session) if session else None
            if stash:
                keys = [k for ks in stash["per_hash"].values() for k in ks]
                self._storage.finish_read_prefetched(keys, read_locks=stash["read_locks"],
                                                     l1_owners=stash.get("l1_owners"))
                self._stats["released_sparse_keys"] += len(keys)
            op.found = set()
        return True

    def _op(self, request_id: str) -> _Op:
        with self._lock:
            op = self._ops.get(request_id)
        if op is None:
            raise KeyError(f"no lookup in progress for request {request_id!r}")
        return op

    def stats(self) -> dict:
        with self._lock:
            return {**self._stats, "in_flight": len(self._ops), "releasing": len(self._zombies)}
