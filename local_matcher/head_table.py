"""The heads of the claim lists that are not their content's first, as a table kernels read.

Most contents are claimed by one namespace: `ClaimLists.head[cid]` is its list's head. A
content several namespaces claim has one list each; the heads of all but the one in
`head[cid]` live here, keyed ``ns_id << 32 | cid`` (docs/DESIGN.md, "The content index").
A lookup reads them inside its kernel (`other_head`), so a request whose contents other
tenants share costs no Python per content; the claim lists write them from Python one at a
time (a list starts, moves its head or ends).

Open addressing with linear probing in two flat arrays (`keys`, -1: empty; `slots`); a
key's home is the top bits of ``key * _GOLDEN`` (mod 2**64), the same arithmetic in
`HeadTable` and in `other_head`. Removal shifts later entries back, so there are no
tombstones; the table doubles past half full (`rehash`, a kernel). Not thread-safe: the
content index's lock covers it.
"""

from __future__ import annotations

import sys
from array import array

import numpy as np
from numba import njit

NONE = -1
_GOLDEN = 0x9E3779B97F4A7C15
_GOLDEN_U64 = np.uint64(_GOLDEN)
_MASK64 = (1 << 64) - 1
_MIN_BITS = 3


class HeadTable:
    """{ns_id << 32 | cid: head slot} in open addressing (module doc)."""

    def __init__(self, bits: int = _MIN_BITS) -> None:
        self.keys = array("q", [NONE]) * (1 << bits)
        self.slots = array("i", [NONE]) * (1 << bits)
        self.shift = 64 - bits  # a key's home: the top `bits` bits of its product
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def _home(self, key: int) -> int:
        return ((key * _GOLDEN) & _MASK64) >> self.shift

    def get(self, key: int) -> int:
        """The head slot under `key`, or NONE."""
        keys, mask = self.keys, len(self.keys) - 1
        i = self._home(key)
        while True:
            held = keys[i]
            if held == key:
                return self.slots[i]
            if held == NONE:
                return NONE
            i = (i + 1) & mask

    def set(self, key: int, slot: int) -> None:
        """`slot` under `key` (added or replaced)."""
        keys, mask = self.keys, len(self.keys) - 1
        i = self._home(key)
        while True:
            held = keys[i]
            if held == key:
                self.slots[i] = slot
                return
            if held == NONE:
                break
            i = (i + 1) & mask
        keys[i] = key
        self.slots[i] = slot
        self.size += 1
        if 2 * self.size > len(keys):
            self._grow()

    def delete(self, key: int) -> None:
        """Remove `key` (KeyError if it is not there): later entries of its cluster shift
        back."""
        keys, slots, mask = self.keys, self.slots, len(self.keys) - 1
        i = self._home(key)
        while keys[i] != key:
            if keys[i] == NONE:
                raise KeyError(key)
            i = (i + 1) & mask
        j = i
        while True:
            j = (j + 1) & mask
            held = keys[j]
            if held == NONE:
                break
            home = self._home(held)
            # `held` may fill the hole at i when its home is not cyclically in (i, j].
            if (home <= i < j) or (i < j < home) or (j < home <= i):
                keys[i], slots[i] = held, slots[j]
                i = j
        keys[i], slots[i] = NONE, NONE
        self.size -= 1

    def items(self) -> list[tuple[int, int]]:
        """Every (key, slot), in table order (for tests and inspection)."""
        return [(key, slot) for key, slot in zip(self.keys, self.slots) if key != NONE]

    @property
    def for_kernels(self) -> tuple:
        """(keys, slots, shift): what `other_head` and `heads_of` take."""
        return self.keys, self.slots, np.uint64(self.shift)

    def nbytes(self) -> int:
        return sys.getsizeof(self.keys) + sys.getsizeof(self.slots)

    def _grow(self) -> None:
        bits = 64 - self.shift + 1
        keys = array("q", [NONE]) * (1 << bits)
        slots = array("i", [NONE]) * (1 << bits)
        rehash(self.keys, self.slots, keys, slots, np.uint64(64 - bits))
        self.keys, self.slots, self.shift = keys, slots, 64 - bits


@njit(cache=True, inline="always")
def other_head(keys, slots, shift, key):
    """`HeadTable.get` for kernels: the head slot under `key` (an int64), or -1."""
    mask = len(keys) - 1
    i = (np.uint64(key) * _GOLDEN_U64) >> shift
    while True:
        held = keys[i]
        if held == key:
            return np.int64(slots[i])
        if held == -1:
            return np.int64(-1)
        i = (i + np.uint64(1)) & np.uint64(mask)


@njit(cache=True)
def rehash(old_keys, old_slots, keys, slots, shift):
    """Every entry of the old arrays into the new (empty) ones."""
    mask = np.uint64(len(keys) - 1)
    for j in range(len(old_keys)):
        key = old_keys[j]
        if key == -1:
            continue
        i = (np.uint64(key) * _GOLDEN_U64) >> shift
        while keys[i] != -1:
            i = (i + np.uint64(1)) & mask
        keys[i] = key
        slots[i] = old_slots[j]


@njit(cache=True, nogil=True)
def heads_of(cids, ns_id, head, slot_ns, other_keys, other_slots, other_shift):
    """Per content id, the head slot of namespace `ns_id`'s list on it (-1: none)."""
    heads = np.empty(cids.shape[0], dtype=np.int64)
    for i in range(cids.shape[0]):
        cid = cids[i]
        slot = head[cid]
        if slot == -1 or slot_ns[slot] != ns_id:
            slot = other_head(other_keys, other_slots, other_shift,
                              (np.int64(ns_id) << 32) | cid)
        heads[i] = slot
    return heads


__all__ = ["HeadTable", "heads_of", "other_head", "rehash"]
