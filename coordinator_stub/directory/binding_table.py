"""`BindingTable`: the directory's chunk hash -> binding map, with the common binding kept
in columns instead of Python objects per chunk (docs/DESIGN.md, "Key directory
internals", its frozen bindings).

Contract: a mapping from chunk hash to binding tuple `(content, offset, holds, accesses,
reported)` (bindings.py), iterated in creation order, whose writes are journaled like a
`JournaledDict`'s. Inside, a binding lives in one of two places:
- `hot`, a `JournaledDict`: every binding a batch writes, and every shape but the common
  one;
- columns indexed by the blend index's claim slot of the chunk (`ContentIndex.
  only_claim_slots`): a chunk stored once, indexed (a digest, an offset: its claim's), one
  key in one place and that key's access count, nothing else reported. That is most of a
  directory, and costs ~28 B a chunk there instead of ~170 B of dict entry, tuple and
  digest, and ~40 B of its instance's `held_by` set entry: a frozen binding is counted
  per instance instead (`frozen_of`), and thawed (into the set) before a step reads the
  set for it (`thaw` before a DELETE, `thaw_instance` before a fence). Its offset is not
  kept: it is its claim's stored offset (`ContentIndex.claim_offsets`), the same number
  by the directory's invariant (bindings.py); a binding whose claim says otherwise (an
  index a failed repair left behind) stays in `hot`.
After a batch commits, `freeze` moves the common bindings it wrote to the columns (a bulk
run's straight from what `insert_run` was given); a write that changes a frozen binding
first moves it back to `hot` (`_thaw`), one that writes it unchanged leaves it frozen,
and an ACCESS changes its count in the column (journaled).
Neither move changes what the table says, so neither is journaled: a rollback has
nothing to undo.

Why slots are safe keys: the index changes a chunk's claims only when the directory tells
it to, and the directory rewrites a chunk's binding (thawing it) before it queues any
index update of that chunk, so a frozen binding's slot is its chunk's only claim, at its
offset, as long as it is frozen, and a slot's flag is cleared before the index can free
the slot or move its claim.

Creation numbers (`order`, `f_order`) are int32 and only compared; new ones come from
`next_order`. When a batch begins that could take it past `_MAX_ORDER` (one number per
entry at most), every number is replaced by its rank (`_renumber`): the iteration order
is the same, so nothing the table says changes, and nothing is journaled; the batch's
own writes, journaled after it, are undone into the renumbered table.

Readers that skip the directory lock (`hold_codes`, for lookups) read the flags and columns,
then `hot`, then the flags again: a thaw writes `hot` before it clears the flag, and a
freeze sets the flag before it leaves `hot`, so a binding moving between the two is found
in one of them. A lookup's slots may be stale by the time it reads (a hint, as before).
A `get` without the lock of a binding a batch is moving may pair its old fields with the
claim's new offset once the batch's index updates are sent (no lookup reads offsets).
"""

from __future__ import annotations

from collections import deque
from itertools import chain, compress, count, repeat
from operator import is_, itemgetter
from typing import Iterable, Iterator, Sequence

import numpy as np

from coordinator_stub.directory.journal import Journal, JournaledDict, JournaledSet
from coordinator_stub.directory.new_chunks import shared_offset

_MISSING = object()
_NOTHING = ()
_MAX_FROZEN_COUNT = 2**31 - 1
_MAX_ORDER = 2**31 - 1  # creation numbers are int32 (module doc); tests lower it


class BindingTable:
    """Chunk hash -> binding (module doc). Not thread-safe for writes (the directory
    lock); `get` (module doc), `hold_codes` and `in` are safe to call without it."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        self.hot: JournaledDict = JournaledDict(journal)
        # The table iterates in the order bindings were created, as a dict would (the
        # key listing's order): `order` numbers the hot ones, `f_order` the frozen ones.
        self.order: JournaledDict = JournaledDict(journal)
        self.next_order = 0
        self.index = None  # the blend index whose claim slots key the columns
        self.f_frozen = np.empty(0, dtype=np.uint8)  # 1: the slot's binding is frozen
        self.f_digest = np.empty(0, dtype=np.int64)  # (the offset is the claim's)
        self.f_key = np.empty(0, dtype=np.int32)
        self.f_place = np.empty(0, dtype=np.int32)
        self.f_order = np.empty(0, dtype=np.int32)
        self.f_accesses = np.empty(0, dtype=np.int32)  # the one key's access count
        self.num_frozen = 0
        self._runs: list[tuple] = []  # the bulk runs of the batch being applied
        # The chunks each instance holds (the directory's `held_by`) list hot bindings
        # only: a frozen one is counted per instance of its place (`instance_of`).
        self.held_by: dict[str, set[bytes]] = {}
        self.instance_of = None  # place number -> instance id (the directory's)
        self.frozen_of: dict[str, int] = {}

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
        rows = list(self.hot.items()) + list(zip(self.index.chunks_at(slots) if slots else (),
                                                 map(self._frozen_binding, slots)))
        orders = np.concatenate([np.fromiter(map(self.order.get, self.hot,
                                                 repeat(self.next_order)),
                                             dtype=np.int64, count=len(self.hot)),
                                 self.f_order[slots]])
        return [rows[i] for i in np.argsort(orders, kind="stable").tolist()]

    def in_creation_order(self, chunk_hashes: Iterable[bytes]) -> list[bytes]:
        """`chunk_hashes` of hot bindings in the order the bindings were created (any
        without one last)."""
        order, last = self.order, self.next_order
        return sorted(chunk_hashes, key=lambda chunk_hash: order.get(chunk_hash, last))

    def values(self) -> list[tuple]:
        return [binding for _, binding in self.items()]

    def present(self, chunk_hashes: Sequence[bytes]) -> list[int]:
        """The positions of the chunks that have a binding (C passes over `hot`, then
        one bulk read of the columns)."""
        hot = self.hot
        found = []
        if not hot.keys().isdisjoint(chunk_hashes):
            found = list(compress(count(), map(hot.__contains__, chunk_hashes)))
        if self.num_frozen:
            slots = self._frozen_slots_of(chunk_hashes)
            if max(slots, default=-1) >= 0:
                found = sorted(set(found).union(compress(count(), map((-1).__lt__, slots))))
        return found

    def hold_codes(self, chunk_hashes: Sequence[bytes], default: tuple,
                   slots: np.ndarray | None = None) -> tuple[np.ndarray, list]:
        """Each chunk's `holds` (its binding's third field; `default[2]` for a chunk with
        none) as a number, read without the directory lock: ``key << 32 | place`` for one
        key held in one place (every frozen binding: read from the columns), else
        ``-1 - i`` for `records[i]`, the other records in order of first mention (tuples
        by value, a many-keys record by identity). Returns (codes, records). `slots`: the
        chunks' claim slots as a lookup found them (`CandidateColumns.slots`), which
        spares reading the index per chunk."""
        codes = np.empty(len(chunk_hashes), dtype=np.int64)
        hot = None
        if self.num_frozen:
            if slots is None:
                slots = np.array(self._index_slots(chunk_hashes), dtype=np.int64)
            frozen = self._frozen_at(slots) == 1
            at = slots[frozen]
            codes[frozen] = (self.f_key[at].astype(np.int64) << 32) | self.f_place[at]
            hot = np.flatnonzero(~frozen)
            if not hot.size:
                return codes, []
        hashes = chunk_hashes if hot is None else [chunk_hashes[i] for i in hot.tolist()]
        holds = list(map(_HOLDS, map(self.hot.get, hashes, repeat(default))))
        if hot is not None:
            for j in compress(count(), map(is_, holds, repeat(default[2]))):  # frozen since?
                slot = self._frozen_slot(hashes[j])
                if slot >= 0:
                    holds[j] = (int(self.f_key[slot]), int(self.f_place[slot]))
        coded, records = _coded(holds)
        codes[slice(None) if hot is None else hot] = coded
        return codes, records

    def _index_slots(self, chunk_hashes: Sequence[bytes]) -> list[int]:
        index = self.index
        return [-1] * len(chunk_hashes) if index is None else index.only_claim_slots(
            chunk_hashes)

    def _frozen_at(self, slots: np.ndarray) -> np.ndarray:
        """Per slot (-1: none), 1 if a frozen binding is there."""
        flags = self.f_frozen
        inside = (slots >= 0) & (slots < len(flags))
        if inside.all():
            return flags[slots]
        frozen = np.zeros(len(slots), dtype=np.uint8)
        frozen[inside] = flags[slots[inside]]
        return frozen

    def _frozen_slot(self, chunk_hash: bytes) -> int:
        """The chunk's frozen slot, or -1."""
        index = self.index
        if index is None:
            return -1
        slot = index.only_claim_slot(chunk_hash)
        return slot if 0 <= slot < len(self.f_frozen) and self.f_frozen[slot] else -1

    def _frozen_slots_of(self, chunk_hashes: Sequence[bytes]) -> list[int]:
        """Each chunk's frozen slot, or -1."""
        slots = np.array(self._index_slots(chunk_hashes), dtype=np.int64)
        return np.where(self._frozen_at(slots) == 1, slots, -1).tolist()

    def _frozen_slots(self) -> list[int]:
        if not self.num_frozen:
            return []
        return np.flatnonzero(self.f_frozen).tolist()

    def _frozen_binding(self, slot: int) -> tuple:
        key, accesses = int(self.f_key[slot]), int(self.f_accesses[slot])
        return (int(self.f_digest[slot]), shared_offset(self.index.claim_offset(slot)),
                (key, int(self.f_place[slot])), (key, accesses) if accesses else _NOTHING,
                None)

    # --- writes (journaled, as a JournaledDict's) -------------------------------------

    def __setitem__(self, chunk_hash: bytes, binding: tuple) -> None:
        hot = self.hot
        if chunk_hash not in hot:
            slot = self._frozen_slot(chunk_hash) if self.num_frozen else -1
            if slot >= 0:
                frozen = self._frozen_binding(slot)
                if binding == frozen:
                    return  # the same again (a chunk re-stored where it was): stays frozen
                if binding[:3] == frozen[:3] and binding[4] is None and _counted(binding):
                    self._count_accesses(slot, binding[3][1] if binding[3] else 0)
                    return  # an ACCESS: stays frozen
                self._thaw_slot(chunk_hash, slot)
            else:
                self.order[chunk_hash] = self._new_numbers(1)
        hot[chunk_hash] = binding

    def _count_accesses(self, slot: int, accesses: int) -> None:
        """A frozen binding's access count changes, journaled (its slot stays its own
        until the batch is done: nothing else of the chunk changed)."""
        self._journal.record(_undo_accesses, self, slot, int(self.f_accesses[slot]))
        self.f_accesses[slot] = accesses

    def __delitem__(self, chunk_hash: bytes) -> None:
        if self.num_frozen and chunk_hash not in self.hot:
            self._thaw(chunk_hash)
        del self.hot[chunk_hash]
        self.order.pop(chunk_hash, None)  # a run's chunk has no number there yet

    def insert_absent(self, chunk_hashes: list[bytes], bindings: Iterable[tuple]) -> None:
        """`JournaledDict.insert_absent`: ValueError, nothing changed, if any is here."""
        if self.num_frozen and self.present(chunk_hashes):
            raise ValueError("insert_absent: some keys are present")
        self.hot.insert_absent(chunk_hashes, bindings)
        first = self._new_numbers(len(chunk_hashes))
        self.order.insert_absent(chunk_hashes, range(first, first + len(chunk_hashes)))

    def _new_numbers(self, count: int) -> int:
        """The first of `count` new creation numbers (journaled; `begin` made room)."""
        if self.next_order + count > _MAX_ORDER:  # not reached: at most one an entry
            raise OverflowError("more new bindings in a batch than it has entries")
        self._journal.note(self, "next_order")
        self.next_order += count
        return self.next_order - count

    def _thaw(self, chunk_hash: bytes) -> bool:
        """A frozen binding back to `hot`, as it is (not journaled: nothing changes);
        False if it was not frozen."""
        slot = self._frozen_slot(chunk_hash)
        if slot < 0:
            return False
        self._thaw_slot(chunk_hash, slot)
        return True

    def _thaw_slot(self, chunk_hash: bytes, slot: int) -> None:
        dict.__setitem__(self.hot, chunk_hash, self._frozen_binding(slot))
        dict.__setitem__(self.order, chunk_hash, int(self.f_order[slot]))
        instance = self.instance_of(int(self.f_place[slot]))
        set.add(self._held(instance), chunk_hash)
        self._count_frozen(instance, -1)
        self.f_frozen[slot] = 0
        self.num_frozen -= 1

    def thaw(self, chunk_hash: bytes) -> None:
        """The binding back to `hot` (and its chunk to its instance's `held_by`), if
        frozen: before a step that reads `held_by` for it (a DELETE)."""
        if self.num_frozen and chunk_hash not in self.hot:
            self._thaw(chunk_hash)

    def thaw_instance(self, instance_id: str) -> None:
        """Every frozen binding placed at `instance_id` back to `hot` (before a fence):
        one pass over the place column, O(frozen bindings)."""
        slots = self._frozen_slots_at(instance_id)
        for chunk_hash, slot in zip(self.index.chunks_at(slots) if slots else (), slots):
            self._thaw_slot(chunk_hash, slot)

    def frozen_chunks_of(self, instance_id: str) -> Sequence[bytes]:
        """The chunks of the frozen bindings placed at `instance_id` (inspection)."""
        slots = self._frozen_slots_at(instance_id)
        return self.index.chunks_at(slots) if slots else []

    def _frozen_slots_at(self, instance_id: str) -> list[int]:
        if not self.frozen_of.get(instance_id):
            return []
        slots = np.flatnonzero(self.f_frozen)
        places = self.f_place[slots]
        mine = [p for p in np.unique(places).tolist() if self.instance_of(p) == instance_id]
        return slots[np.isin(places, mine)].tolist()

    def _held(self, instance_id: str) -> set[bytes]:
        held = self.held_by.get(instance_id)
        if held is None:  # not journaled: a thaw changes nothing a rollback should undo
            held = JournaledSet(self._journal)
            dict.__setitem__(self.held_by, instance_id, held)
        return held

    def _count_frozen(self, instance_id: str, delta: int) -> None:
        count = self.frozen_of.get(instance_id, 0) + delta
        if count:
            self.frozen_of[instance_id] = count
        else:
            del self.frozen_of[instance_id]

    # --- moving common bindings to the columns ----------------------------------------

    def begin(self, entries: int) -> None:
        """A batch of `entries` starts: room for as many creation numbers (module doc),
        and the runs it inserts are remembered for `freeze`."""
        self._runs = []
        if self.next_order + entries > _MAX_ORDER:
            _renumber(self)

    def insert_run(self, chunk_hashes: list[bytes], contents: list, offsets: list[int],
                   positions: np.ndarray, holds: tuple) -> None:
        """`insert_absent` of a bulk run's bindings `(content, offset, holds, (), None)`
        (`positions`: the offsets as an int64 array), remembered so that `freeze` takes
        them in bulk; their creation numbers are kept with the run, not in `order`, until
        then. The caller (`new_chunks.store_runs`) found none of them here."""
        self.hot.insert_absent(chunk_hashes, zip(contents, offsets, repeat(holds),
                                                 repeat(()), repeat(None)))
        first = self._new_numbers(len(chunk_hashes))
        self._runs.append((chunk_hashes, contents, positions, holds, first))

    def freeze(self, written: set[bytes]) -> None:
        """After a batch committed (and its index updates were sent): move the common
        bindings it wrote (module doc) from `hot` to the columns, its runs (`insert_run`)
        in bulk, what it wrote one by one (`written`) tested each. Not journaled."""
        runs, self._runs = self._runs, []
        if not all(map(written.isdisjoint, map(_HASHES, runs))):  # changed again: rare
            for run in runs:
                if not written.isdisjoint(run[0]):
                    self._number(run)
                    written.update(run[0])
            runs = [run for run in runs if written.isdisjoint(run[0])]
        if runs and self.index is not None:
            self._freeze_runs(runs)
        else:
            deque(map(self._number, runs), maxlen=0)
        if written and self.index is not None:
            self._freeze_each(written)

    def _number(self, run: tuple) -> None:
        """A run's chunks still in `hot` take their creation numbers into `order` (but a
        chunk the batch deleted and stored again, numbered then) and join their
        instance's `held_by` (`insert_run` left both to `freeze`)."""
        hashes, first, order = run[0], run[4], self.order
        left = [i for i, chunk_hash in enumerate(hashes) if chunk_hash in self.hot]
        dict.update(order, ((hashes[i], first + i) for i in left if hashes[i] not in order))
        if left:
            set.update(self._held(self.instance_of(run[3][1])), [hashes[i] for i in left])

    def _freeze_runs(self, runs: list[tuple]) -> None:
        """`freeze` of bulk runs, all at once: the columns come from what `insert_run`
        was given (one key, one place, consecutive creation numbers per run)."""
        hashes = list(chain.from_iterable(map(_HASHES, runs)))
        sizes = np.array([len(run[0]) for run in runs], dtype=np.int64)
        slots = np.array(self.index.only_claim_slots(hashes), dtype=np.int64)
        offsets = np.concatenate([run[2] for run in runs])
        kept = _at_claim(self.index, slots, offsets)
        firsts = np.array([run[4] for run in runs], dtype=np.int64)
        orders = np.repeat(firsts - np.cumsum(sizes) + sizes, sizes) + np.arange(len(kept))
        contents = list(chain.from_iterable(run[1] for run in runs))
        if not kept.all():  # these stay in `hot`
            left = ~kept
            dict.update(self.order, zip(compress(hashes, left), orders[left].tolist()))
            places = np.repeat(np.array([run[3][1] for run in runs], dtype=np.int64), sizes)
            for place, chunk_hash in zip(places[left].tolist(), compress(hashes, left)):
                set.add(self._held(self.instance_of(place)), chunk_hash)
            hashes, contents = list(compress(hashes, kept)), list(compress(contents, kept))
        keys, places = (np.repeat(np.array([run[3][k] for run in runs], dtype=np.int32),
                                  sizes)[kept] for k in (0, 1))
        self._put(slots[kept], hashes, np.array(contents, dtype=np.int64), keys, places,
                  orders[kept], numbered=False)

    def _freeze_each(self, chunk_hashes: set[bytes]) -> None:
        """`freeze` of bindings written one by one: their shapes tested."""
        hot = self.hot
        hashes = list(filter(hot.__contains__, chunk_hashes))
        bindings = list(map(hot.__getitem__, hashes))
        if not bindings:
            return
        common = _common(bindings)
        hashes, bindings = list(compress(hashes, common)), list(compress(bindings, common))
        slots = np.array(self.index.only_claim_slots(hashes), dtype=np.int64)
        kept = _at_claim(self.index, slots, np.fromiter(map(_OFFSET, bindings), np.int64,
                                                        len(bindings)))
        hashes, bindings = list(compress(hashes, kept)), list(compress(bindings, kept))
        n = len(hashes)
        holds = np.fromiter(chain.from_iterable(map(_HOLDS, bindings)), dtype=np.int32,
                            count=2 * n)
        self._put(slots[kept], hashes, np.fromiter(map(_CONTENT, bindings), np.int64, n),
                  holds[0::2], holds[1::2],
                  np.fromiter(map(self.order.__getitem__, hashes), np.int64, n),
                  np.array([b[3][1] if b[3] else 0 for b in bindings], dtype=np.int32))

    def _put(self, slots: np.ndarray, hashes: list[bytes], digests: np.ndarray,
             keys: np.ndarray, places: np.ndarray, orders: np.ndarray,
             accesses: np.ndarray | int = 0, numbered: bool = True) -> None:
        """Bindings (all in `hot`, at their claims' offsets) into the columns at their
        slots, and out of `hot` (and out of `order`, unless a run's, never `numbered`)."""
        if not len(hashes):
            return
        self._make_room(int(slots.max()) + 1)
        self.f_digest[slots] = digests
        self.f_key[slots], self.f_place[slots], self.f_order[slots] = keys, places, orders
        self.f_accesses[slots] = accesses
        self.f_frozen[slots] = 1  # last: the slots are readable as frozen from now on
        deque(map(dict.__delitem__, repeat(self.hot), hashes), maxlen=0)
        if numbered:
            deque(map(dict.__delitem__, repeat(self.order), hashes), maxlen=0)
        self.num_frozen += len(hashes)
        # Counted per instance; a run's chunks were never in its `held_by`, others leave.
        distinct, counts = np.unique(places, return_counts=True)
        for place, count in zip(distinct.tolist(), counts.tolist()):
            self._count_frozen(self.instance_of(place), count)
        if numbered:
            for place, chunk_hash in zip(places.tolist(), hashes):
                held = self.held_by.get(self.instance_of(place))
                if held is not None:
                    set.discard(held, chunk_hash)

    def _make_room(self, size: int) -> None:
        grown = len(self.f_frozen)
        if size <= grown:
            return
        size = max(size, grown * 5 // 4, 1024)  # copies: O(1) a chunk
        for name in ("f_digest", "f_key", "f_place", "f_order", "f_accesses", "f_frozen"):
            old = getattr(self, name)  # the flags last: the columns are there before
            new = np.zeros(size, dtype=old.dtype)
            new[:grown] = old
            setattr(self, name, new)

    def use_index(self, index) -> None:
        """Key the columns by `index`'s claim slots from now on (blend lookup turned on,
        another chunk size): every binding frozen by the old one's goes back to `hot`."""
        slots = self._frozen_slots()
        for chunk_hash in (self.index.chunks_at(slots) if slots else ()):
            self._thaw(chunk_hash)
        self.index = index


_CONTENT, _OFFSET, _HOLDS, _ACCESSES, _REPORTED = map(itemgetter, range(5))


def _coded(holds: list) -> tuple[np.ndarray, list]:
    """`BindingTable.hold_codes` of records read from `hot`: each distinct record (found
    by a C map) coded once."""
    first_of: dict = {}
    first = np.fromiter(map(first_of.setdefault, holds, count()), dtype=np.int64,
                        count=len(holds))
    records, coded = [], np.empty(len(holds), dtype=np.int64)
    for record, at_first in first_of.items():
        if type(record) is tuple and len(record) == 2 and _codable(*record):
            coded[at_first] = (record[0] << 32) | record[1]
        else:
            coded[at_first] = -1 - len(records)
            records.append(record)
    return coded[first], records


def _codable(key_no, place_no) -> bool:
    """Whether `hold_codes` can say (key_no, place_no) as one number."""
    return type(key_no) is int and type(place_no) is int and 0 <= key_no < 2**31 \
        and 0 <= place_no < 2**32
_HASHES = itemgetter(0)  # of a run


def _common(bindings: list[tuple]) -> list[bool]:
    """Per binding, whether it has the shape the columns keep (module doc): C passes, and
    a Python test each only for a field some binding has in another shape."""
    n = len(bindings)
    holds = list(map(_HOLDS, bindings))
    if set(map(type, holds)) != {tuple}:  # a chunk with many keys: rare
        return [type(b[0]) is int and b[1] >= 0
                and type(b[2]) is tuple and len(b[2]) == 2 and _counted(b) and b[4] is None
                for b in bindings]
    offsets = np.fromiter(map(_OFFSET, bindings), dtype=np.int64, count=n)
    common = (offsets >= 0) & (np.fromiter(map(len, holds), dtype=np.int64, count=n) == 2)
    contents = list(map(_CONTENT, bindings))
    if set(map(type, contents)) != {int}:
        common &= np.array([type(content) is int for content in contents], dtype=bool)
    accesses = list(map(_ACCESSES, bindings))
    if set(map(type, accesses)) != {tuple} or set(accesses) != {()}:
        common &= np.array(list(map(_counted, bindings)), dtype=bool)
    reported = list(map(_REPORTED, bindings))
    if set(map(type, reported)) != {type(None)}:
        common &= np.array([value is None for value in reported], dtype=bool)
    return common.tolist()


def _counted(binding: tuple) -> bool:
    """Whether a binding's access counts fit the columns: none, or its one key's."""
    accesses = binding[3]
    return accesses == () or (type(accesses) is tuple and len(accesses) == 2
                              and type(binding[2]) is tuple and accesses[0] == binding[2][0]
                              and accesses[1] <= _MAX_FROZEN_COUNT)


def _at_claim(index, slots: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per binding, whether its chunk has one claim (its slot; -1: not) and that claim is
    at the binding's offset, which the columns then read back (module doc)."""
    kept = slots >= 0
    kept[kept] = index.claim_offsets(slots[kept]) == offsets[kept]
    return kept


def _renumber(table: BindingTable) -> None:
    """Creation numbers by rank (module doc), hot and frozen alike, so `next_order` starts
    again at the count of bindings. Between batches only (`begin`): no run is pending.
    Not journaled: the table iterates as before."""
    slots, hashes = np.flatnonzero(table.f_frozen), list(table.order)
    numbers = np.concatenate([np.fromiter(table.order.values(), dtype=np.int64,
                                          count=len(hashes)), table.f_order[slots]])
    distinct, ranks = np.unique(numbers, return_inverse=True)
    dict.update(table.order, zip(hashes, ranks[:len(hashes)].tolist()))
    table.f_order[slots] = ranks[len(hashes):]
    table.next_order = len(distinct)


def _undo_accesses(table: BindingTable, slot: int, old: int) -> None:
    table.f_accesses[slot] = old


__all__ = ["BindingTable"]
