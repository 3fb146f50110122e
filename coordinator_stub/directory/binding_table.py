"""`BindingTable`: the directory's chunk hash -> binding map, with the common binding kept
in columns instead of a Python object per chunk (docs/DESIGN.md, "Key directory
internals": "Frozen bindings").

Contract: a mapping from chunk hash to binding tuple `(content, offset, holds, accesses,
reported)` (bindings.py) whose writes are journaled like a `JournaledDict`'s. Inside, a
binding lives in one of two places:
- `hot`, a `JournaledDict`: every binding a batch writes, and every shape but the common
  one;
- frozen columns indexed by the blend index's claim slot of the chunk (`ContentIndex.
  only_claim_slots`): a chunk stored once, indexed (a digest, an offset below 2^31), one
  key in one place, never accessed, nothing else reported. That is most of a directory,
  and costs 20 B a chunk there instead of ~170 B of dict entry, tuple and digest.
After a batch commits, `freeze` moves the common bindings it wrote to the columns; any
write to a frozen binding first moves it back to `hot` (`_thaw`). Both moves are not
journaled: they never change what the table says, so a rollback has nothing to undo.

Why slots are safe keys: the index changes a chunk's claims only when the directory tells
it to, and the directory rewrites a chunk's binding (thawing it) before it queues any
index update of that chunk, so a frozen binding's slot is its chunk's as long as it is
frozen. `f_chunk` names the chunk each frozen slot holds, so a slot the index freed and
gave to another chunk is never read as that chunk's.

Readers that skip the directory lock (`holds_of`, for lookups) read `hot` first, then the
columns, then `hot` again: a thaw writes `hot` before it clears the slot, so a binding
moving between the two is found in one of them.
"""

from __future__ import annotations

from collections import deque
from itertools import compress, repeat
from typing import Iterable, Iterator, Sequence

import numpy as np

from coordinator_stub.directory.journal import Journal, JournaledDict
from coordinator_stub.directory.new_chunks import shared_offset

_MISSING = object()
_NOTHING = ()
_MAX_FROZEN_OFFSET = 2**31 - 1


class BindingTable:
    """Chunk hash -> binding (module doc). Not thread-safe for writes (the directory
    lock); `get`, `holds_of` and `in` are safe to call without it."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        self.hot: JournaledDict = JournaledDict(journal)
        # The table iterates in the order bindings were created, as a dict would (the
        # key listing's order): `order` numbers the hot ones, `f_order` the frozen ones.
        self.order: JournaledDict = JournaledDict(journal)
        self.next_order = 0
        self.index = None  # the blend index whose claim slots key the columns
        self.f_chunk = np.empty(0, dtype=object)  # None: the slot holds no frozen binding
        self.f_digest = np.empty(0, dtype=np.int64)
        self.f_offset = np.empty(0, dtype=np.int32)
        self.f_key = np.empty(0, dtype=np.int32)
        self.f_place = np.empty(0, dtype=np.int32)
        self.f_order = np.empty(0, dtype=np.int64)
        self.num_frozen = 0

    # --- reads ------------------------------------------------------------------------

    def get(self, chunk_hash: bytes, default=None):
        binding = self.hot.get(chunk_hash, _MISSING)
        if binding is not _MISSING:
            return binding
        if self.num_frozen:
            slot = self._frozen_slot(chunk_hash)
            if slot >= 0:
                return self._frozen_binding(slot)
            return self.hot.get(chunk_hash, default)  # thawed meanwhile (module doc)
        return default

    def __getitem__(self, chunk_hash: bytes) -> tuple:
        binding = self.get(chunk_hash, _MISSING)
        if binding is _MISSING:
            raise KeyError(chunk_hash)
        return binding

    def __contains__(self, chunk_hash: bytes) -> bool:
        return self.get(chunk_hash, _MISSING) is not _MISSING

    def __len__(self) -> int:
        return len(self.hot) + self.num_frozen

    def __iter__(self) -> Iterator[bytes]:
        return iter([chunk_hash for chunk_hash, _ in self.items()])

    def keys(self) -> list[bytes]:
        return list(self)

    def items(self) -> list[tuple[bytes, tuple]]:
        """Every (chunk hash, binding), in the order the bindings were created."""
        slots = self._frozen_slots()
        rows = list(self.hot.items()) + list(zip(self.f_chunk[slots].tolist(),
                                                 map(self._frozen_binding, slots.tolist())))
        orders = np.concatenate([np.fromiter(map(self.order.__getitem__, self.hot),
                                             dtype=np.int64, count=len(self.hot)),
                                 self.f_order[slots]])
        return [rows[i] for i in np.argsort(orders, kind="stable").tolist()]

    def values(self) -> list[tuple]:
        return [binding for _, binding in self.items()]

    def isdisjoint(self, chunk_hashes: Sequence[bytes]) -> bool:
        """Whether none of `chunk_hashes` has a binding (a few C passes when none has)."""
        if not self.hot.keys().isdisjoint(chunk_hashes):
            return False
        if not self.num_frozen:
            return True
        return not any(slot >= 0 for slot in self._frozen_slots_of(chunk_hashes))

    def holds_of(self, chunk_hashes: Sequence[bytes], default: tuple) -> list:
        """Each chunk's `holds` (its binding's third field; `default[2]` for a chunk with
        none), read without the directory lock: C maps over `hot`, then the frozen
        columns for the chunks `hot` lacks, in bulk."""
        bindings = list(map(self.hot.get, chunk_hashes, repeat(default)))
        holds = [binding[2] for binding in bindings]
        if not self.num_frozen:
            return holds
        missing = [i for i, binding in enumerate(bindings) if binding is default]
        if not missing:
            return holds
        slots = self._frozen_slots_of([chunk_hashes[i] for i in missing])
        keys, places = self.f_key, self.f_place
        for i, slot in zip(missing, slots):
            if slot >= 0:
                holds[i] = (int(keys[slot]), int(places[slot]))
            else:  # thawed meanwhile, or held nowhere
                holds[i] = self.hot.get(chunk_hashes[i], default)[2]
        return holds

    def _frozen_slot(self, chunk_hash: bytes) -> int:
        return self._frozen_slots_of((chunk_hash,))[0]

    def _frozen_slots_of(self, chunk_hashes: Sequence[bytes]) -> list[int]:
        """Each chunk's frozen slot, or -1."""
        index = self.index
        if index is None:
            return [-1] * len(chunk_hashes)
        slots = index.only_claim_slots(chunk_hashes)
        f_chunk, size = self.f_chunk, len(self.f_chunk)
        return [slot if 0 <= slot < size and f_chunk[slot] == chunk_hash else -1
                for slot, chunk_hash in zip(slots, chunk_hashes)]

    def _frozen_slots(self) -> np.ndarray:
        if not self.num_frozen:
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(self.f_chunk != None)  # noqa: E711 - elementwise

    def _frozen_binding(self, slot: int) -> tuple:
        return (int(self.f_digest[slot]), shared_offset(int(self.f_offset[slot])),
                (int(self.f_key[slot]), int(self.f_place[slot])), _NOTHING, None)

    # --- writes (journaled, as a JournaledDict's) -------------------------------------

    def __setitem__(self, chunk_hash: bytes, binding: tuple) -> None:
        hot = self.hot
        if chunk_hash not in hot and not (self.num_frozen and self._thaw(chunk_hash)):
            self._journal.note(self, "next_order")
            self.order[chunk_hash] = self.next_order
            self.next_order += 1
        hot[chunk_hash] = binding

    def __delitem__(self, chunk_hash: bytes) -> None:
        if self.num_frozen and chunk_hash not in self.hot:
            self._thaw(chunk_hash)
        del self.hot[chunk_hash]
        del self.order[chunk_hash]

    def insert_absent(self, chunk_hashes: list[bytes], bindings: Iterable[tuple]) -> None:
        """`JournaledDict.insert_absent`: ValueError, nothing changed, if any is here."""
        if self.num_frozen and not self.isdisjoint(chunk_hashes):
            raise ValueError("insert_absent: some keys are present")
        self.hot.insert_absent(chunk_hashes, bindings)
        first = self.next_order
        self.order.insert_absent(chunk_hashes, range(first, first + len(chunk_hashes)))
        self._journal.note(self, "next_order")
        self.next_order = first + len(chunk_hashes)

    def _thaw(self, chunk_hash: bytes) -> bool:
        """A frozen binding back to `hot`, as it is (not journaled: nothing changes);
        False if it was not frozen."""
        slot = self._frozen_slot(chunk_hash)
        if slot < 0:
            return False
        dict.__setitem__(self.hot, chunk_hash, self._frozen_binding(slot))
        dict.__setitem__(self.order, chunk_hash, int(self.f_order[slot]))
        self.f_chunk[slot] = None
        self.num_frozen -= 1
        return True

    # --- moving common bindings to the columns ----------------------------------------

    def freeze(self, chunk_hashes: Iterable[bytes]) -> None:
        """Move the common bindings among `chunk_hashes` (module doc) from `hot` to the
        columns. Call outside a batch (after it commits and its index updates are sent):
        not journaled. Bindings kept in other shapes stay where they are."""
        if self.index is None:
            return
        hot = self.hot
        hashes = [chunk_hash for chunk_hash in chunk_hashes
                  if _common(hot.get(chunk_hash))]
        if not hashes:
            return
        slots = self.index.only_claim_slots(hashes)
        kept = [slot >= 0 for slot in slots]
        hashes, slots = list(compress(hashes, kept)), list(compress(slots, kept))
        if not slots:
            return
        bindings = list(map(hot.__getitem__, hashes))
        self._make_room(max(slots) + 1)
        at = np.array(slots, dtype=np.int64)
        self.f_digest[at] = [binding[0] for binding in bindings]
        self.f_offset[at] = [binding[1] for binding in bindings]
        self.f_key[at] = [binding[2][0] for binding in bindings]
        self.f_place[at] = [binding[2][1] for binding in bindings]
        self.f_order[at] = list(map(self.order.__getitem__, hashes))
        chunks = np.empty(len(hashes), dtype=object)
        chunks[:] = hashes
        self.f_chunk[at] = chunks  # last: the slots are readable as frozen from now on
        deque(map(dict.__delitem__, repeat(hot), hashes), maxlen=0)
        deque(map(dict.__delitem__, repeat(self.order), hashes), maxlen=0)
        self.num_frozen += len(hashes)

    def _make_room(self, size: int) -> None:
        if size <= len(self.f_chunk):
            return
        size = max(size, len(self.f_chunk) * 5 // 4, 1024)  # copies: O(1) a chunk
        grown = len(self.f_chunk)
        for name in ("f_digest", "f_offset", "f_key", "f_place", "f_order", "f_chunk"):
            old = getattr(self, name)
            new = np.zeros(size, dtype=old.dtype) if name != "f_chunk" else np.full(
                size, None, dtype=object)
            new[:grown] = old
            setattr(self, name, new)

    def use_index(self, index) -> None:
        """Key the columns by `index`'s claim slots from now on (blend lookup turned on,
        another chunk size): every binding frozen by the old one's goes back to `hot`."""
        for chunk_hash in self.f_chunk[self._frozen_slots()].tolist():
            self._thaw(chunk_hash)
        self.index = index


def _common(binding) -> bool:
    """Whether a binding has the shape the columns keep (module doc)."""
    return (binding is not None and type(binding[0]) is int
            and 0 <= binding[1] <= _MAX_FROZEN_OFFSET and type(binding[2]) is tuple
            and len(binding[2]) == 2 and binding[3] == () and binding[4] is None)


__all__ = ["BindingTable"]
