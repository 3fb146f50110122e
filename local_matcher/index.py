"""The content index: which stored chunks does a token sequence contain, and where?

Design (shared/DESIGN.md, "The content index"): content of exactly `chunk_size` tokens is
stored once in a `ContentStore`; every chunk hash that names that content is an
*occupant* of it, carrying its own stored offset and the set of namespaces that claim
it. A match rolls a fingerprint over the query, lets the filter and the exact table
reject almost every window, skips contents no occupant of which the requester's
namespace may claim, and only then compares tokens.

Invariants (all under `self._lock`, which is never held while calling out):
- `_chunks[h] == (cid, offset, claims)` for chunk `h` of content `cid`; `_occupants[cid]`
  is the tuple of the hashes of that content's chunks. Records are tuples of atoms, so
  Python's cyclic GC untracks them: an index of a million chunks adds no GC pause.
- A chunk exists iff at least one namespace claims it (`claims != 0`); a content is
  stored iff it has at least one occupant. Removing the last one frees the slot.
- `claims` is a bit set of namespace ids (Python int); a namespace's id is recycled
  once nothing claims it, so the ids stay small.
- `store.ns_mask[cid]` holds bit `id % 64` of every namespace claiming an occupant of
  `cid`; it may carry stale extra bits (a cheap pre-test), never miss one.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Hashable, Iterable, Sequence

import numpy as np

from local_matcher.store import ContentStore
from local_matcher.types import MAX_TOKEN_ID, BlendMatch

log = logging.getLogger(__name__)



def as_tokens(values) -> np.ndarray:
    """A contiguous uint32 array of token ids; ValueError for ids outside uint32."""
    array = np.asarray(values)
    if array.dtype == np.uint32:
        return np.ascontiguousarray(array)
    if array.size == 0:
        return np.zeros(array.shape, dtype=np.uint32)
    if array.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, not {array.dtype}")
    if array.min() < 0 or array.max() > MAX_TOKEN_ID:
        raise ValueError("token ids must fit in uint32 (0 .. 2**32-1)")
    return array.astype(np.uint32)


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
        self._chunks: dict[Hashable, tuple[int, int, int]] = {}
        self._occupants: list[tuple] = []
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
        the claim; a known hash with different tokens moves to the new content,
        dropping every claim it had on the old one.
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
            ns_id = self._namespace_id(namespace)
            cids, _ = self._store.insert(np.ascontiguousarray(rows))
            if len(self._occupants) < self._store.capacity:
                self._occupants.extend([()] * (self._store.capacity - len(self._occupants)))
            chunks, occupants, vacated = self._chunks, self._occupants, []
            bit, claimed = 1 << ns_id, 0
            for chunk_hash, cid, offset in zip(chunk_hashes, cids.tolist(), offsets.tolist()):
                record = chunks.get(chunk_hash)
                if record is not None and record[0] != cid:
                    # The hash now names other content: retire it from the old one first.
                    self._count_claims(ns_id, claimed)
                    vacated.append(record[0])
                    self._drop(chunk_hash, record)
                    record, claimed = None, 0
                    ns_id = self._namespace_id(namespace)  # the drop may have retired it
                    bit = 1 << ns_id
                if record is None:
                    chunks[chunk_hash] = (cid, offset, bit)
                    occupants[cid] += (chunk_hash,)
                    claimed += 1
                else:
                    claims = record[2]
                    if not claims & bit:
                        claims |= bit
                        claimed += 1
                    chunks[chunk_hash] = (cid, offset, claims)
            self._count_claims(ns_id, claimed)
            self._store.ns_mask[cids] |= np.uint64(_mask_bit(ns_id))
            # Released only now: a later row of this batch may have found that content.
            self._release_if_vacant(vacated)

    # --- removing ---------------------------------------------------------------------

    def remove_claim(self, tokens, chunk_hash: Hashable, namespace: Hashable) -> None:
        """Drop `namespace`'s claim on a chunk; the chunk lives on for other namespaces.

        `tokens` name the content the caller knows the chunk by (None: whatever it is);
        if they differ from the indexed content, or anything is unknown, nothing changes.
        """
        with self._lock:
            record = self._known_record(tokens, chunk_hash)
            ns_id = self._ns_ids.get(namespace)
            if record is None or ns_id is None or not (record[2] >> ns_id) & 1:
                return
            cid, offset, claims = record
            self._unclaim(ns_id)
            claims &= ~(1 << ns_id)
            if claims:
                self._chunks[chunk_hash] = (cid, offset, claims)
            else:
                self._unlink(chunk_hash, cid)
            self._release_if_vacant([cid])

    def remove_chunk(self, tokens, chunk_hash: Hashable) -> None:
        """Drop a chunk and every claim on it, in one lock acquisition.

        `tokens` as for `remove_claim`."""
        with self._lock:
            record = self._known_record(tokens, chunk_hash)
            if record is not None:
                self._drop(chunk_hash, record)
                self._release_if_vacant([record[0]])

    def remove_chunks(self, chunk_hashes: Iterable[Hashable]) -> None:
        """Drop chunks by hash with all their claims; unknown hashes are skipped."""
        with self._lock:
            vacated = []
            for chunk_hash in chunk_hashes:
                record = self._chunks.get(chunk_hash)
                if record is not None:
                    self._drop(chunk_hash, record)
                    vacated.append(record[0])
            self._release_if_vacant(vacated)

    # --- matching -------------------------------------------------------------------------

    def match(self, query, namespace: Hashable) -> list[BlendMatch]:
        """Every chunk `namespace` claims whose content occurs in `query`.

        Ascending by `cur_st`; one match per chunk, at its first occurrence; every
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
            positions, cids = self._store.probe(tokens, self.probe_stride, _mask_bit(ns_id))
            chunks, occupants, matches = self._chunks, self._occupants, []
            for cur_st, cid in zip(positions.tolist(), cids.tolist()):
                for chunk_hash in occupants[cid]:
                    _, offset, claims = chunks[chunk_hash]
                    if (claims >> ns_id) & 1:
                        matches.append(BlendMatch(chunk_hash, offset, cur_st))
            return matches

    def tokens_of(self, chunk_hash: Hashable) -> np.ndarray | None:
        """A copy of an indexed chunk's content, or None if the chunk is not indexed.

        Lets a caller that needs a chunk's tokens only now and then (the coordinator's
        directory) fetch them here instead of keeping a second copy."""
        with self._lock:
            record = self._chunks.get(chunk_hash)
            return None if record is None else self._store.row(record[0]).copy()

    def stats(self) -> dict[str, int]:
        with self._lock:
            num_chunks = len(self._chunks)
            python_bytes = (sys.getsizeof(self._chunks) + sys.getsizeof(self._occupants)
                            + num_chunks * _CHUNK_BYTES)
            return {
                "num_contents": self._store.num_contents,
                "num_chunks": num_chunks,
                "num_claims": self._num_claims,
                "num_namespaces": len(self._ns_ids),
                "table_size": self._store.table_size,
                "bytes": self._store.nbytes + python_bytes,
            }

    # --- internals (caller holds the lock) ----------------------------------------------

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

    def _known_record(self, tokens, chunk_hash: Hashable) -> tuple[int, int, int] | None:
        record = self._chunks.get(chunk_hash)
        if record is None or tokens is None:
            return record
        return record if self._store.holds(record[0], as_tokens(tokens)) else None

    def _count_claims(self, ns_id: int, claimed: int) -> None:
        self._ns_claim_counts[ns_id] += claimed
        self._num_claims += claimed

    def _unclaim(self, ns_id: int) -> None:
        """Count one claim of `ns_id` gone; retire the namespace's id with its last."""
        self._num_claims -= 1
        self._ns_claim_counts[ns_id] -= 1
        if self._ns_claim_counts[ns_id] == 0:
            del self._ns_ids[self._ns_names[ns_id]]
            self._ns_names[ns_id] = None
            self._free_ns_ids.append(ns_id)

    def _drop(self, chunk_hash: Hashable, record: tuple[int, int, int]) -> None:
        claims, ns_id = record[2], 0
        while claims:
            if claims & 1:
                self._unclaim(ns_id)
            claims >>= 1
            ns_id += 1
        self._unlink(chunk_hash, record[0])

    def _unlink(self, chunk_hash: Hashable, cid: int) -> None:
        del self._chunks[chunk_hash]
        self._occupants[cid] = tuple(h for h in self._occupants[cid] if h != chunk_hash)

    def _release_if_vacant(self, cids: Iterable[int]) -> None:
        """Free each content that lost its last occupant; refresh the others' masks."""
        vacant = []
        for cid in set(cids):
            if not self._occupants[cid]:
                vacant.append(cid)
                continue
            mask = 0
            for chunk_hash in self._occupants[cid]:
                claims = self._chunks[chunk_hash][2]
                while claims:
                    mask |= claims & 0xFFFFFFFFFFFFFFFF
                    claims >>= 64
            self._store.ns_mask[cid] = np.uint64(mask)
        if vacant:
            self._store.remove(np.array(vacant, dtype=np.int64))


# Python memory of one chunk: its record, its place among its content's occupants, its offset.
_CHUNK_BYTES = sys.getsizeof((0, 10**6, 1)) + sys.getsizeof((b"",)) + sys.getsizeof(10**6)
