"""The claims of a content index: which namespace claims which chunk on which content.

`ClaimLists` is the bookkeeping half of `local_matcher.index.ContentIndex` (which owns
the content store, the lock and the public API; docs/DESIGN.md, "The content index").
Not thread-safe: the index calls it under its lock.

Each (chunk, namespace) claim is a *slot*; the claims one namespace holds on one content
form a circular doubly linked list of slots in occupant order (LMCache's: the order in
which the chunks were first indexed on that content), kept in flat integer arrays, so
that no cost grows with how many occupants a content has or how many namespaces claim a
chunk: adding a claim is O(1) when its occupant is the newest on the content (else one
step per newer occupant of its namespace), removing one O(1), a match one step per
occurrence.

Invariants:
- `chunks` (a `local_matcher.chunk_hashes.ChunkHashes`) maps chunk `h` to its claims: the
  slot of its only claim (an int); a tuple of slots while a few namespaces claim it; past
  `_FEW_CLAIMS`, a `_ManyClaims` ({namespace id: slot} and, per content, its occupant's
  order and claim count). It also names each slot's chunk (`chunks.at`). A chunk hash of
  32 bytes with one claim (the common chunk) costs no Python object there: its bytes are
  its slot's row in a column and a table of slot numbers finds it.
- slot `s`: `chunks.at([s])` its chunk, `slot_ns[s]` its namespace id, `slot_cid[s]` its
  content, `slot_offset[s]` its stored offset, `_slot_order[s]` its occupant's order
  number (the same in every slot of one occupant, increasing with the time the occupant
  was first indexed), `next_slot[s]` and `_prev[s]` its neighbours in its circular list
  (the head's prev is the tail), sorted by order number. Free slots are on `_free_slots`.
- Order numbers are int32 (4 B a slot) and only ever compared; new ones come from
  `_next_order`. Before a batch of claims could take it past `_MAX_ORDER`, every live
  number is replaced by its rank among them (`_renumber`): the slots of one occupant keep
  one number, and every comparison answers as before. As many numbers live as occupants
  (at most one per slot), so a renumbering leaves room for any batch short of 2^31 claims.
- the list of (cid, ns) starts at `head[cid]` if `slot_ns[head[cid]] == ns`, else at
  `other_heads.get(ns << 32 | cid)` (`local_matcher.head_table`, a table the lookup
  kernels read): most contents are claimed by one namespace, so their only list costs
  no entry there.
- `num_chunks[cid]` occupants per content (chunks with at least one claim on it). A
  content is stored iff it has an occupant; a chunk exists iff a namespace claims it.
- A namespace's id is recycled once nothing claims it, so the ids stay small.
"""

from __future__ import annotations

from array import array
from itertools import groupby
from typing import Hashable, Sequence

import numpy as np

from local_matcher.chunk_hashes import ChunkHashes
from local_matcher.head_table import HeadTable, heads_of

NONE = -1  # "no slot" in the slot and head arrays
_NS_SHIFT = 32  # `other_heads` key: namespace id above, content id below
_FEW_CLAIMS = 8  # claims on one chunk kept in a tuple (scanned); past this, a _ManyClaims
_MAX_ORDER = 2**31 - 1  # order numbers are int32 (module doc); tests lower it to force a wrap


def mask_bit(ns_id: int) -> int:
    """The bit of a namespace in the content store's namespace masks (32 bits: a probe's
    cheap pre-test; past 32 namespaces ids share bits, which costs a probe a comparison,
    never a match)."""
    return 1 << (ns_id & 31)


def mask_bits(ns_ids: np.ndarray) -> np.ndarray:
    """`mask_bit` of each id."""
    return np.left_shift(np.uint32(1), (ns_ids & 31).astype(np.uint32))


class ClaimLists:
    """The slots, lists and namespace ids of a content index (module doc)."""

    def __init__(self) -> None:
        self.chunks = ChunkHashes()  # {chunk hash: claim} and each slot's chunk hash
        # Claim slots.
        self.slot_ns = array("i")
        self.slot_cid = array("i")
        self.slot_offset = array("q")  # offsets go up to 2^53: 8 bytes
        self._slot_order = array("i")
        self.next_slot = array("i")
        self._prev = array("i")
        self._free_slots = array("i")
        self._next_order = 0  # order number of the next new occupant
        # Per content id (grown with the store).
        self.head = array("i")
        self.num_chunks = array("i")
        self._more_heads = HeadTable()  # named as when it was a dict: snapshots load
        self.num_occupants = 0
        self._namespaces = _NamespaceIds()
        self.num_claims = 0

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        if type(self._more_heads) is dict:  # a snapshot of a build that kept a dict here
            heads = HeadTable()
            for key, slot in self._more_heads.items():
                heads.set(key, slot)
            self._more_heads = heads
        if self._slot_order.typecode == "q":  # a snapshot of a build with 8-byte numbers
            _renumber(self)

    @property
    def other_heads(self) -> HeadTable:
        """The heads of the lists that are not their content's first (module doc)."""
        return self._more_heads

    # --- adding -------------------------------------------------------------------------

    def grow(self, capacity: int) -> None:
        """Room for content ids below `capacity`."""
        missing = capacity - len(self.head)
        if missing > 0:
            self.head.extend(array("i", [NONE]) * missing)
            self.num_chunks.extend(array("i", [0]) * missing)

    @property
    def ns_ids(self) -> dict[Hashable, int]:
        """{namespace: id} of every namespace with a claim (read only)."""
        return self._namespaces.ids

    def claim_all(self, chunk_hashes: Sequence[Hashable], cids: list[int], offsets: list[int],
                  namespaces: Sequence[Hashable], ns_ids: np.ndarray) -> list[int]:
        """Each chunk claimed by its namespace on its content at its offset, in order
        (`ContentIndex.add` says what changes). Sets `ns_ids[i]` to row i's namespace
        id; returns the contents claims moved away from (to be settled)."""
        if self._next_order + len(chunk_hashes) > _MAX_ORDER:  # a row: one occupant at most
            _renumber(self)
        chunks, slot_cid, slot_offset = self.chunks, self.slot_cid, self.slot_offset
        vacated, current, ns_id = [], object(), NONE
        for i, (chunk_hash, cid, offset, name) in enumerate(zip(
                chunk_hashes, cids, offsets, namespaces)):
            if name is not current:  # adding never retires an id: safe to keep
                current, ns_id = name, self._namespaces.id_of(name)
            ns_ids[i] = ns_id
            claim = chunks.get(chunk_hash)
            slot = NONE if claim is None else self._slot_of(claim, ns_id)
            if slot == NONE:  # a new claim: O(1) however many the chunk has
                slot = self._claim(chunk_hash, cid, ns_id, offset, claim)
                chunks.set(chunk_hash, self._with_slot(claim, slot))
                self._count_claims(ns_id, 1)
            elif slot_cid[slot] == cid:
                slot_offset[slot] = offset
            else:  # this namespace now reports other tokens under the hash
                vacated.append(slot_cid[slot])
                self._move(claim, slot, cid, offset)
        return vacated

    def claim_new(self, chunk_hashes: Sequence[Hashable], cids: np.ndarray,
                  offsets: np.ndarray, namespaces: Sequence[Hashable] | Hashable,
                  fresh: np.ndarray) -> np.ndarray | int:
        """`claim_all` of chunk hashes new to the index and distinct (the caller's word),
        in a few array operations: each a new occupant, the newest on its content, so its
        claim goes last in its list. `namespaces`: a list (one per row) or one; `fresh`: 1
        on the first row of each content just stored, which starts a list of its own (the
        others are linked at their list's tail, O(1)). Returns the namespace ids (a
        list's, or the one)."""
        count = len(chunk_hashes)
        if self._next_order + count > _MAX_ORDER:
            _renumber(self)
        ns_ids = self._namespaces.claimed(namespaces, count)
        self.num_claims += count
        slots = self._new_slots(chunk_hashes)
        i32, i64 = np.int32, np.int64
        np.frombuffer(self.slot_ns, dtype=i32)[slots] = ns_ids
        np.frombuffer(self.slot_cid, dtype=i32)[slots] = cids
        np.frombuffer(self.slot_offset, dtype=i64)[slots] = offsets
        np.frombuffer(self._slot_order, dtype=i32)[slots] = np.arange(
            self._next_order, self._next_order + count)
        self._next_order += count
        self.num_occupants += count
        self.chunks.add_new(chunk_hashes, slots)
        own = fresh.view(bool)
        alone, alone_cids = (slots, cids) if own.all() else (slots[own], cids[own])
        np.frombuffer(self.next_slot, dtype=i32)[alone] = alone  # each its own list
        np.frombuffer(self._prev, dtype=i32)[alone] = alone
        np.frombuffer(self.head, dtype=i32)[alone_cids] = alone
        np.frombuffer(self.num_chunks, dtype=i32)[alone_cids] = 1
        if len(alone) < count:  # on contents held before, or earlier in the batch
            np.add.at(np.frombuffer(self.num_chunks, dtype=i32), cids[~own], 1)
            for slot in slots[~own].tolist():
                self._link(slot)
        return ns_ids

    def _new_slots(self, chunk_hashes: Sequence[Hashable]) -> np.ndarray:
        """Slots for these chunks (their other fields still to be written): free ones
        first, in the order `_claim` would take them, then new ones at the end."""
        count, free = len(chunk_hashes), self._free_slots
        reused = min(count, len(free))
        slots = np.empty(count, dtype=np.int64)
        if reused:
            slots[:reused] = np.frombuffer(free, dtype=np.int32)[::-1][:reused]
            del free[len(free) - reused:]
        grown = count - reused
        if grown:
            start = len(self.slot_ns)
            slots[reused:] = np.arange(start, start + grown)
            self.chunks.reserve(start + grown)
            for ints in (self.slot_ns, self.slot_cid, self.slot_offset, self._slot_order,
                         self.next_slot, self._prev):
                ints.frombytes(bytes(ints.itemsize * grown))
        self.chunks.name_all(slots, chunk_hashes)
        return slots

    # --- removing -----------------------------------------------------------------------

    def remove_claim(self, chunk_hash: Hashable, ns_id: int) -> int:
        """Drop `ns_id`'s claim on a chunk; the content it left, or NONE when there was
        no such claim."""
        claim = self.chunks.get(chunk_hash)
        slot = NONE if claim is None else self._slot_of(claim, ns_id)
        if slot == NONE:
            return NONE
        cid = self.slot_cid[slot]
        self._remove_slot(chunk_hash, claim, slot)
        return cid

    def drop(self, chunk_hash: Hashable) -> set[int] | tuple:
        """Drop a chunk with every claim (unknown: nothing); the contents it occupied."""
        claim = self.chunks.get(chunk_hash)
        if claim is None:
            return ()
        slots = self._slots_in(claim)
        cids = {self.slot_cid[slot] for slot in slots}
        for slot in slots:
            self._unlink(slot)
            self._free(slot)
        for cid in cids:
            self.num_chunks[cid] -= 1
        self.num_occupants -= len(cids)
        self.chunks.delete(chunk_hash)
        return cids

    def vacant(self, touched) -> list[int]:
        """The touched contents (NONE: none) left without an occupant."""
        return [cid for cid in set(touched) if cid != NONE and self.num_chunks[cid] == 0]

    # --- reading ------------------------------------------------------------------------

    def content_of(self, chunk_hash: Hashable, ns_id: int | None) -> int:
        """The content of `ns_id`'s claim on a chunk (None: of its first claim), or NONE."""
        claim = self.chunks.get(chunk_hash)
        if claim is None:
            return NONE
        slot = self._slots_in(claim)[0] if ns_id is None else self._slot_of(claim, ns_id)
        return NONE if slot == NONE else self.slot_cid[slot]

    def only_slot(self, chunk_hash: Hashable) -> int:
        """`only_slots` of one chunk."""
        slot = self.chunks.get(chunk_hash, NONE)
        return slot if type(slot) is int else NONE

    def only_slots(self, chunk_hashes: Sequence[Hashable]) -> list[int]:
        """Per chunk, the slot of its claim if exactly one namespace claims it, else NONE
        (safe without the index lock: `ChunkHashes.slots_of`)."""
        return self.chunks.slots_of(chunk_hashes)

    def heads_of(self, cids: np.ndarray, ns_id: int) -> np.ndarray:
        """Per content, the head slot of `ns_id`'s list (-1: none)."""
        return heads_of(cids, ns_id, self.head, self.slot_ns, *self._more_heads.for_kernels)

    def python_bytes(self) -> int:
        """Memory held beyond the content store: the arrays and the Python records."""
        arrays = (self.slot_ns, self.slot_cid, self.slot_offset, self._slot_order,
                  self.next_slot, self._prev, self.head, self.num_chunks, self._free_slots)
        return (self.chunks.nbytes() + self._more_heads.nbytes()
                + sum(len(a) * a.itemsize for a in arrays))

    # --- a chunk's claims: one slot (int), a tuple of slots, or a _ManyClaims ----------

    def _slot_of(self, claim, ns_id: int) -> int:
        """The slot of `ns_id`'s claim among a chunk's, or NONE."""
        if type(claim) is int:
            return claim if self.slot_ns[claim] == ns_id else NONE
        if type(claim) is tuple:
            slot_ns = self.slot_ns
            for slot in claim:
                if slot_ns[slot] == ns_id:
                    return slot
            return NONE
        return claim.slots.get(ns_id, NONE)

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
            # Many namespaces: O(1) per claim from now on.
            return _ManyClaims.of(claim + (slot,), self.slot_ns, self.slot_cid,
                                  self._slot_order)
        claim.slots[self.slot_ns[slot]] = slot
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
            slot_cid = self.slot_cid
            for other in ((claim,) if type(claim) is int else claim):
                if other != slot and slot_cid[other] == cid:
                    return self._slot_order[other]
        return self._new_occupant(cid)

    def _new_occupant(self, cid: int) -> int:
        order = self._next_order
        self._next_order += 1
        self.num_chunks[cid] += 1
        self.num_occupants += 1
        return order

    def _leave(self, claim, slot: int) -> None:
        """`slot` leaves its content: the chunk's occupant of it ends with its last claim."""
        cid = self.slot_cid[slot]
        if type(claim) is _ManyClaims:
            occupant = claim.occupants[cid]
            occupant[1] -= 1
            if occupant[1]:
                return
            del claim.occupants[cid]
        else:
            slot_cid = self.slot_cid
            for other in ((claim,) if type(claim) is int else claim):
                if other != slot and slot_cid[other] == cid:
                    return
        self.num_chunks[cid] -= 1
        self.num_occupants -= 1

    # --- the lists ----------------------------------------------------------------------

    def _head_of(self, cid: int, ns_id: int) -> int:
        """The first slot of `ns_id`'s list on content `cid`, or NONE."""
        head = self.head[cid]
        if head != NONE and self.slot_ns[head] == ns_id:
            return head
        return self._more_heads.get(ns_id << _NS_SHIFT | cid) if self._more_heads.size \
            else NONE

    def _set_head(self, cid: int, ns_id: int, old: int, new: int) -> None:
        """Move the head of `ns_id`'s list on `cid` from slot `old` to `new` (NONE: the
        list is gone)."""
        if self.head[cid] == old:
            self.head[cid] = new
        elif new == NONE:
            self._more_heads.delete(ns_id << _NS_SHIFT | cid)
        else:
            self._more_heads.set(ns_id << _NS_SHIFT | cid, new)

    def _claim(self, chunk_hash: Hashable, cid: int, ns_id: int, offset: int, claim) -> int:
        """A new slot: `ns_id`'s claim on `chunk_hash` (whose claims so far are `claim`,
        or None) at content `cid`, linked into its list. The caller adds it to the
        chunk's claims (`_with_slot`), counts it (`_count_claims`) and sets the
        namespace's mask bit."""
        if self._free_slots:
            slot = self._free_slots.pop()
            self.slot_ns[slot] = ns_id
            self.slot_cid[slot] = cid
            self.slot_offset[slot] = offset
        else:
            slot = len(self.slot_ns)
            self.chunks.reserve(slot + 1)
            self.slot_ns.append(ns_id)
            self.slot_cid.append(cid)
            self.slot_offset.append(offset)
            self._slot_order.append(0)
            self.next_slot.append(slot)
            self._prev.append(slot)
        self.chunks.name(slot, chunk_hash)
        self._slot_order[slot] = self._join(claim, cid, slot)
        self._link(slot)
        return slot

    def _move(self, claim, slot: int, cid: int, offset: int) -> None:
        """A claim takes other content: out of its list, into that content's."""
        self._unlink(slot)
        self._leave(claim, slot)
        self._slot_order[slot] = self._join(claim, cid, slot)
        self.slot_cid[slot] = cid
        self.slot_offset[slot] = offset
        self._link(slot)

    def _link(self, slot: int) -> None:
        """Splice a slot into its (content, namespace) list, which stays in order-number
        order: O(1) at the tail (a new occupant), else one step per newer slot."""
        next_slot, prev_slot, slot_order = self.next_slot, self._prev, self._slot_order
        cid, ns_id = self.slot_cid[slot], self.slot_ns[slot]
        head = self._head_of(cid, ns_id)
        if head == NONE:  # the namespace's first claim on this content: a new list
            next_slot[slot] = prev_slot[slot] = slot
            if self.head[cid] == NONE:
                self.head[cid] = slot
            else:
                self._more_heads.set(ns_id << _NS_SHIFT | cid, slot)
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
        next_slot, prev_slot = self.next_slot, self._prev
        cid, ns_id = self.slot_cid[slot], self.slot_ns[slot]
        following = next_slot[slot]
        if following == slot:
            self._set_head(cid, ns_id, slot, NONE)
            return
        preceding = prev_slot[slot]
        next_slot[preceding] = following
        prev_slot[following] = preceding
        if self._head_of(cid, ns_id) == slot:
            self._set_head(cid, ns_id, slot, following)

    def _count_claims(self, ns_id: int, claimed: int) -> None:
        self._namespaces.count(ns_id, claimed)
        self.num_claims += claimed

    def _free(self, slot: int) -> None:
        """Free an unlinked slot (the namespace's id retires with its last claim)."""
        self.chunks.unname(slot)
        self._free_slots.append(slot)
        self._count_claims(self.slot_ns[slot], -1)

    def _remove_slot(self, chunk_hash: Hashable, claim, slot: int):
        """Drop one claim of a chunk; what is left of its claims (None: the chunk went)."""
        self._unlink(slot)
        self._leave(claim, slot)
        self._free(slot)
        if type(claim) is _ManyClaims:
            del claim.slots[self.slot_ns[slot]]
            rest = claim if claim.slots else None
        elif type(claim) is int:
            rest = None
        else:
            kept = tuple(held for held in claim if held != slot)
            rest = kept[0] if len(kept) == 1 else kept
        if rest is None:
            self.chunks.delete(chunk_hash)
        elif rest is not claim:
            self.chunks.set(chunk_hash, rest)
        return rest


def _renumber(claims: ClaimLists) -> None:
    """Order numbers by rank (module doc): each live slot's number replaced by its rank
    among the live slots' distinct numbers, and so each `_ManyClaims`' occupants' (each
    some live slot's number); `_next_order` becomes the count of distinct numbers (of
    occupants). Run between batches of claims, never inside one. Also turns an older
    snapshot's 8-byte numbers into 4-byte ones."""
    wide = claims._slot_order.typecode == "q"
    orders = np.frombuffer(claims._slot_order, dtype=np.int64 if wide else np.int32)
    live = np.ones(len(orders), dtype=bool)
    live[np.frombuffer(claims._free_slots, dtype=np.int32)] = False
    distinct, ranks = np.unique(orders[live], return_inverse=True)
    renumbered = np.zeros(len(orders), dtype=np.int32)  # a free slot's is never read
    renumbered[live] = ranks
    for claim in claims.chunks.others.values():  # the chunks that are not one slot
        if type(claim) is _ManyClaims:
            for occupant in claim.occupants.values():
                occupant[0] = int(np.searchsorted(distinct, occupant[0]))
    claims._slot_order = array("i", renumbered.tobytes())
    claims._next_order = len(distinct)


class _NamespaceIds:
    """Small integer ids for namespaces (a bit of the store's masks, a key of
    `other_heads`), each recycled once nothing claims its namespace, so they stay small."""

    def __init__(self) -> None:
        self.ids: dict[Hashable, int] = {}
        self._names: list[Hashable] = []
        self._claims: list[int] = []
        self._free: list[int] = []

    def id_of(self, namespace: Hashable) -> int:
        """The id of `namespace`, given one if it has none."""
        ns_id = self.ids.get(namespace)
        if ns_id is None:
            if self._free:
                ns_id = self._free.pop()
                self._names[ns_id] = namespace
            else:
                ns_id = len(self._names)
                self._names.append(namespace)
                self._claims.append(0)
            self.ids[namespace] = ns_id
        return ns_id

    def claimed(self, namespaces, count: int) -> np.ndarray | int:
        """The ids of `count` new claims' namespaces (a list, one per claim, or one for
        all), given in the order `ClaimLists.claim_all` gives them, and counted."""
        if type(namespaces) is not list:
            ns_id = self.id_of(namespaces)
            self.count(ns_id, count)
            return ns_id
        # By runs of one namespace (a batch's keys come in runs): one lookup per run.
        ids, lengths = [], []
        for name, run in groupby(namespaces):
            ids.append(self.id_of(name))
            lengths.append(len(list(run)))
            self.count(ids[-1], lengths[-1])
        return np.repeat(np.array(ids, dtype=np.int32), lengths)

    def count(self, ns_id: int, claimed: int) -> None:
        """`claimed` more claims (or fewer) of a namespace; its id retires at none."""
        self._claims[ns_id] += claimed
        if self._claims[ns_id] == 0:
            del self.ids[self._names[ns_id]]
            self._names[ns_id] = None
            self._free.append(ns_id)


class _ManyClaims:
    """The claims on a chunk past `_FEW_CLAIMS` namespaces: `slots` {namespace id: slot}
    and `occupants` {content id: [order number, claims on it]}, so that adding or
    removing one claim is O(1) however many there are. Rare, so its GC tracking does not
    matter."""

    __slots__ = ("slots", "occupants")

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}
        self.occupants: dict[int, list[int]] = {}

    @classmethod
    def of(cls, slots, slot_ns, slot_cid, slot_order) -> "_ManyClaims":
        """The record of a chunk's claims `slots`, from their namespaces, contents and
        occupants' order numbers."""
        many = cls()
        for held in slots:
            many.slots[slot_ns[held]] = held
            occupant = many.occupants.get(slot_cid[held])
            if occupant is None:
                many.occupants[slot_cid[held]] = [slot_order[held], 1]
            else:
                occupant[1] += 1
        return many

    def __getstate__(self) -> tuple:
        return self.slots, self.occupants

    def __setstate__(self, state: tuple) -> None:
        self.slots, self.occupants = state

