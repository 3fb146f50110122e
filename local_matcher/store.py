"""Content-addressed storage of token windows, searched by rolling fingerprint.

`ContentStore` keeps each distinct content of exactly `chunk_size` tokens once, under a
small integer id, and finds every stored content in a query with `probe`. It owns the
arrays the kernels in `local_matcher.kernels` work on and is their only caller.

Not thread-safe: `ContentIndex` serialises every call under its lock.

Sizing invariants:
- Tokens live in blocks of `kernels.BLOCK_ROWS` contents; growing adds a block and
  never copies stored tokens. A block row holds each token in three bytes while every
  stored id is below `kernels.PACKED_TOKEN_LIMIT` (2^24; real vocabularies are below
  2^18), so tokens cost 3 B each; the first content with a larger id widens the whole
  store to four bytes a token, once (`_widen`): what is found never depends on it.
  Removed contents' ids sit on a free stack and are taken again before any id not yet
  handed out, so any number of insert/remove cycles never exhausts the store; the stack
  grows with what is removed, not with what is stored. `ns_mask`, the one array indexed
  by content id, covers the ids handed out (`id_limit`) and grows by a quarter.
- The table has at least twice as many slots as there are contents (never more than
  half full): it grows by a quarter when one more content would pass that, so it stays
  40-50 % full, and its size depends only on the contents stored, not on how they were
  batched. Its size is not a power of two (`kernels._home`), or it would be 25-50 % full
  and cost up to twice the bytes. The filter has a power of two
  words, at least 8 bits per table slot, 3 per content in one 64-bit word: at most about
  1 probe in 125 passes the filter by chance.
"""

from __future__ import annotations

import logging
import secrets
from array import array

import numpy as np

from local_matcher import candidate_kernels, content_groups, head_table, kernels
from local_matcher.head_table import HeadTable

log = logging.getLogger(__name__)

_FILTER_BITS_PER_SLOT = 8
_MIN_TABLE_SLOTS = 16
# Probe buffers are kept for queries up to this many tokens (a few MB); longer ones
# allocate their own, so one huge query does not hold its memory for good.
_KEPT_BUFFER_TOKENS = 1 << 17
_MASK64 = 2**64 - 1


def _as_u64(value: int) -> np.uint64:
    return np.uint64(value & _MASK64)


def _unpacked(rows: np.ndarray) -> np.ndarray:
    """Packed rows (three little-endian bytes a token) as uint32 tokens."""
    shape = (*rows.shape[:-1], rows.shape[-1] // 3)
    quads = np.zeros((*shape, 4), dtype=np.uint8)  # the fourth byte of each token: 0
    quads[..., :3] = rows.reshape(*shape, 3)
    return quads.view("<u4").reshape(shape).astype(np.uint32, copy=False)


def _grown(array_: np.ndarray, size: int) -> np.ndarray:
    """`array_` followed by zeros up to `size` elements."""
    out = np.zeros(size, dtype=array_.dtype)
    out[: len(array_)] = array_
    return out


#: Per-content scratch columns of earlier builds (a probe's groups are per query now).
_RETIRED = ("_first", "_cursor", "_seen", "_epoch")


class ContentStore:
    _warmed = False

    @classmethod
    def warm_up(cls) -> None:
        """Compile (or load from numba's on-disk cache) every kernel, once per process, so
        the first real lookup does not pay for it."""
        if cls._warmed:
            return
        store = cls(4)
        cids, _ = store.insert(np.arange(8, dtype=np.uint32).reshape(2, 4))
        store.ns_mask[cids] = 1
        query = np.arange(12, dtype=np.uint32)
        head, slot_ns = array("i", [-1, -1]), array("i", [0, 0])  # no lists: no matches
        next_slot, slot_offset = array("i", [0]), array("q", [0])
        store.match_occupants(query, 1, 1, 0, head, slot_ns, HeadTable(), next_slot,
                              slot_offset)
        found = store.probe(query, 1, 1)
        others = HeadTable()
        for key in range(8):  # past half full: compiles `rehash`
            others.set(key, 0)
        heads = head_table.heads_of(found[1], 0, head, slot_ns, *others.for_kernels)
        store.occurrences(query, *found, 1)
        candidate_kernels.walk_lists(heads, np.ones(heads.size, dtype=np.int64), next_slot)
        store.remove(cids)
        store._grow_table()  # compiles rebuild_table
        cls._warmed = True

    def __init__(self, chunk_size: int, fingerprint_key: tuple[int, int] | None = None) -> None:
        if fingerprint_key is None:
            fingerprint_key = (secrets.randbits(64), secrets.randbits(64))
        salt, base = fingerprint_key
        self.chunk_size = chunk_size
        self._salt = _as_u64(salt)
        self._base = _as_u64(base | 1)  # odd: multiplication by it is invertible mod 2**64
        self._base_pow = _as_u64(pow(int(self._base), chunk_size, 2**64))
        # The token blocks twice over, the same arrays: a Python list for Python (sizes,
        # rows, pickling), numba's typed list for the kernels (`kernels.new_blocks`).
        self._block_arrays: list[np.ndarray] = []
        self._blocks = None
        # Per content id: its namespaces' bits (`mask_bit`), 4 bytes. What a probe keeps
        # per content it finds is per query (`_probe_buffers`).
        self.ns_mask = np.zeros(0, dtype=np.uint32)
        self._free_ids = np.zeros(0, dtype=np.int32)
        # [0]: ids on the free stack; [1]: ids handed out so far (the next new id).
        self._id_counts = np.zeros(2, dtype=np.int64)
        self._drop_buffers()
        self._allocate_table(_MIN_TABLE_SLOTS)
        self._reserve(1)

    def __getstate__(self) -> dict:
        """Picklable: the blocks travel as the plain list; the typed one is rebuilt."""
        state = dict(vars(self))
        for name in ("_blocks", "_scratch", "_found", "_out", "_groups", "_cursors",
                     "_probed"):
            del state[name]
        return state

    def __setstate__(self, state: dict) -> None:
        for name in _RETIRED:  # pickled by an earlier build
            state.pop(name, None)
        vars(self).update(state)
        # A pickle of a build that kept them as int64.
        self._free_ids = self._free_ids.astype(np.int32, copy=False)
        if self.ns_mask.dtype == np.uint64:  # 64 bits a mask then: bit k is bit k % 32 now
            self.ns_mask = ((self.ns_mask & 0xFFFFFFFF) | (self.ns_mask >> np.uint64(32))
                            ).astype(np.uint32)
        self._drop_buffers()
        blocks = self._block_arrays
        self._blocks = kernels.new_blocks(blocks[0])
        for block in blocks[1:]:
            kernels.append_block(self._blocks, block)

    # --- sizing ---------------------------------------------------------------------

    @property
    def packed(self) -> bool:
        """Whether the blocks hold three bytes a token (else four; module doc)."""
        return not self._block_arrays or self._block_arrays[0].dtype == np.uint8

    @property
    def capacity(self) -> int:
        return len(self._block_arrays) * kernels.BLOCK_ROWS

    @property
    def num_contents(self) -> int:
        freed, handed_out = self._id_counts.tolist()
        return handed_out - freed

    @property
    def id_limit(self) -> int:
        """Every content id in use is below this (the ids handed out so far)."""
        return int(self._id_counts[1])

    @property
    def table_size(self) -> int:
        return self._table.shape[0] // 3

    @property
    def nbytes(self) -> int:
        arrays = (*self._block_arrays, self.ns_mask, self._free_ids, self._table,
                  self._filter)
        return sum(a.nbytes for a in arrays)

    def _allocate_table(self, slots: int) -> None:
        words = -(-slots * _FILTER_BITS_PER_SLOT // 64)
        word_bits = max(1, (words - 1).bit_length())
        self._filter_shift = np.uint64(64 - word_bits)
        self._table = np.zeros(3 * slots, dtype=np.uint32)  # kernels.py: its layout
        self._filter = np.zeros(1 << word_bits, dtype=np.uint64)

    def _reserve(self, extra: int) -> None:
        """Make room for `extra` new contents: whole blocks (the table grows as contents
        are stored: `insert`)."""
        while self.capacity - self.num_contents < extra:
            new = self.capacity + kernels.BLOCK_ROWS
            # Rows are written before any read; fresh pages are mapped lazily on first write.
            if self.packed:
                block = np.empty((kernels.BLOCK_ROWS, 3 * self.chunk_size), dtype=np.uint8)
            else:
                block = np.empty((kernels.BLOCK_ROWS, self.chunk_size), dtype=np.uint32)
            self._block_arrays.append(block)
            if self._blocks is None:
                self._blocks = kernels.new_blocks(block)
            else:
                kernels.append_block(self._blocks, block)

    def _grow_table(self) -> None:
        """A quarter more slots, every entry placed again."""
        old_table = self._table
        self._allocate_table(self.table_size * 5 // 4)
        kernels.rebuild_table(old_table, self._table, self._filter, self._filter_shift)

    # --- operations -------------------------------------------------------------------

    def insert(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Find-or-store each row of a (n, chunk_size) uint32 array.

        Returns the content id of every row and a flag array, 1 where the row's
        content was stored by this call.
        """
        if self.packed and rows.size and int(rows.max()) >= kernels.PACKED_TOKEN_LIMIT:
            self._widen()
        self._reserve(rows.shape[0])
        count = rows.shape[0]
        cids, fresh = np.empty(count, dtype=np.int64), np.zeros(count, dtype=np.uint8)
        done = 0
        while True:
            done = kernels.insert_rows(rows, done, cids, fresh, self._salt, self._base,
                                       self._blocks, self._table, self._filter,
                                       self._filter_shift, self._free_ids, self._id_counts)
            if done == count:
                break
            self._grow_table()
        size = len(self.ns_mask)
        while size < self.id_limit:  # by a quarter at a time: the same sizes however batched
            size = max(size * 5 // 4, 1024)
        if size > len(self.ns_mask):
            self.ns_mask = _grown(self.ns_mask, size)
        return cids, fresh

    def remove(self, cids: np.ndarray) -> None:
        """Forget stored contents by id (each id once); their slots become reusable."""
        needed = int(self._id_counts[0]) + len(cids)
        size = len(self._free_ids)
        while size < needed:  # doubling from 16: the same sizes however batched
            size = max(2 * size, 16)
        if size > len(self._free_ids):
            self._free_ids = _grown(self._free_ids, size)
        kernels.remove_contents(cids, self._salt, self._base, self._blocks, self._table,
                                self._filter, self._filter_shift, self._free_ids,
                                self._id_counts)

    def row(self, cid: int) -> np.ndarray:
        """The stored tokens of content `cid` as uint32 (a view if the store is wide)."""
        row = self._block_arrays[cid >> kernels.BLOCK_BITS][cid & (kernels.BLOCK_ROWS - 1)]
        return _unpacked(row) if row.dtype == np.uint8 else row

    def _widen(self) -> None:
        """Every block to four bytes a token: a content with an id the packed rows cannot
        hold is about to be stored (once per store; what is found does not change)."""
        log.warning("a content with a token id >= 2^24 is being stored: the store now "
                    "keeps 4 bytes a token (3 until now) for its %d contents",
                    self.num_contents)
        self._block_arrays = [_unpacked(block) for block in self._block_arrays]
        self._blocks = kernels.new_blocks(self._block_arrays[0])
        for block in self._block_arrays[1:]:
            kernels.append_block(self._blocks, block)

    def probe(self, query: np.ndarray, stride: int, ns_bit: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Occurrences of contents whose namespace mask has `ns_bit`: (positions, ids) of
        each content's first verified occurrence, then (positions, ids) of its later
        candidates, not yet verified (`occurrences`). Both ascending by position;
        views of the store's buffers, valid until its next `probe` or `match_occupants`."""
        self._probe_buffers(query.size)
        self._probed = kernels.probe(
            query, stride, self._salt, self._base, self._base_pow, self._filter,
            self._filter_shift, self._table, self._blocks, self.chunk_size, self.ns_mask,
            np.uint32(ns_bit), self._groups, self._scratch, self._found)
        return self._probed_views()

    def match_occupants(self, query: np.ndarray, stride: int, ns_bit: int, ns_id: int,
                        head, slot_ns, other_heads: HeadTable, next_slot, slot_offset
                        ) -> np.ndarray:
        """`probe`, then the occupants of namespace `ns_id`'s lists, in one kernel call
        (`kernels.match_occupants`): a (3, matches) view of (positions, slots, offsets),
        valid until the next probe. The lists are the caller's (`local_matcher.claims`): `head[cid]`
        the first list on a content, its namespace `slot_ns[head[cid]]`; the heads of the
        others in `other_heads`."""
        self._probe_buffers(query.size)
        firsts, repeats, matches = kernels.match_occupants(
            query, stride, self._salt, self._base, self._base_pow, self._filter,
            self._filter_shift, self._table, self._blocks, self.chunk_size, self.ns_mask,
            np.uint32(ns_bit), self._groups, self._scratch, self._found, head,
            slot_ns, ns_id, *other_heads.for_kernels, next_slot, slot_offset, self._cursors,
            self._out)
        self._probed = firsts, repeats
        return self._out[:, :matches]

    def probed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """What the last `probe` or `match_occupants` found, as `probe` returns it."""
        return self._probed_views()

    def _probed_views(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        firsts, repeats = self._probed
        found = self._found
        return found[0, :firsts], found[1, :firsts], found[2, :repeats], found[3, :repeats]

    def _probe_buffers(self, n: int) -> None:
        """Buffers for a probe of `n` tokens: kept (grown in powers of two) up to
        `_KEPT_BUFFER_TOKENS`; a longer query gets buffers of its exact size, which the
        next query replaces."""
        held = self._found.shape[1]
        if n <= _KEPT_BUFFER_TOKENS:
            if n <= held <= _KEPT_BUFFER_TOKENS:
                return
            size = 1 << max(n - 1, 1).bit_length()
        elif held == n:
            return
        else:
            size = n
        self._scratch = np.empty(2 * size, dtype=np.uint64)
        self._found = np.empty((4, size), dtype=np.int64)
        self._out = np.empty((3, size), dtype=np.int64)
        self._groups = content_groups.buffer_for(size)
        self._cursors = np.empty((2, size), dtype=np.int32)  # claim slots are int32

    def _drop_buffers(self) -> None:
        self._scratch = np.empty(0, dtype=np.uint64)
        self._found = np.empty((4, 0), dtype=np.int64)
        self._out = np.empty((3, 0), dtype=np.int64)
        self._groups = content_groups.buffer_for(1)
        self._cursors = np.empty((2, 0), dtype=np.int32)
        self._probed = (0, 0)

    def occurrences(self, query: np.ndarray, first_pos: np.ndarray, first_cid: np.ndarray,
                    repeat_pos: np.ndarray, repeat_cid: np.ndarray, max_positions: int
                    ) -> tuple[np.ndarray, np.ndarray, bool]:
        """Every verified occurrence `probe` found, grouped by content in order of first
        occurrence, the leftmost `max_positions` of each: (positions, group sizes, whether
        some content had more); repeats are compared token by token here, with their
        content's first occurrence."""
        # The chunk size, not the blocks: repeats are compared within the query, and a
        # typed list costs every call ~2 us to pass.
        return candidate_kernels.group_occurrences(query, first_pos, first_cid, repeat_pos,
                                                   repeat_cid, self.chunk_size, self._groups,
                                                   max_positions)
