"""The content index: which stored chunks does a token sequence contain, and where?

Design (docs/DESIGN.md, "The content index"): content of exactly `chunk_size` tokens is
stored once in a `ContentStore`; every chunk hash that names that content is an
*occupant* of it, carrying its own stored offset and claimed by one or more namespaces.
A match rolls a fingerprint over the query, lets the filter and the exact table reject
almost every window, skips contents the requester's namespace has no claim on, and only
then compares tokens.

The match rule (DESIGN.md; WIRE.md, blend-lookup; LMCache's own): at most one match per
query position, and each chunk at most once. At a position whose window equals a stored
content, the match names the first occupant of the requester's namespace not named
earlier in this query; a later occurrence of the same content gets the next one, and once
all are named, none. "First" is LMCache's order: occupants in the order they were first
indexed on that content, whichever namespace claimed them first (a namespace joining an
existing occupant does not move it; an occupant removed and indexed again goes last).

Content per claim: each (chunk, namespace) claim carries its own content and offset, so
what one namespace reports for a chunk hash never changes what another matches. `add`
touches only the adding namespace's claim; `remove_chunk` drops every claim (the caller,
the coordinator's directory, decides which namespaces a report speaks for). When all
claims of a chunk agree (the common case) the chunk is one occupant of one content.

Why costs do not grow with multiplicity (one document behind a thousand prefixes, one
chunk claimed by thousands of namespaces): the claims live in per-(content, namespace)
linked lists of slots (`local_matcher.claims`, which states their invariants), so a
lookup costs O(query + matches) and deleting n occupants O(n). The candidates form comes
out as columns (`candidate_columns`, a `CandidateColumns`: positions and chunks in CSR
arrays, each chunk's hash the index's own object), with no Python object per content or
chunk, and bounded by `MAX_CANDIDATE_POSITIONS` per content and `MAX_REPLY_ENTRIES` in
all (keyword arguments `max_positions`, `max_entries`; WIRE.md, "Limits"), with
`truncated` set when cut; `candidates` is the same as plain data. Every call runs under
`self._lock`, which is never held while calling out. A lookup (`match`, `match_columns`,
`candidates`, `candidate_columns`) called with `wait=False` raises `IndexBusy` instead of waiting for that lock:
the coordinator matches small lookups on its event loop, which must not wait for ingest.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from functools import partial
from itertools import groupby
from typing import Hashable, Iterable, Sequence

import numpy as np

from blend_wire.tokens import as_tokens
from local_matcher import candidate_kernels
from local_matcher.chunk_hashes import warm_up as warm_up_hashes
from local_matcher.claims import NONE, ClaimLists, mask_bit, mask_bits
from local_matcher.store import ContentStore
from local_matcher.types import (CANDIDATE_SPARE_CHUNKS, EMPTY_COLUMNS, MAX_CANDIDATE_CHUNKS,
                                 MAX_CANDIDATE_POSITIONS, MAX_REPLY_ENTRIES, BlendMatch,
                                 CandidateColumns, ContentCandidates)

log = logging.getLogger(__name__)
_blend_match = partial(tuple.__new__, BlendMatch)  # no Python-level __new__ per match


class IndexBusy(RuntimeError):
    """A lookup asked not to wait, and the index is being written (another thread holds
    it): the caller runs the lookup where waiting is harmless instead."""


class ContentIndex:
    """Namespaced index of fixed-size token chunks, matched at any offset of a query.

    Thread-safe. `namespace` is any hashable (the coordinator uses
    `(model_name, cache_salt, world_size)`). `fingerprint_key` fixes the fingerprint's
    `(salt, base)`; leave it None (random per process) outside tests.
    """

    def __init__(self, chunk_size: int = 256, probe_stride: int = 1, *,
                 fingerprint_key: tuple[int, int] | None = None) -> None:
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
        if not isinstance(probe_stride, int) or probe_stride < 1:
            raise ValueError(f"probe_stride must be an integer >= 1, got {probe_stride!r}")
        self.chunk_size = chunk_size
        self.probe_stride = probe_stride
        self._lock = threading.Lock()
        self._store = ContentStore(chunk_size, fingerprint_key)
        self._claims = ClaimLists()
        ContentStore.warm_up()
        warm_up_hashes()

    # --- adding ---------------------------------------------------------------------

    def add(self, tokens, chunk_hash: Hashable, token_offset: int, namespace: Hashable) -> None:
        """Index one chunk for `namespace` at stored position `token_offset`.

        Content that is not exactly `chunk_size` tokens, or an unknown (negative)
        offset, is logged and skipped. Only `namespace`'s claim on the chunk changes:
        adding again updates its offset, and other tokens move it to the new content
        (where the chunk is an occupant in LMCache's order: the one it already has there
        if another namespace's claim holds that content, else the newest). Other
        namespaces' claims keep their content and offset.
        """
        rows = as_tokens(tokens)
        if rows.shape != (self.chunk_size,):
            log.debug("not indexed: chunk %r has %d tokens, not %d",
                      chunk_hash, rows.size, self.chunk_size)
            return
        self.add_many(rows.reshape(1, -1), [chunk_hash], [token_offset], namespace)

    def add_many(self, rows, chunk_hashes: Sequence[Hashable], token_offsets: Sequence[int],
                 namespace: Hashable | list, row_of: Sequence[int] | None = None) -> None:
        """`add` for a (n, chunk_size) array of rows in one lock acquisition, in row order.
        `namespace`: one for every row, or a list of one per row. `row_of`: each chunk's
        row in `rows`, when chunks share rows (a chunk claimed again for many namespaces
        at once: its tokens are hashed and looked up once); None: one row per chunk."""
        batch = self._batch(rows, chunk_hashes, token_offsets, namespace, row_of)
        if batch is None:
            return
        rows, chunk_hashes, offsets, namespace, row_of = batch
        with self._lock:
            cids, fresh = self._store.insert(np.ascontiguousarray(rows))
            self._claims.grow(self._store.id_limit)
            if row_of is not None:  # a content just stored is fresh for its first chunk
                first = np.zeros(len(row_of), dtype=np.uint8)
                first[np.unique(row_of, return_index=True)[1]] = 1
                cids, fresh = cids[row_of], fresh[row_of] & first
            ns_ids, vacated = self._claim(chunk_hashes, cids, offsets, namespace, fresh)
            if type(ns_ids) is not np.ndarray:  # one namespace
                self._store.ns_mask[cids] |= np.uint32(mask_bit(ns_ids))
            elif fresh.all():  # contents of their own: each once
                self._store.ns_mask[cids] |= mask_bits(ns_ids)
            else:
                np.bitwise_or.at(self._store.ns_mask, cids, mask_bits(ns_ids))
            # Released only now: a later row of this batch may have found that content.
            self._settle(vacated)

    def _claim(self, chunk_hashes, cids: np.ndarray, offsets: np.ndarray, namespace,
               fresh: np.ndarray) -> tuple[np.ndarray | int, list[int]]:
        """Each chunk claimed, in row order: runs of chunk hashes new to the index (and to
        the batch) in bulk (`ClaimLists.claim_new`), the others one by one (`claim_all`).
        Returns the rows' namespace ids (or the one) and the contents claims left."""
        claims, count = self._claims, len(chunk_hashes)
        distinct = len(set(chunk_hashes)) == count
        known = claims.chunks.known(chunk_hashes)
        if distinct and not any(known):  # the common batch
            return claims.claim_new(chunk_hashes, cids, offsets, namespace, fresh), []
        if not distinct:  # a hash again: known by then
            seen: set = set()
            for i, chunk_hash in enumerate(chunk_hashes):
                known[i] = known[i] or chunk_hash in seen
                seen.add(chunk_hash)
        per_row = type(namespace) is list
        ns_ids = np.empty(count, dtype=np.int32)
        vacated: list[int] = []
        start = 0
        for was_known, run in groupby(known):
            stop = start + len(list(run))
            names = namespace[start:stop] if per_row else namespace
            if not was_known:
                ns_ids[start:stop] = claims.claim_new(
                    chunk_hashes[start:stop], cids[start:stop], offsets[start:stop], names,
                    fresh[start:stop])
            else:
                vacated += claims.claim_all(
                    chunk_hashes[start:stop], cids[start:stop].tolist(),
                    offsets[start:stop].tolist(),
                    names if per_row else (names,) * (stop - start), ns_ids[start:stop])
            start = stop
        return (ns_ids if per_row else int(ns_ids[0])), vacated

    def _batch(self, rows, chunk_hashes, token_offsets, namespace, row_of):
        """`add_many`'s arguments checked and converted, chunks with an unknown offset
        left out: (rows, chunk_hashes, offsets, namespace, row_of), or None if no chunk is
        left. Raises ValueError for arguments that do not fit together."""
        rows = as_tokens(rows)
        if rows.ndim != 2 or rows.shape[1] != self.chunk_size:
            raise ValueError(f"rows must have shape (n, {self.chunk_size}), got {rows.shape}")
        per_row = type(namespace) is list
        count = len(rows) if row_of is None else len(row_of)
        if not (count == len(chunk_hashes) == len(token_offsets)
                and (not per_row or len(namespace) == count)):
            raise ValueError("rows (or row_of), chunk_hashes, token_offsets (and namespaces) "
                             "differ in length")
        if row_of is not None:
            row_of = np.asarray(row_of, dtype=np.int64)
            if row_of.size and (row_of.min() < 0 or row_of.max() >= len(rows)):
                raise ValueError(f"row_of must name rows 0..{len(rows) - 1}")
        offsets = np.asarray(token_offsets, dtype=np.int64)
        if offsets.size and offsets.min() < 0:
            keep = np.flatnonzero(offsets >= 0)
            log.debug("not indexed: %d chunks with unknown offset", offsets.size - keep.size)
            offsets = offsets[keep]
            if row_of is None:
                rows = rows[keep]
            else:
                row_of = row_of[keep]
            chunk_hashes = [chunk_hashes[i] for i in keep.tolist()]
            if per_row:
                namespace = [namespace[i] for i in keep.tolist()]
        if not len(chunk_hashes):
            return None
        return rows, chunk_hashes, offsets, namespace, row_of

    # --- removing ---------------------------------------------------------------------

    def remove_claim(self, chunk_hash: Hashable, namespace: Hashable) -> np.ndarray | None:
        """Drop `namespace`'s claim on a chunk, whatever its content; the chunk lives on
        for other namespaces. Unknown chunk or namespace: nothing changes. Returns a copy
        of the claim's content (None: there was no such claim), which a caller that may
        have to put the claim back keeps (one lookup of the chunk, not two).

        LMCache's `remove_claim` also takes the tokens the caller knows the claim by; the
        coordinator's directory knows which claim a report speaks for, so none are asked."""
        with self._lock:
            ns_id = self._claims.ns_ids.get(namespace)
            cid = NONE if ns_id is None else self._claims.remove_claim(chunk_hash, ns_id)
            if cid == NONE:
                return None
            tokens = self._store.row(cid).copy()  # before the content may be freed
            self._settle([cid])
            return tokens

    def remove_chunk(self, chunk_hash: Hashable) -> None:
        """Drop a chunk and every claim on it, in one lock acquisition."""
        with self._lock:
            self._settle(self._claims.drop(chunk_hash))

    def remove_chunks(self, chunk_hashes: Iterable[Hashable]) -> None:
        """Drop chunks by hash with all their claims; unknown hashes are skipped."""
        with self._lock:
            vacated, drop = [], self._claims.drop
            for chunk_hash in chunk_hashes:
                vacated.extend(drop(chunk_hash))
            self._settle(vacated)

    # --- matching -------------------------------------------------------------------------

    def match(self, query, namespace: Hashable, *, wait: bool = True) -> list[BlendMatch]:
        """The chunks of `namespace` found in `query`, by the match rule (module doc).

        Ascending by `cur_st`; at most one match per position and per chunk; every
        match compared token by token. `wait=False`: `IndexBusy` rather than wait for a
        writer (an event loop must not block on ingest).
        """
        return list(map(_blend_match,
                        zip(*self.match_columns(query, namespace, wait=wait))))

    def match_columns(self, query, namespace: Hashable, *, wait: bool = True
                      ) -> tuple[list[Hashable], list[int], list[int]]:
        """`match` as columns: (chunk hashes, stored offsets, query positions), for a
        caller that builds result objects of its own."""
        tokens = self._query_tokens(query)
        if tokens is None:
            return [], [], []
        with self._locked(wait):
            claims = self._claims
            ns_id = claims.ns_ids.get(namespace)
            if ns_id is None:
                return [], [], []
            store = self._store
            found = store.match_occupants(tokens, self.probe_stride, mask_bit(ns_id), ns_id,
                                          claims.head, claims.slot_ns, claims.other_heads,
                                          claims.next_slot, claims.slot_offset)
            positions, slots, offsets = found.tolist()
            return claims.chunks.at(slots), offsets, positions

    def candidates(self, query, namespace: Hashable, *,
                   spare_chunks: int = CANDIDATE_SPARE_CHUNKS, wait: bool = True
                   ) -> list[ContentCandidates]:
        """`candidate_columns` as one `ContentCandidates` per content (plain data)."""
        return self.candidate_columns(query, namespace, spare_chunks=spare_chunks,
                                      wait=wait).as_contents()

    def candidate_columns(self, query, namespace: Hashable, *,
                          spare_chunks: int = CANDIDATE_SPARE_CHUNKS, wait: bool = True,
                          max_positions: int = MAX_CANDIDATE_POSITIONS,
                          max_entries: int = MAX_REPLY_ENTRIES) -> CandidateColumns:
        """Every position of `query` where content `namespace` claims occurs, by content.

        The candidates form (DESIGN.md, "The content index"): unlike `match`, no chunk is
        assigned to a position here, so a caller that drops some positions (the prefix, an
        overlap) can give their chunks to later ones. Contents in order of their first
        position; every position verified token by token; per content at most
        `len(positions) + spare_chunks` chunks (and `MAX_CANDIDATE_CHUNKS`). Columns, no
        Python object per content or chunk. `wait` as `match`.

        Bounded (WIRE.md, "Limits"): at most `max_positions` positions per content, its
        leftmost, and at most `max_entries` positions plus chunks in all, the occurrences
        left of some query position (`_within_entries`); `truncated` says a limit cut.
        Cost: O(query + positions and chunks named), however many chunks hold a content
        or times it repeats.
        """
        tokens = self._query_tokens(query)
        if tokens is None:
            return EMPTY_COLUMNS
        with self._locked(wait):
            claims = self._claims
            ns_id = claims.ns_ids.get(namespace)
            if ns_id is None:
                return EMPTY_COLUMNS
            store = self._store
            first_pos, first_cid, repeat_pos, repeat_cid = store.probe(
                tokens, self.probe_stride, mask_bit(ns_id))
            if not first_pos.size:
                return EMPTY_COLUMNS
            positions, sizes, cut = store.occurrences(tokens, first_pos, first_cid,
                                                      repeat_pos, repeat_cid, max_positions)
            heads = claims.heads_of(first_cid, ns_id)
            limits = np.minimum(sizes + spare_chunks, MAX_CANDIDATE_CHUNKS)
            slots, counts = candidate_kernels.walk_lists(heads, limits, claims.next_slot)
            if not counts.all():  # 0: a stale mask bit let a content of other namespaces in
                keep = counts > 0
                positions = positions[np.repeat(keep, sizes)]
                sizes, counts = sizes[keep], counts[keep]
            if positions.size + slots.size > max_entries:
                positions, sizes, counts = _within_entries(positions, sizes, counts,
                                                           max_entries)
                slots, cut = slots[:counts.sum()], True
            offsets = np.frombuffer(claims.slot_offset, dtype=np.int64)[slots]
            hashes = claims.chunks.at(slots)
        return CandidateColumns(_starts(sizes), positions, _starts(counts), offsets, hashes,
                                cut, slots)

    def _query_tokens(self, query) -> np.ndarray | None:
        """A query's tokens as uint32, or None when shorter than one chunk (nothing found)."""
        tokens = as_tokens(query)
        if tokens.ndim != 1:
            raise ValueError(f"query must be one-dimensional, got shape {tokens.shape}")
        return tokens if tokens.size >= self.chunk_size else None

    def tokens_of(self, chunk_hash: Hashable, namespace: Hashable | None = None
                  ) -> np.ndarray | None:
        """A copy of the content of `namespace`'s claim on a chunk (None: of any claim),
        or None if there is no such claim.

        Lets a caller that needs a chunk's tokens only now and then (the coordinator's
        directory) fetch them here instead of keeping a second copy."""
        with self._lock:
            ns_id = None if namespace is None else self._claims.ns_ids.get(namespace, NONE)
            cid = self._claims.content_of(chunk_hash, ns_id)
            return None if cid == NONE else self._store.row(cid).copy()

    def only_claim_slots(self, chunk_hashes: Sequence[Hashable]) -> list[int]:
        """Per chunk, a number for its claim if exactly one namespace claims it (a slot,
        >= 0), else -1. The number is the claim's while the claim stands (it moves with
        the claim's content and offset; it goes to another chunk's claim once removed),
        so a caller that keys data by it must rewrite that data before it asks for any
        change to the chunk's claims (the coordinator's directory does). Read without the
        lock: one dict read per chunk."""
        return self._claims.only_slots(chunk_hashes)

    def only_claim_slot(self, chunk_hash: Hashable) -> int:
        """`only_claim_slots` of one chunk."""
        return self._claims.only_slot(chunk_hash)

    def chunks_at(self, slots: Iterable[int]) -> Sequence[Hashable]:
        """The chunk of each claim slot (of a claim that stands; read without the lock)."""
        return self._claims.chunks.at(slots)

    def claim_offsets(self, slots: np.ndarray) -> np.ndarray:
        """The stored offset of each claim slot (of claims that stand; int64): what a
        caller keying data by slot (`only_claim_slots`) can read back instead of keeping."""
        with self._lock:  # no writer grows the column while it is viewed
            return np.frombuffer(self._claims.slot_offset, dtype=np.int64)[slots]

    def claim_offset(self, slot: int) -> int:
        """`claim_offsets` of one slot, read without the lock (one array read)."""
        return self._claims.slot_offset[slot]

    def __getstate__(self) -> dict:
        """Pickled without its lock (a snapshot is taken while nothing writes)."""
        state = dict(vars(self))
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._lock = threading.Lock()
        ContentStore.warm_up()
        warm_up_hashes()

    def stats(self) -> dict[str, int]:
        """`num_chunks` counts occupants (a chunk on a content: LMCache's count; a chunk
        whose namespaces disagree on its tokens is one per content)."""
        with self._lock:
            claims = self._claims
            return {
                "num_contents": self._store.num_contents,
                "num_chunks": claims.num_occupants,
                "num_claims": claims.num_claims,
                "num_namespaces": len(claims.ns_ids),
                "table_size": self._store.table_size,
                "bytes": self._store.nbytes + claims.python_bytes(),
            }

    # --- internals (caller holds the lock) ----------------------------------------------

    @contextlib.contextmanager
    def _locked(self, wait: bool):
        """The lock, taken (`wait=False`: only if free at once, else `IndexBusy`)."""
        if not self._lock.acquire(blocking=wait):
            raise IndexBusy("the index is being written; this lookup asked not to wait")
        try:
            yield
        finally:
            self._lock.release()

    def _settle(self, touched: Iterable[int]) -> None:
        """Free each touched content left without an occupant (NONE: none touched)."""
        vacant = self._claims.vacant(touched)
        if vacant:
            vacant_ids = np.array(vacant, dtype=np.int64)
            self._store.ns_mask[vacant_ids] = 0
            self._store.remove(vacant_ids)


def _starts(sizes: np.ndarray) -> np.ndarray:
    """CSR starts of groups of `sizes`: 0, then the running sums."""
    starts = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    return starts


def _within_entries(positions: np.ndarray, sizes: np.ndarray, counts: np.ndarray,
                    max_entries: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The candidates cut to at most `max_entries` positions plus chunks: every occurrence
    left of one query position P is kept, none at or past it (a content keeps its chunks
    while one of its positions is kept), P the furthest that fits. Contents are in order
    of first position and each position holds one content, so what is kept is the first
    contents, each with its leftmost positions: a selection over the kept part sees the
    query's left end as the whole reply showed it. Returns (positions, sizes, counts)."""
    content = np.repeat(np.arange(sizes.size), sizes)
    starts = _starts(sizes)
    cost = np.ones(positions.size, dtype=np.int64)  # a position; its content's chunks
    cost[starts[:-1]] += counts                     # with the content's first position
    order = np.argsort(positions, kind="stable")
    kept = int(np.searchsorted(np.cumsum(cost[order]), max_entries, side="right"))
    if kept == positions.size:
        return positions, sizes, counts
    cut_at = positions[order[kept]]
    keep = positions < cut_at
    contents = int(np.searchsorted(positions[starts[:-1]], cut_at))  # first positions rise
    sizes = np.bincount(content[keep], minlength=sizes.size)[:contents]
    return positions[keep], sizes, counts[:contents]
