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
earlier in this query ("first": in the order that namespace claimed them); a later
occurrence of the same content gets the next one, and once all are named, none.

Why costs do not grow with multiplicity (one document behind a thousand prefixes is a
thousand occupants of one content): each (chunk, namespace) claim is a *slot*, and the
claims one namespace holds on one content form a circular doubly linked list of slots,
in claim order, kept in flat integer arrays. Adding or removing a claim splices one slot
in or out, O(1); a match takes one step along a list per occurrence. So a lookup costs
O(query + matches) and deleting n occupants O(n), however many occupants a content has
and however many of them belong to other namespaces.

Invariants (all under `self._lock`, which is never held while calling out):
- `_chunks[h] == (cid, claim)` for chunk `h` of content `cid`: `claim` is the slot of
  h's only claim; a tuple of slots while a few namespaces claim h; past `_FEW_CLAIMS`, a
  dict {namespace id: slot}, so that a chunk thousands of tenants claim costs O(1) per
  claim. Records are tuples and dicts of atoms, untracked by Python's cyclic GC, so an
  index of a million chunks adds no GC pause.
- slot `s`: `_slot_chunk[s]` its chunk, `_slot_ns[s]` its namespace id,
  `_slot_offset[s]` the chunk's stored offset (the same in every slot of a chunk),
  `_next[s]` and `_prev[s]` its neighbours in its circular list (the head's prev is
  the tail). Free slots are chained through `_next` from `_free_slot`.
- the list of (cid, ns) starts at `_head[cid]` if `_slot_ns[_head[cid]] == ns`, else at
  `_more_heads[ns << 32 | cid]`: most contents are claimed by one namespace, so their
  only list costs no dict entry.
- `_num_chunks[cid]` occupants per content. A content is stored iff it has an
  occupant; a chunk exists iff a namespace claims it.
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
_FEW_CLAIMS = 8  # namespaces on one chunk kept in a tuple (scanned); past this, a dict


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
        self._chunks: dict[Hashable, tuple] = {}
        # Claim slots.
        self._slot_chunk: list[Hashable] = []
        self._slot_ns = array("i")
        self._slot_offset = array("q")
        self._next = array("i")
        self._prev = array("i")
        self._free_slot = _NONE
        # Per content id (grown with the store).
        self._head = array("i")
        self._num_chunks = array("i")
        self._more_heads: dict[int, int] = {}
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
        offset, is logged and skipped. Adding again only updates the offset and adds
        the claim (a claim keeps its place in its namespace's order); a known hash with
        different tokens moves to the new content, dropping every claim it had on the
        old one.
        """
        rows = as_tokens(tokens)
        if rows.shape != (self.chunk_size,):
            log.debug("not indexed: chunk %r has %d tokens, not %d",
                      chunk_hash, rows.size, self.chunk_size)
            return
        self.add_many(rows.reshape(1, -1), [chunk_hash], [token_offset], namespace)

    def add_many(self, rows, chunk_hashes: Sequence[Hashable], token_offsets: Sequence[int],
                 namespace: Hashable) -> None:
        """`add` for a (n, chunk_size) array of rows in one lock acquisition."""
        rows = as_tokens(rows)
        if rows.ndim != 2 or rows.shape[1] != self.chunk_size:
            raise ValueError(f"rows must have shape (n, {self.chunk_size}), got {rows.shape}")
        if not (len(rows) == len(chunk_hashes) == len(token_offsets)):
            raise ValueError("rows, chunk_hashes and token_offsets differ in length")
        offsets = np.asarray(token_offsets, dtype=np.int64)
        if offsets.size and offsets.min() < 0:
            keep = np.flatnonzero(offsets >= 0)
            log.debug("not indexed: %d chunks with unknown offset", offsets.size - keep.size)
            rows, offsets = rows[keep], offsets[keep]
            chunk_hashes = [chunk_hashes[i] for i in keep.tolist()]
        if not len(chunk_hashes):
            return
        with self._lock:
            cids, _ = self._store.insert(np.ascontiguousarray(rows))
            self._grow_contents()
            chunks, num_chunks, vacated = self._chunks, self._num_chunks, []
            ns_id = self._namespace_id(namespace)
            bits, claimed = _mask_bit(ns_id), 0  # counted once per batch
            for chunk_hash, cid, offset in zip(chunk_hashes, cids.tolist(), offsets.tolist()):
                record = chunks.get(chunk_hash)
                if record is not None and record[0] != cid:
                    # The hash now names other content: retire it from the old one first.
                    self._count_claims(ns_id, claimed)
                    vacated.append(record[0])
                    self._drop(chunk_hash, record)
                    record, claimed = None, 0
                    ns_id = self._namespace_id(namespace)  # the drop may have retired it
                    bits |= _mask_bit(ns_id)
                if record is None:
                    chunks[chunk_hash] = (cid, self._claim(chunk_hash, cid, ns_id, offset))
                    num_chunks[cid] += 1
                    claimed += 1
                    continue
                claim, added = self._with_claim(chunk_hash, cid, record[1], ns_id, offset)
                claimed += added
                if claim is not record[1]:
                    chunks[chunk_hash] = (cid, claim)
            self._count_claims(ns_id, claimed)
            # Every content of the batch is claimed by the namespace now (a stale extra bit
            # where a drop retired and renumbered it costs nothing but a comparison).
            self._store.ns_mask[cids] |= np.uint64(bits)
            # Released only now: a later row of this batch may have found that content.
            self._settle(vacated)

    # --- removing ---------------------------------------------------------------------

    def remove_claim(self, tokens, chunk_hash: Hashable, namespace: Hashable) -> None:
        """Drop `namespace`'s claim on a chunk; the chunk lives on for other namespaces.

        `tokens` name the content the caller knows the chunk by (None: whatever it is);
        if they differ from the indexed content, or anything is unknown, nothing changes.
        """
        with self._lock:
            record = self._known_record(tokens, chunk_hash)
            ns_id = self._ns_ids.get(namespace)
            if record is None or ns_id is None:
                return
            cid, claim = record
            slot, rest = self._without_claim(claim, ns_id)
            if slot == _NONE:
                return
            self._unclaim(slot, cid)
            if rest is None:
                del self._chunks[chunk_hash]
                self._num_chunks[cid] -= 1
            elif rest is not claim:
                self._chunks[chunk_hash] = (cid, rest)
            self._settle([cid])

    def remove_chunk(self, tokens, chunk_hash: Hashable) -> None:
        """Drop a chunk and every claim on it, in one lock acquisition.

        `tokens` as for `remove_claim`."""
        with self._lock:
            record = self._known_record(tokens, chunk_hash)
            if record is not None:
                self._drop(chunk_hash, record)
                self._settle([record[0]])

    def remove_chunks(self, chunk_hashes: Iterable[Hashable]) -> None:
        """Drop chunks by hash with all their claims; unknown hashes are skipped."""
        with self._lock:
            vacated = []
            for chunk_hash in chunk_hashes:
                record = self._chunks.get(chunk_hash)
                if record is not None:
                    self._drop(chunk_hash, record)
                    vacated.append(record[0])
            self._settle(vacated)

    # --- matching -------------------------------------------------------------------------

    def match(self, query, namespace: Hashable) -> list[BlendMatch]:
        """The chunks of `namespace` found in `query`, by the match rule (module doc).

        Ascending by `cur_st`; at most one match per position and per chunk; every
        match compared token by token.
        """
        tokens = as_tokens(query)
        if tokens.ndim != 1:
            raise ValueError(f"query must be one-dimensional, got shape {tokens.shape}")
        if tokens.size < self.chunk_size:
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
        tokens = as_tokens(query)
        if tokens.ndim != 1:
            raise ValueError(f"query must be one-dimensional, got shape {tokens.shape}")
        if tokens.size < self.chunk_size:
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

    def tokens_of(self, chunk_hash: Hashable) -> np.ndarray | None:
        """A copy of an indexed chunk's content, or None if the chunk is not indexed.

        Lets a caller that needs a chunk's tokens only now and then (the coordinator's
        directory) fetch them here instead of keeping a second copy."""
        with self._lock:
            record = self._chunks.get(chunk_hash)
            return None if record is None else self._store.row(record[0]).copy()

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
        with self._lock:
            num_chunks = len(self._chunks)
            arrays = (self._slot_ns, self._slot_offset, self._next, self._prev,
                      self._head, self._num_chunks)
            python_bytes = (sys.getsizeof(self._chunks) + num_chunks * _RECORD_BYTES
                            + sys.getsizeof(self._slot_chunk)
                            + sys.getsizeof(self._more_heads)
                            + sum(len(a) * a.itemsize for a in arrays))
            return {
                "num_contents": self._store.num_contents,
                "num_chunks": num_chunks,
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

    def _known_record(self, tokens, chunk_hash: Hashable) -> tuple | None:
        record = self._chunks.get(chunk_hash)
        if record is None or tokens is None:
            return record
        return record if self._store.holds(record[0], as_tokens(tokens)) else None

    def _head_of(self, cid: int, ns_id: int) -> int:
        """The first slot of `ns_id`'s list on content `cid`, or _NONE."""
        head = self._head[cid]
        if head != _NONE and self._slot_ns[head] == ns_id:
            return head
        return self._more_heads.get(ns_id << _NS_SHIFT | cid, _NONE)

    def _set_head(self, cid: int, ns_id: int, old: int, new: int) -> None:
        """Move the head of `ns_id`'s list on `cid` from slot `old` to `new` (_NONE: the
        list is gone)."""
        if self._head[cid] == old:
            self._head[cid] = new
        elif new == _NONE:
            del self._more_heads[ns_id << _NS_SHIFT | cid]
        else:
            self._more_heads[ns_id << _NS_SHIFT | cid] = new

    def _claim(self, chunk_hash: Hashable, cid: int, ns_id: int, offset: int) -> int:
        """Append a claim of `ns_id` on `chunk_hash` (content `cid`) to its list; the slot.

        Runs once per stored chunk, so it does the least it can: the caller counts the
        claim (`_count_claims`) and sets the namespace's mask bit."""
        slot_ns, next_slot, prev_slot = self._slot_ns, self._next, self._prev
        head = self._head[cid]
        if head == _NONE or slot_ns[head] != ns_id:
            # Not the primary list; the namespace's list may still be among the others
            # (the primary one may have gone while they stayed): as `_head_of`.
            head = (self._more_heads.get(ns_id << _NS_SHIFT | cid, _NONE)
                    if self._more_heads else _NONE)
        slot = self._free_slot
        if slot == _NONE:
            slot = len(slot_ns)
            self._slot_chunk.append(chunk_hash)
            slot_ns.append(ns_id)
            self._slot_offset.append(offset)
            next_slot.append(slot)
            prev_slot.append(slot)
        else:
            self._free_slot = next_slot[slot]
            self._slot_chunk[slot] = chunk_hash
            slot_ns[slot] = ns_id
            self._slot_offset[slot] = offset
            next_slot[slot] = prev_slot[slot] = slot
        if head == _NONE:  # the namespace's first claim on this content: a new list
            if self._head[cid] == _NONE:
                self._head[cid] = slot
            else:
                self._more_heads[ns_id << _NS_SHIFT | cid] = slot
        else:  # at the tail, which is the head's prev
            tail = prev_slot[head]
            next_slot[tail] = slot
            prev_slot[slot] = tail
            next_slot[slot] = head
            prev_slot[head] = slot
        return slot

    def _count_claims(self, ns_id: int, claimed: int) -> None:
        self._ns_claim_counts[ns_id] += claimed
        self._num_claims += claimed

    def _unclaim(self, slot: int, cid: int) -> None:
        """Splice a claim's slot out of its list and free it; retire the namespace's id
        with its last claim."""
        next_slot, prev_slot = self._next, self._prev
        ns_id = self._slot_ns[slot]
        following = next_slot[slot]
        if following == slot:  # the list's only slot: the list goes (its mask bit may
            self._set_head(cid, ns_id, slot, _NONE)  # stay: a stale bit costs a compare)
        else:
            preceding = prev_slot[slot]
            next_slot[preceding] = following
            prev_slot[following] = preceding
            if self._head_of(cid, ns_id) == slot:
                self._set_head(cid, ns_id, slot, following)
        self._slot_chunk[slot] = None
        next_slot[slot] = self._free_slot
        self._free_slot = slot
        self._num_claims -= 1
        self._ns_claim_counts[ns_id] -= 1
        if self._ns_claim_counts[ns_id] == 0:
            del self._ns_ids[self._ns_names[ns_id]]
            self._ns_names[ns_id] = None
            self._free_ns_ids.append(ns_id)

    def _with_claim(self, chunk_hash: Hashable, cid: int, claim, ns_id: int, offset: int
                    ) -> tuple[object, bool]:
        """(a chunk's `claim` with `ns_id`'s added if it was missing, whether it was),
        every slot at `offset`. The same object if nothing but offsets changed."""
        slot_ns, slot_offset = self._slot_ns, self._slot_offset
        if type(claim) is dict:
            for slot in claim.values():
                slot_offset[slot] = offset
            if ns_id in claim:
                return claim, False
            claim[ns_id] = self._claim(chunk_hash, cid, ns_id, offset)
            return claim, True
        slots = (claim,) if type(claim) is int else claim
        claimed = False
        for slot in slots:
            slot_offset[slot] = offset
            claimed |= slot_ns[slot] == ns_id
        if claimed:
            return claim, False
        added = self._claim(chunk_hash, cid, ns_id, offset)
        if len(slots) < _FEW_CLAIMS:
            return slots + (added,), True
        many = {slot_ns[slot]: slot for slot in slots}
        many[ns_id] = added
        return many, True

    def _without_claim(self, claim, ns_id: int) -> tuple[int, object]:
        """(the slot of `ns_id`'s claim or _NONE, what is left of `claim`: None if
        nothing, the same object if it was changed in place)."""
        if type(claim) is dict:
            slot = claim.pop(ns_id, _NONE)
            return slot, (claim or None)
        slots = (claim,) if type(claim) is int else claim
        slot_ns = self._slot_ns
        for i, slot in enumerate(slots):
            if slot_ns[slot] == ns_id:
                rest = slots[:i] + slots[i + 1:]
                return slot, (None if not rest else rest[0] if len(rest) == 1 else rest)
        return _NONE, claim

    def _drop(self, chunk_hash: Hashable, record: tuple) -> None:
        cid, claim = record
        slots = (claim,) if type(claim) is int else (
            claim if type(claim) is tuple else list(claim.values()))
        for slot in slots:
            self._unclaim(slot, cid)
        del self._chunks[chunk_hash]
        self._num_chunks[cid] -= 1

    def _settle(self, touched: Iterable[int]) -> None:
        """Free each touched content left without an occupant."""
        vacant = [cid for cid in set(touched) if self._num_chunks[cid] == 0]
        if vacant:
            vacant_ids = np.array(vacant, dtype=np.int64)
            self._store.ns_mask[vacant_ids] = 0
            self._store.remove(vacant_ids)


# Python memory of one chunk beyond the arrays: its record and the ints in it.
_RECORD_BYTES = sys.getsizeof((10**6, 10**6)) + 2 * sys.getsizeof(10**6)
