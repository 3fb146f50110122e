"""The chunk hashes of a content index as columns: which claim a chunk hash names, and
which chunk hash each claim slot holds (docs/DESIGN.md, "The content index").

`ClaimLists` keeps here, per chunk, its *claim* (the slot of its only claim, an int; or a
tuple / record of several) and, per slot, the hash of the slot's chunk. The common chunk
hash costs no Python object. Which is common is `width`: the length of the first chunk
hash named here that is bytes of 8 to 64, a multiple of 8 (a fleet's engines all hash
alike: LMCache's blake3 hashes are 32 bytes, our `InMemoryHost`'s 16); it never changes.
A chunk hash of that width:

- its bytes are row `slot` of `keys`, a (slots, width / 8) uint64 array (a row per slot);
- `table`, open addressing with linear probing over int32 slot numbers (-1: empty), finds
  a chunk's only claim slot from its hash: the entry's key is the slot's row. A key's home
  is a mix of all its words with a random per-process salt, so no chunk hash a tenant
  chooses can pile its entries onto another's (as a dict's salted hash). Removal shifts
  later entries back (no tombstones); the table doubles past half full.

Anything else lives in `others`, a dict {chunk hash: claim}, and the slot's hash in
`odd_names` {slot: chunk hash}: a chunk several namespaces claim (a tuple of slots, rare)
and any other hash (another type or length: the local matcher takes any hashable).
A chunk is in exactly one of `table` and `others`.

Lock-free readers (`slots_of`) run kernels that hold the GIL, as every writer here does,
so a reader sees a table between two writes; it reads `table` before `keys` and a writer
replaces `keys` (grown) before any entry names a new row, so every entry it reads names a
row it has.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Sequence
from itertools import repeat
from typing import Hashable, Iterable, Iterator

import numpy as np
from numba import njit

EMPTY = -1
_WIDTHS = range(8, 65, 8)  # chunk-hash lengths that can be the column's
_MIN_TABLE = 16
_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)


class ChunkHashes:
    """{chunk hash: claim} and {slot: chunk hash} of a content index (module doc).
    Not thread-safe for writers (the index's lock covers them)."""

    def __init__(self) -> None:
        self.width = 0  # bytes of a column hash; 0: none named yet
        self.keys = np.zeros((0, 0), dtype=np.uint64)
        self.table = _empty_table(_MIN_TABLE)
        self.in_table = 0
        self.salt = np.uint64(secrets.randbits(64))
        self.others: dict[Hashable, object] = {}
        self.odd_names: dict[int, Hashable] = {}

    def __len__(self) -> int:
        return self.in_table + len(self.others)

    def _is_column_hash(self, chunk_hash: object) -> bool:
        return type(chunk_hash) is bytes and len(chunk_hash) == self.width > 0

    def _all_column_hashes(self, chunk_hashes: Sequence[Hashable]) -> bool:
        return (len(chunk_hashes) > 0 and self.width > 0
                and set(map(type, chunk_hashes)) == {bytes}
                and set(map(len, chunk_hashes)) == {self.width})

    def _words(self, chunk_hashes: Sequence[bytes]) -> np.ndarray:
        """The rows of column hashes."""
        return np.frombuffer(b"".join(chunk_hashes), dtype=np.uint64).reshape(
            -1, self.width // 8)

    # --- by chunk hash ------------------------------------------------------------------

    def get(self, chunk_hash: Hashable, default=None):
        """The chunk's claim (a slot, or what `set` was given), or `default`."""
        if self._is_column_hash(chunk_hash):
            slot = find_one(self.table, self.keys, self.salt, chunk_hash)
            if slot != EMPTY:
                return slot
        return self.others.get(chunk_hash, default) if self.others else default

    def __contains__(self, chunk_hash: Hashable) -> bool:
        return self.get(chunk_hash) is not None

    def set(self, chunk_hash: Hashable, claim) -> None:
        """The chunk's claim is now `claim`. A slot (an int) must already be named
        `chunk_hash` (`name`): the table finds it by its row."""
        in_column = self._is_column_hash(chunk_hash)
        if in_column and type(claim) is int:
            if self.others:
                self.others.pop(chunk_hash, None)
            self.in_table += insert_slots(self.table, self.keys, self.salt,
                                          np.array([claim], dtype=np.int64))
            self._fit_table()
            return
        if in_column:
            self._remove_from_table(chunk_hash)
        self.others[chunk_hash] = claim

    def delete(self, chunk_hash: Hashable) -> None:
        """Forget the chunk (KeyError if unknown)."""
        if not (self._is_column_hash(chunk_hash) and self._remove_from_table(chunk_hash)):
            del self.others[chunk_hash]

    def known(self, chunk_hashes: Sequence[Hashable]) -> list[bool]:
        """Per chunk hash, whether it has a claim."""
        if self._all_column_hashes(chunk_hashes):
            found = (self._find_many(chunk_hashes) != EMPTY).tolist()
            if self.others:
                found = [was or chunk_hash in self.others
                         for was, chunk_hash in zip(found, chunk_hashes)]
            return found
        return [self.get(chunk_hash) is not None for chunk_hash in chunk_hashes]

    def add_new(self, chunk_hashes: Sequence[Hashable], slots: np.ndarray) -> None:
        """`set` of chunks new here and distinct (the caller's word), each claimed by the
        slot beside it, already `name`d."""
        if self._all_column_hashes(chunk_hashes):
            self._fit_table(len(slots))
            self.in_table += insert_slots(self.table, self.keys, self.salt, slots)
            return
        for chunk_hash, slot in zip(chunk_hashes, slots.tolist()):
            self.set(chunk_hash, slot)

    def slots_of(self, chunk_hashes: Sequence[Hashable]) -> list[int]:
        """Per chunk hash, its claim if that is one slot, else EMPTY (safe without the
        index lock: module doc)."""
        if self._all_column_hashes(chunk_hashes):
            return self._find_many(chunk_hashes).tolist()  # a chunk in `others` is not one slot
        claims = list(map(self.get, chunk_hashes, repeat(EMPTY)))
        return [claim if type(claim) is int else EMPTY for claim in claims]

    def items(self) -> dict[Hashable, object]:
        """{chunk hash: claim} of every chunk (for tests and inspection)."""
        slots = self.table[self.table != EMPTY].tolist()
        return dict(zip(self.at(slots), slots)) | self.others

    # --- by slot ------------------------------------------------------------------------

    def reserve(self, slots: int) -> None:
        """Rows for slots below `slots` (grown by a quarter at least: amortised O(1))."""
        if slots > len(self.keys):
            keys = np.zeros((max(slots, len(self.keys) * 5 // 4 + 16), self.width // 8),
                            dtype=np.uint64)
            keys[:len(self.keys)] = self.keys
            self.keys = keys  # before any entry names a new row (module doc)

    def name(self, slot: int, chunk_hash: Hashable) -> None:
        """Slot `slot` (reserved) holds a claim on `chunk_hash` from now on."""
        if not self.width:
            self._choose_width(chunk_hash)
        if self._is_column_hash(chunk_hash):
            self.keys[slot] = np.frombuffer(chunk_hash, dtype=np.uint64)
            if self.odd_names:
                self.odd_names.pop(slot, None)
        else:
            self.odd_names[slot] = chunk_hash

    def name_all(self, slots: np.ndarray, chunk_hashes: Sequence[Hashable]) -> None:
        """`name` of each slot with the chunk hash beside it."""
        if not self.width and len(chunk_hashes):
            self._choose_width(chunk_hashes[0])
        if self._all_column_hashes(chunk_hashes) and not self.odd_names:
            self.keys[slots] = self._words(chunk_hashes)
            return
        for slot, chunk_hash in zip(slots.tolist(), chunk_hashes):
            self.name(slot, chunk_hash)

    def unname(self, slot: int) -> None:
        """Slot `slot` holds nothing now (no chunk's claim is it any more)."""
        if self.odd_names:
            self.odd_names.pop(slot, None)

    def at(self, slots: Iterable[int] | np.ndarray) -> Sequence[Hashable]:
        """The chunk hash of each named slot: `HashRows` when all are column hashes."""
        if not isinstance(slots, np.ndarray):
            slots = np.fromiter(slots, dtype=np.int64)
        if not self.odd_names:
            return HashRows(self.keys[slots])
        odd, keys = self.odd_names, self.keys
        return [odd[slot] if slot in odd else keys[slot].tobytes() for slot in slots.tolist()]

    def nbytes(self) -> int:
        """Memory held: the columns, the dicts and their keys."""
        others = sum(sys.getsizeof(chunk_hash) for chunk_hash in self.others)
        return (self.keys.nbytes + self.table.nbytes + sys.getsizeof(self.others) + others
                + sys.getsizeof(self.odd_names) + 64 * len(self.odd_names))

    # --- internals ----------------------------------------------------------------------

    def _choose_width(self, chunk_hash: Hashable) -> None:
        """The column's width, from the first chunk hash named (module doc)."""
        if type(chunk_hash) is bytes and len(chunk_hash) in _WIDTHS:
            self.width = len(chunk_hash)
            self.keys = np.zeros((len(self.keys), self.width // 8), dtype=np.uint64)

    def _find_many(self, chunk_hashes: Sequence[bytes]) -> np.ndarray:
        table = self.table  # before `keys` (module doc)
        return find_many(table, self.keys, self.salt, self._words(chunk_hashes))

    def _remove_from_table(self, chunk_hash: bytes) -> bool:
        removed = remove_key(self.table, self.keys, self.salt, chunk_hash) != EMPTY
        self.in_table -= removed
        return removed

    def _fit_table(self, adding: int = 0) -> None:
        """A table at most half full once `adding` more entries are in."""
        size = len(self.table)
        while 2 * (self.in_table + adding) > size:
            size *= 2
        if size != len(self.table):
            table = _empty_table(size)
            rehash(self.table, table, self.keys, self.salt)
            self.table = table


class HashRows(Sequence):
    """Chunk hashes of one width as the rows of a uint64 array: a sequence of bytes that
    makes a bytes object only for a hash read (`block` gives them all at once)."""

    __slots__ = ("rows",)

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return HashRows(self.rows[i])
        return self.rows[i].tobytes()

    def __iter__(self) -> Iterator[bytes]:
        block, width = self.rows.tobytes(), self.rows.shape[1] * 8
        return (block[i:i + width] for i in range(0, len(block), width or 1))

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"HashRows({list(self)!r})"


def hash_block(chunk_hashes: Sequence[Hashable]) -> tuple[int, bytes] | None:
    """(width, the hashes concatenated) of chunk hashes that are bytes of one width;
    None for any other."""
    if not len(chunk_hashes):
        return 32, b""
    if isinstance(chunk_hashes, HashRows):
        return chunk_hashes.rows.shape[1] * 8, chunk_hashes.rows.tobytes()
    if set(map(type, chunk_hashes)) != {bytes} or len(set(map(len, chunk_hashes))) != 1:
        return None
    return len(chunk_hashes[0]), b"".join(chunk_hashes)


def _empty_table(size: int) -> np.ndarray:
    table = np.empty(size, dtype=np.int32)
    table.fill(EMPTY)
    return table


# --- kernels (hold the GIL: module doc) ------------------------------------------------

@njit(cache=True, inline="always")
def _home(words, salt, mask):
    """Where a key's search starts: its words mixed with the salt."""
    h = salt
    for j in range(words.shape[0]):
        h = (h ^ words[j]) * _M1
        h ^= h >> np.uint64(31)
    h ^= h >> np.uint64(32)
    h *= _M2
    h ^= h >> np.uint64(29)
    return np.int64(h & np.uint64(mask))


@njit(cache=True, inline="always")
def _probe(table, keys, salt, words):
    """The table index of the entry whose row is `words`; not there: -1 - the index of
    the empty entry that ended the search."""
    mask = table.shape[0] - 1
    i = _home(words, salt, mask)
    while True:
        slot = table[i]
        if slot == -1:
            return -1 - i
        if slot < keys.shape[0]:
            same = True
            for j in range(words.shape[0]):
                if keys[slot, j] != words[j]:
                    same = False
                    break
            if same:
                return i
        i = (i + 1) & mask


@njit(cache=True, inline="always")
def _words_of(key, count):
    """A chunk hash's bytes as `count` little-endian uint64 words (passing the bytes
    object itself spares the caller making an array: single-key calls are most of their
    cost in the call)."""
    words = np.empty(count, dtype=np.uint64)
    for j in range(count):
        word = np.uint64(0)
        for b in range(8):
            word |= np.uint64(key[8 * j + b]) << np.uint64(8 * b)
        words[j] = word
    return words


@njit(cache=True)
def find_one(table, keys, salt, key):
    """The slot whose row is chunk hash `key` (bytes of the column's width), or -1."""
    i = _probe(table, keys, salt, _words_of(key, keys.shape[1]))
    return np.int64(-1) if i < 0 else np.int64(table[i])


@njit(cache=True)
def find_many(table, keys, salt, rows):
    """`find_one` of each row."""
    found = np.empty(rows.shape[0], dtype=np.int64)
    for r in range(rows.shape[0]):
        i = _probe(table, keys, salt, rows[r])
        found[r] = -1 if i < 0 else table[i]
    return found


@njit(cache=True)
def insert_slots(table, keys, salt, slots):
    """Each slot into the table under its row (replacing the entry of that key);
    returns how many entries are new. The table must have room (at most half full)."""
    added = 0
    for s in slots:
        i = _probe(table, keys, salt, keys[s])
        if i < 0:
            i = -1 - i
            added += 1
        table[i] = s
    return added


@njit(cache=True)
def remove_key(table, keys, salt, key):
    """Remove the entry whose row is chunk hash `key` (later entries of its cluster
    shift back); returns its slot, or -1 when there is none."""
    i = _probe(table, keys, salt, _words_of(key, keys.shape[1]))
    if i < 0:
        return np.int64(-1)
    removed = np.int64(table[i])
    mask = table.shape[0] - 1
    j = i
    while True:
        j = (j + 1) & mask
        held = table[j]
        if held == -1:
            break
        home = _home(keys[held], salt, mask)
        # `held` may fill the hole at i when its home is not cyclically in (i, j].
        if (home <= i < j) or (i < j < home) or (j < home <= i):
            table[i] = held
            i = j
    table[i] = -1
    return removed


@njit(cache=True)
def rehash(old, table, keys, salt):
    """Every entry of `old` into `table` (empty, larger)."""
    mask = table.shape[0] - 1
    for entry in range(old.shape[0]):
        slot = old[entry]
        if slot == -1:
            continue
        i = _home(keys[slot], salt, mask)
        while table[i] != -1:
            i = (i + 1) & mask
        table[i] = slot


_warmed = False


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel here, once per process."""
    global _warmed
    if _warmed:
        return
    hashes = ChunkHashes()
    names = [bytes([i]) * 32 for i in range(12)]
    hashes.reserve(len(names))
    hashes.name_all(np.arange(len(names)), names)
    hashes.add_new(names, np.arange(len(names)))  # past half full: compiles `rehash`
    hashes.set(names[0], 0)
    hashes.known(names)
    hashes.get(names[1])
    hashes.delete(names[2])
    _warmed = True


__all__ = ["EMPTY", "ChunkHashes", "HashRows", "hash_block", "warm_up"]
