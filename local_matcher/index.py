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

Why costs do not grow with multiplicity (one document behind a thousand prefixes is a
thousand occupants of one content, and one chunk may be claimed by thousands of
namespaces): each (chunk, namespace) claim is a *slot*, and the claims one namespace
holds on one content form a circular doubly linked list of slots, in occupant order,
kept in flat integer arrays. Adding a claim splices one slot in: O(1) when its occupant
is the newest on the content (the common case), else O(how many of the namespace's
occupants are newer); removing one is O(1); changing one claim's content or offset is
O(1), so changing a chunk for all its n claims is O(n). A match takes one step along a
list per occurrence. So a lookup costs O(query + matches) and deleting n occupants O(n),
however many occupants a content has and however many of them belong to other
namespaces.

Invariants (all under `self._lock`, which is never held while calling out):
- `_chunks[h]` for chunk `h`: the slot of its only claim (an int); a tuple of slots
  while a few namespaces claim it; past `_FEW_CLAIMS`, a `_ManyClaims` ({namespace id:
  slot} and, per content, its occupant's order and claim count), so that a chunk
  thousands of tenants claim costs O(1) per claim. Ints and tuples of ints are untracked
  by Python's cyclic GC, so an index of a million chunks adds no GC pause.
- slot `s`: `_slot_chunk[s]` its chunk, `_slot_ns[s]` its namespace id, `_slot_cid[s]`
  its content, `_slot_offset[s]` its stored offset, `_slot_order[s]` its occupant's
  order number (the same in every slot of one occupant, a chunk on a content; increasing
  with the time the occupant was first indexed), `_next[s]` and `_prev[s]` its
  neighbours in its circular list (the head's prev is the tail), which is sorted by
  order number. Free slots are chained through `_next` from `_free_slot`.
- the list of (cid, ns) starts at `_head[cid]` if `_slot_ns[_head[cid]] == ns`, else at
  `_more_heads[ns << 32 | cid]`: most contents are claimed by one namespace, so their
  only list costs no dict entry.
- `_num_chunks[cid]` occupants per content (chunks with at least one claim on it). A
  content is stored iff it has an occupant; a chunk exists iff a namespace claims it.
- `store.ns_mask[cid]` holds bit `id % 64` of every namespace with a list on `cid`; it
  may carry stale extra bits (a cheap pre-test), never miss one.
- A namespace's id is recycled once nothing claims it, so the ids stay small.
"""

from __future__ import annotations

import logging
import sys
import threading
from array import array
from typing import Hashable, Iterable, Sequence

import numpy as np

from local_matcher import kernels
from local_matcher.store import ContentStore
from local_matcher.types import (CANDIDATE_SPARE_CHUNKS, MAX_CANDIDATE_CHUNKS, MAX_TOKEN_ID,
                                 BlendMatch, ContentCandidates)

log = logging.getLogger(__name__)

_NONE = -1  # "no slot" in the slot and head arrays
_NS_SHIFT = 32  # `_more_heads` key: namespace id above, content id below
_FEW_CLAIMS = 8  # claims on one chunk kept in a tuple (scanned); past this, a _ManyClaims


def as_tokens(values) -> np.ndarray:
    """A contiguous uint32 array of token ids; ValueError for ids outside uint32."""
    array_ = np.asarray(values)
    if array_.dtype == np.uint32:
        return np.ascontiguousarray(array_)
    if array_.size == 0:
        return np.zeros(array_.shape, dtype=np.uint32)
    if array_.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, not {array_.dtype}")
    if array_.min() < 0 or array_.max() > MAX_TOKEN_ID:
        raise ValueError("token ids must fit in uint32 (0 .. 2**32-1)")
    return array_.astype(np.uint32)


def _mask_bit(ns_id: int) -> int:
    return 1 << (ns_id & 63)


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
        self._chunks: dict[Hashable, object] = {}
        # Claim slots.
        self._slot_chunk: list[Hashable] = []
        self._slot_ns = array("i")
        self._slot_cid = array("i")
        self._slot_offset = array("q")
        self._slot_order = array("q")
        self._next = array("i")
        self._prev = array("i")
        self._free_slot = _NONE
        self._next_order = 0  # order number of the next new occupant
        # Per content id (grown with the store).
        self._head = array("i")
        self._num_chunks = array("i")
        self._more_heads: dict[int, int] = {}
        self._num_occupants = 0
        # Namespaces.
        self._ns_ids: dict[Hashable, int] = {}
        self._ns_names: list[Hashable] = []
        self._ns_claim_counts: list[int] = []
        self._free_ns_ids: list[int] = []
        self._num_claims = 0
        ContentStore.warm_up()

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
            return
        namespaces = namespace if per_row else (namespace,) * len(chunk_hashes)
        with self._lock:
            cids, _ = self._store.insert(np.ascontiguousarray(rows))
            if row_of is not None:
                cids = cids[row_of]
            self._grow_contents()
            chunks, slot_cid, slot_offset = self._chunks, self._slot_cid, self._slot_offset
            ns_bits = np.empty(len(cids), dtype=np.uint64)
            vacated, current, ns_id = [], object(), _NONE
            for i, (chunk_hash, cid, offset, name) in enumerate(zip(
                    chunk_hashes, cids.tolist(), offsets.tolist(), namespaces)):
                if name is not current:  # adding never retires an id: safe to keep
                    current, ns_id = name, self._namespace_id(name)
                ns_bits[i] = _mask_bit(ns_id)
                claim = chunks.get(chunk_hash)
                slot = _NONE if claim is None else self._slot_of(claim, ns_id)
                if slot == _NONE:  # a new claim: O(1) however many the chunk has
                    slot = self._claim(chunk_hash, cid, ns_id, offset, claim)
                    chunks[chunk_hash] = self._with_slot(claim, slot)
                    self._count_claims(ns_id, 1)
                elif slot_cid[slot] == cid:
                    slot_offset[slot] = offset
                else:  # this namespace now reports other tokens under the hash
                    vacated.append(slot_cid[slot])
                    self._move(claim, slot, cid, offset)
            if per_row:
                np.bitwise_or.at(self._store.ns_mask, cids, ns_bits)
            else:
                self._store.ns_mask[cids] |= ns_bits[0]
            # Released only now: a later row of this batch may have found that content.
            self._settle(vacated)

    # --- removing ---------------------------------------------------------------------

    def remove_claim(self, tokens, chunk_hash: Hashable, namespace: Hashable) -> None:
        """Drop `namespace`'s claim on a chunk; the chunk lives on for other namespaces.

        `tokens` name the content the caller knows the claim by (None: whatever it is);
        if they differ from the claim's content, or anything is unknown, nothing changes.
        """
        with self._lock:
            claim = self._chunks.get(chunk_hash)
            ns_id = self._ns_ids.get(namespace)
            if claim is None or ns_id is None:
                return
            slot = self._slot_of(claim, ns_id)
            if slot == _NONE or not self._holds(slot, tokens):
                return
            cid = self._slot_cid[slot]
            self._remove_slot(chunk_hash, claim, slot)
            self._settle([cid])

    def remove_chunk(self, tokens, chunk_hash: Hashable) -> None:
        """Drop a chunk and every claim on it, in one lock acquisition.

        With `tokens`, only the claims whose content they are (LMCache's occupant of
        that content); None: every claim."""
        with self._lock:
            claim = self._chunks.get(chunk_hash)
            if claim is None:
                return
            if tokens is None:
                self._settle(self._drop(chunk_hash, claim))
                return
            tokens = as_tokens(tokens)
            vacated = []
            for slot in self._slots_in(claim):
                if self._holds(slot, tokens):
                    vacated.append(self._slot_cid[slot])
                    claim = self._remove_slot(chunk_hash, claim, slot)
            self._settle(vacated)

    def remove_chunks(self, chunk_hashes: Iterable[Hashable]) -> None:
        """Drop chunks by hash with all their claims; unknown hashes are skipped."""
        with self._lock:
            vacated = []
            for chunk_hash in chunk_hashes:
                claim = self._chunks.get(chunk_hash)
                if claim is not None:
                    vacated.extend(self._drop(chunk_hash, claim))
            self._settle(vacated)

    # --- matching -------------------------------------------------------------------------

    def match(self, query, namespace: Hashable) -> list[BlendMatch]:
        """The chunks of `namespace` found in `query`, by the match rule (module doc).

        Ascending by `cur_st`; at most one match per position and per chunk; every
        match compared token by token.
        """
        tokens = self._query_tokens(query)
        if tokens is None:
            return []
        with self._lock:
            ns_id = self._ns_ids.get(namespace)
            if ns_id is None:
                return []
            store = self._store
            found = store.probe(tokens, self.probe_stride, _mask_bit(ns_id))
            # Zero-copy views of the slot arrays, dropped before the lock is released
            # (an array.array cannot grow while a view of it lives).
            views = [np.frombuffer(a, dtype=np.int32) for a in
                     (self._head, self._slot_ns, self._next)]
            try:
                heads = self._heads_of(found[1], ns_id, *views[:2])
                positions, slots = store.take_occupants(tokens, *found, heads, views[2])
                offsets = np.frombuffer(self._slot_offset, dtype=np.int64)[slots].tolist()
            finally:
                del views
            slot_chunk = self._slot_chunk
            return list(map(BlendMatch, [slot_chunk[s] for s in slots.tolist()], offsets,
                            positions.tolist()))

    def candidates(self, query, namespace: Hashable, *,
                   spare_chunks: int = CANDIDATE_SPARE_CHUNKS) -> list[ContentCandidates]:
        """Every position of `query` where content `namespace` claims occurs, by content.

        The candidates form (DESIGN.md, "Unified lookup"): unlike `match`, no chunk is
        assigned to a position here, so a caller that drops some positions (the prefix, an
        overlap) can give their chunks to later ones. One `ContentCandidates` per content
        found, in order of its first position; every position verified token by token; per
        content at most `len(positions) + spare_chunks` chunks (and `MAX_CANDIDATE_CHUNKS`).
        Cost: O(query + positions + chunks named), however many chunks hold a content.
        """
        tokens = self._query_tokens(query)
        if tokens is None:
            return []
        with self._lock:
            ns_id = self._ns_ids.get(namespace)
            if ns_id is None:
                return []
            store = self._store
            first_pos, first_cid, repeat_pos, repeat_cid = store.probe(
                tokens, self.probe_stride, _mask_bit(ns_id))
            if not first_pos.size:
                return []
            positions, sizes = store.occurrences(tokens, first_pos, first_cid, repeat_pos,
                                                 repeat_cid)
            views = [np.frombuffer(a, dtype=np.int32) for a in
                     (self._head, self._slot_ns, self._next)]
            try:
                heads = self._heads_of(first_cid, ns_id, *views[:2])
                limits = np.minimum(sizes + spare_chunks, MAX_CANDIDATE_CHUNKS)
                slots, counts = kernels.walk_lists(heads, limits, views[2])
                offsets = np.frombuffer(self._slot_offset, dtype=np.int64)[slots].tolist()
            finally:
                del views
            slot_chunk = self._slot_chunk
            chunks = list(zip([slot_chunk[s] for s in slots.tolist()], offsets))
        # Plain lists and slices: numpy's split costs more than the rest per content.
        sorted_positions = positions.tolist()
        found, begin, start = [], 0, 0
        make = ContentCandidates._make
        for end, count in zip(np.cumsum(sizes).tolist(), counts.tolist()):
            if count:  # 0: a stale mask bit let a content of other namespaces through
                found.append(make((tuple(sorted_positions[begin:end]),
                                   tuple(chunks[start:start + count]))))
                start += count
            begin = end
        return found

    def _query_tokens(self, query) -> np.ndarray | None:
        """A query's tokens as uint32, or None when shorter than one chunk (nothing found)."""
        tokens = as_tokens(query)
        if tokens.ndim != 1:
            raise ValueError(f"query must be one-dimensional, got shape {tokens.shape}")
        return tokens if tokens.size >= self.chunk_size else None

    def _heads_of(self, cids: np.ndarray, ns_id: int, head: np.ndarray, slot_ns: np.ndarray
                  ) -> np.ndarray:
        """Per content, the head slot of `ns_id`'s list (-1: none)."""
        heads = head[cids].astype(np.int64)
        own = heads != _NONE
        own[own] = slot_ns[heads[own]] == ns_id
        if not own.all():
            more = self._more_heads
            for i in np.flatnonzero(~own).tolist():
                heads[i] = more.get(ns_id << _NS_SHIFT | int(cids[i]), _NONE) if more else _NONE
        return heads

    def tokens_of(self, chunk_hash: Hashable, namespace: Hashable | None = None
                  ) -> np.ndarray | None:
        """A copy of the content of `namespace`'s claim on a chunk (None: of any claim),
        or None if there is no such claim.

        Lets a caller that needs a chunk's tokens only now and then (the coordinator's
        directory) fetch them here instead of keeping a second copy."""
        with self._lock:
            claim = self._chunks.get(chunk_hash)
            if claim is None:
                return None
            if namespace is None:
                slot = self._slots_in(claim)[0]
            else:
                ns_id = self._ns_ids.get(namespace)
                slot = _NONE if ns_id is None else self._slot_of(claim, ns_id)
                if slot == _NONE:
                    return None
            return self._store.row(self._slot_cid[slot]).copy()

    def __getstate__(self) -> dict:
        """Pickled without its lock (a snapshot is taken while nothing writes)."""
        state = dict(vars(self))
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._lock = threading.Lock()
        ContentStore.warm_up()

    def stats(self) -> dict[str, int]:
        """`num_chunks` counts occupants (a chunk on a content: LMCache's count; a chunk
        whose namespaces disagree on its tokens is one per content)."""
        with self._lock:
            arrays = (self._slot_ns, self._slot_cid, self._slot_offset, self._slot_order,
                      self._next, self._prev, self._head, self._num_chunks)
            python_bytes = (sys.getsizeof(self._chunks) + len(self._chunks) * _RECORD_BYTES
                            + sys.getsizeof(self._slot_chunk)
                            + sys.getsizeof(self._more_heads)
                            + sum(len(a) * a.itemsize for a in arrays))
            return {
                "num_contents": self._store.num_contents,
                "num_chunks": self._num_occupants,
                "num_claims": self._num_claims,
                "num_namespaces": len(self._ns_ids),
                "table_size": self._store.table_size,
                "bytes": self._store.nbytes + python_bytes,
            }

    # --- internals (caller holds the lock) ----------------------------------------------

    def _grow_contents(self) -> None:
        missing = self._store.capacity - len(self._head)
        if missing > 0:
            self._head.extend(array("i", [_NONE]) * missing)
            self._num_chunks.extend(array("i", [0]) * missing)

    def _namespace_id(self, namespace: Hashable) -> int:
        ns_id = self._ns_ids.get(namespace)
        if ns_id is None:
            if self._free_ns_ids:
                ns_id = self._free_ns_ids.pop()
                self._ns_names[ns_id] = namespace
            else:
                ns_id = len(self._ns_names)
                self._ns_names.append(namespace)
                self._ns_claim_counts.append(0)
            self._ns_ids[namespace] = ns_id
        return ns_id

    def _holds(self, slot: int, tokens) -> bool:
        """Whether a claim's content is `tokens` (None: anything)."""
        return tokens is None or self._store.holds(self._slot_cid[slot], as_tokens(tokens))

    # A chunk's claims: one slot (int), a tuple of slots, or a _ManyClaims.

    def _slot_of(self, claim, ns_id: int) -> int:
        """The slot of `ns_id`'s claim among a chunk's, or _NONE."""
        if type(claim) is int:
            return claim if self._slot_ns[claim] == ns_id else _NONE
        if type(claim) is tuple:
            slot_ns = self._slot_ns
            for slot in claim:
                if slot_ns[slot] == ns_id:
                    return slot
            return _NONE
        return claim.slots.get(ns_id, _NONE)

    @staticmethod
    def _slots_in(claim) -> Sequence[int]:
        if type(claim) is int:
            return (claim,)
        return claim if type(claim) is tuple else list(claim.slots.values())

    def _with_slot(self, claim, slot: int):
        """A chunk's claims with `slot` (just claimed, `_join`ed) added."""
        if claim is None:
            return slot
        if type(claim) is int:
            return claim, slot
        if type(claim) is tuple:
            if len(claim) < _FEW_CLAIMS:
                return claim + (slot,)
            many = _ManyClaims()  # many namespaces: O(1) per claim from now on
            for held in claim + (slot,):
                many.slots[self._slot_ns[held]] = held
                occupant = many.occupants.get(self._slot_cid[held])
                if occupant is None:
                    many.occupants[self._slot_cid[held]] = [self._slot_order[held], 1]
                else:
                    occupant[1] += 1
            return many
        claim.slots[self._slot_ns[slot]] = slot
        return claim

    def _join(self, claim, cid: int, slot: int) -> int:
        """`slot` (not on `cid` yet) joins the chunk's occupant of content `cid`: that
        occupant's order number if another of the chunk's claims holds it, else a new
        occupant's (counted)."""
        if type(claim) is _ManyClaims:
            occupant = claim.occupants.get(cid)
            if occupant is not None:
                occupant[1] += 1
                return occupant[0]
            order = self._new_occupant(cid)
            claim.occupants[cid] = [order, 1]
            return order
        if claim is not None:
            slot_cid = self._slot_cid
            for other in ((claim,) if type(claim) is int else claim):
                if other != slot and slot_cid[other] == cid:
                    return self._slot_order[other]
        return self._new_occupant(cid)

    def _new_occupant(self, cid: int) -> int:
        order = self._next_order
        self._next_order += 1
        self._num_chunks[cid] += 1
        self._num_occupants += 1
        return order

    def _leave(self, claim, slot: int) -> None:
        """`slot` leaves its content: the chunk's occupant of it ends with its last claim."""
        cid = self._slot_cid[slot]
        if type(claim) is _ManyClaims:
            occupant = claim.occupants[cid]
            occupant[1] -= 1
            if occupant[1]:
                return
            del claim.occupants[cid]
        else:
            slot_cid = self._slot_cid
            for other in ((claim,) if type(claim) is int else claim):
                if other != slot and slot_cid[other] == cid:
                    return
        self._num_chunks[cid] -= 1
        self._num_occupants -= 1

    def _head_of(self, cid: int, ns_id: int) -> int:
        """The first slot of `ns_id`'s list on content `cid`, or _NONE."""
        head = self._head[cid]
        if head != _NONE and self._slot_ns[head] == ns_id:
            return head
        return self._more_heads.get(ns_id << _NS_SHIFT | cid, _NONE) if self._more_heads \
            else _NONE

    def _set_head(self, cid: int, ns_id: int, old: int, new: int) -> None:
        """Move the head of `ns_id`'s list on `cid` from slot `old` to `new` (_NONE: the
        list is gone)."""
        if self._head[cid] == old:
            self._head[cid] = new
        elif new == _NONE:
            del self._more_heads[ns_id << _NS_SHIFT | cid]
        else:
            self._more_heads[ns_id << _NS_SHIFT | cid] = new

    def _claim(self, chunk_hash: Hashable, cid: int, ns_id: int, offset: int, claim) -> int:
        """A new slot: `ns_id`'s claim on `chunk_hash` (whose claims so far are `claim`,
        or None) at content `cid`, linked into its list. The caller adds it to the
        chunk's claims (`_with_slot`), counts it (`_count_claims`) and sets the
        namespace's mask bit."""
        slot = self._free_slot
        if slot == _NONE:
            slot = len(self._slot_ns)
            self._slot_chunk.append(chunk_hash)
            self._slot_ns.append(ns_id)
            self._slot_cid.append(cid)
            self._slot_offset.append(offset)
            self._slot_order.append(0)
            self._next.append(slot)
            self._prev.append(slot)
        else:
            self._free_slot = self._next[slot]
            self._slot_chunk[slot] = chunk_hash
            self._slot_ns[slot] = ns_id
            self._slot_cid[slot] = cid
            self._slot_offset[slot] = offset
        self._slot_order[slot] = self._join(claim, cid, slot)
        self._link(slot)
        return slot

    def _move(self, claim, slot: int, cid: int, offset: int) -> None:
        """A claim takes other content: out of its list, into that content's."""
        self._unlink(slot)
        self._leave(claim, slot)
        self._slot_order[slot] = self._join(claim, cid, slot)
        self._slot_cid[slot] = cid
        self._slot_offset[slot] = offset
        self._link(slot)

    def _link(self, slot: int) -> None:
        """Splice a slot into its (content, namespace) list, which stays in order-number
        order: O(1) at the tail (a new occupant), else one step per newer slot."""
        next_slot, prev_slot, slot_order = self._next, self._prev, self._slot_order
        cid, ns_id = self._slot_cid[slot], self._slot_ns[slot]
        head = self._head_of(cid, ns_id)
        if head == _NONE:  # the namespace's first claim on this content: a new list
            next_slot[slot] = prev_slot[slot] = slot
            if self._head[cid] == _NONE:
                self._head[cid] = slot
            else:
                self._more_heads[ns_id << _NS_SHIFT | cid] = slot
            return
        order, after = slot_order[slot], prev_slot[head]  # the tail
        while slot_order[after] > order:
            if after == head:  # older than every slot of the list: it becomes the head
                after = prev_slot[head]
                self._set_head(cid, ns_id, head, slot)
                break
            after = prev_slot[after]
        following = next_slot[after]
        next_slot[after] = slot
        prev_slot[slot] = after
        next_slot[slot] = following
        prev_slot[following] = slot

    def _unlink(self, slot: int) -> None:
        """Splice a slot out of its list (the list goes with its last slot; the content's
        mask bit may stay: a stale bit costs a compare)."""
        next_slot, prev_slot = self._next, self._prev
        cid, ns_id = self._slot_cid[slot], self._slot_ns[slot]
        following = next_slot[slot]
        if following == slot:
            self._set_head(cid, ns_id, slot, _NONE)
            return
        preceding = prev_slot[slot]
        next_slot[preceding] = following
        prev_slot[following] = preceding
        if self._head_of(cid, ns_id) == slot:
            self._set_head(cid, ns_id, slot, following)

    def _count_claims(self, ns_id: int, claimed: int) -> None:
        self._ns_claim_counts[ns_id] += claimed
        self._num_claims += claimed

    def _free(self, slot: int) -> None:
        """Free an unlinked slot; retire the namespace's id with its last claim."""
        ns_id = self._slot_ns[slot]
        self._slot_chunk[slot] = None
        self._next[slot] = self._free_slot
        self._free_slot = slot
        self._num_claims -= 1
        self._ns_claim_counts[ns_id] -= 1
        if self._ns_claim_counts[ns_id] == 0:
            del self._ns_ids[self._ns_names[ns_id]]
            self._ns_names[ns_id] = None
            self._free_ns_ids.append(ns_id)

    def _remove_slot(self, chunk_hash: Hashable, claim, slot: int):
        """Drop one claim of a chunk; what is left of its claims (None: the chunk went)."""
        self._unlink(slot)
        self._leave(claim, slot)
        self._free(slot)
        if type(claim) is _ManyClaims:
            del claim.slots[self._slot_ns[slot]]
            rest = claim if claim.slots else None
        elif type(claim) is int:
            rest = None
        else:
            kept = tuple(held for held in claim if held != slot)
            rest = kept[0] if len(kept) == 1 else kept
        if rest is None:
            del self._chunks[chunk_hash]
        elif rest is not claim:
            self._chunks[chunk_hash] = rest
        return rest

    def _drop(self, chunk_hash: Hashable, claim) -> set[int]:
        """Drop a chunk with every claim; the contents it occupied."""
        slots = self._slots_in(claim)
        cids = {self._slot_cid[slot] for slot in slots}
        for slot in slots:
            self._unlink(slot)
            self._free(slot)
        for cid in cids:
            self._num_chunks[cid] -= 1
        self._num_occupants -= len(cids)
        del self._chunks[chunk_hash]
        return cids

    def _settle(self, touched: Iterable[int]) -> None:
        """Free each touched content left without an occupant."""
        vacant = [cid for cid in set(touched) if self._num_chunks[cid] == 0]
        if vacant:
            vacant_ids = np.array(vacant, dtype=np.int64)
            self._store.ns_mask[vacant_ids] = 0
            self._store.remove(vacant_ids)


class _ManyClaims:
    """The claims on a chunk past `_FEW_CLAIMS` namespaces: `slots` {namespace id: slot}
    and `occupants` {content id: [order number, claims on it]}, so that adding or
    removing one claim is O(1) however many there are. Rare, so its GC tracking does not
    matter."""

    __slots__ = ("slots", "occupants")

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}
        self.occupants: dict[int, list[int]] = {}

    def __getstate__(self) -> tuple:
        return self.slots, self.occupants

    def __setstate__(self, state: tuple) -> None:
        self.slots, self.occupants = state


# Python memory of one chunk beyond the arrays: its record (a slot number, usually).
_RECORD_BYTES = sys.getsizeof(10**6)
