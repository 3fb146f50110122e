"""Where each object key is held: key and place numbering, the per-chunk placement records
and the running totals (docs/DESIGN.md, "Coordinator", "Key directory internals").

`Placements` numbers keys and places once (interning tables) and frees numbers no
placement refers to after a batch. A chunk's placements (`holds`) are a flat tuple
`(key_no, place_no, ...)` up to `FEW` of them, a `_ManyKeys` beyond; every operation
here takes and returns `holds` and counts keys, placements and reported bytes. Not
thread-safe: used under the directory lock (the readers that skip it say why).
"""

from __future__ import annotations

from blend_wire import BlendNamespace, CacheEventBatch, EncodedObjectKey
from coordinator_stub.directory.journal import Journal, JournaledDict

#: `(instance_id, incarnation, tier, backend, shared, size_bytes)`: one place an object
#: is held, as its (latest) reporter described it.
Place = tuple[str, int, str, str, bool, int]
INSTANCE, INCARNATION, TIER, BACKEND, SHARED, SIZE = range(6)

#: Placements a chunk keeps in a flat tuple (scanned); past this, a `_ManyKeys`.
FEW = 8


class _ManyKeys:
    """The placements of one chunk hash with many keys (e.g. thousands of object groups).

    `places[key_no]`: the place numbers holding that key; `keys_in[namespace]`: how many
    of the keys belong to it; `placements_of[instance_id]`: how many placements the
    instance holds. Every update is O(1) in the number of keys. Rare, so its GC tracking
    does not matter."""

    __slots__ = ("places", "keys_in", "placements_of", "_count", "_journal")

    def __init__(self, journal: Journal) -> None:
        # Journaled like the directory's own maps: a rolled-back batch leaves no trace.
        self.places: dict[int, tuple[int, ...]] = JournaledDict(journal)
        self.keys_in: dict[BlendNamespace, int] = JournaledDict(journal)
        self.placements_of: dict[str, int] = JournaledDict(journal)
        self._journal = journal
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    @count.setter
    def count(self, value: int) -> None:
        self._journal.note(self, "_count")
        self._count = value


def placements_in(holds) -> list[tuple[int, int]]:
    """Every `(key_no, place_no)` of a chunk (a copy: safe to remove while iterating)."""
    if type(holds) is tuple:
        return list(zip(holds[0::2], holds[1::2]))
    return [(k, p) for k, places in holds.places.items() for p in places]


def holds_key(holds, key_no: int) -> bool:
    return key_no in holds[0::2] if type(holds) is tuple else key_no in holds.places


def place_order(place: Place) -> tuple[str, str, str]:
    return place[INSTANCE], place[TIER], place[BACKEND]


class Placements:
    """Key and place numbers, per-chunk placement records and running totals."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        # Interning tables: keys and places are numbered once and referred to by number.
        self.key_nos: dict[tuple[str, str, int, int], int] = {}
        self.key_ns: list[BlendNamespace] = []  # namespace of each key number
        self._namespaces: dict[BlendNamespace, BlendNamespace] = {}
        self.key_raw: list[tuple[str, str, int, int]] = []  # fields of each key number
        self._place_nos: dict[Place, int] = {}
        self.places: list[Place] = []
        self._ident_nos: dict[tuple, int] = {}
        self.place_idents: list[int] = []  # identity number of each place number
        # Places are freed when no placement refers to them any more (an instance that
        # restarted, left or was reaped, a size nobody reports now), so churn of
        # instances and incarnations does not grow these tables: placements per place
        # (journaled, like the rest of a batch), places per identity, and free numbers.
        self._place_refs: dict[int, int] = JournaledDict(journal)
        self._idents: dict[int, tuple] = {}
        self._ident_refs: dict[int, int] = {}
        self._next_ident = 0
        self._free_place_nos: list[int] = []
        self._maybe_unused: set[int] = set()
        # Keys likewise: chunks holding each key number (journaled), keys per interned
        # namespace, free numbers; so keys (salts, models, ranks, groups) nobody holds any
        # more cost nothing, however many a client made up.
        self._key_refs: dict[int, int] = JournaledDict(journal)
        self._namespace_refs: dict[BlendNamespace, int] = {}
        self._free_key_nos: list[int] = []
        self._maybe_unused_keys: set[int] = set()
        self.num_keys = 0
        self.num_placements = 0
        # Running totals per tier: [placements, reported bytes]; L1 placements per instance.
        self.tier_totals = {"l1": [0, 0], "l2": [0, 0]}
        self.l1_by_instance: dict[str, int] = JournaledDict(journal)

    # --- a batch's totals (the journal covers the rest) -------------------------------

    def checkpoint(self) -> tuple:
        """The totals the journal does not cover, for `restore` if the batch fails (and
        the next identity number: a retry numbers what the failed batch did alike)."""
        return (self.num_keys, self.num_placements, self._next_ident,
                {tier: list(values) for tier, values in self.tier_totals.items()})

    def restore(self, checkpoint: tuple) -> None:
        self.num_keys, self.num_placements, self._next_ident, tier_totals = checkpoint
        for tier, values in tier_totals.items():
            self.tier_totals[tier][:] = values  # in place: `totals()` reads them unlocked

    # --- numbering ----------------------------------------------------------------------

    def place_no(self, batch: CacheEventBatch, size_bytes: int) -> int:
        place = (batch.instance_id, batch.incarnation, batch.tier, batch.backend,
                 batch.shared, size_bytes)
        place_no = self._place_nos.get(place)
        if place_no is None:
            ident = ("", batch.tier, batch.backend, True) if batch.shared else (
                batch.instance_id, batch.tier, batch.backend, False)
            ident_no = self._ident_nos.get(ident)
            if ident_no is None:
                ident_no = self._ident_nos[ident] = self._next_ident
                self._next_ident += 1
                self._idents[ident_no] = ident
            self._ident_refs[ident_no] = self._ident_refs.get(ident_no, 0) + 1
            if self._free_place_nos:
                place_no = self._free_place_nos.pop()
                self.places[place_no], self.place_idents[place_no] = place, ident_no
            else:
                place_no = len(self.places)
                self.places.append(place)
                self.place_idents.append(ident_no)
            self._place_nos[place] = place_no
            self._maybe_unused.add(place_no)  # freed after the batch if nothing holds it
        return place_no

    def key_no(self, key: EncodedObjectKey) -> int:
        raw = (key.model_name, key.cache_salt, key.kv_rank, key.object_group_id)
        key_no = self.key_nos.get(raw)
        if key_no is None:
            namespace = key.namespace
            namespace = self._namespaces.setdefault(namespace, namespace)
            self._namespace_refs[namespace] = self._namespace_refs.get(namespace, 0) + 1
            if self._free_key_nos:
                key_no = self._free_key_nos.pop()
                self.key_ns[key_no], self.key_raw[key_no] = namespace, raw
            else:
                key_no = len(self.key_ns)
                self.key_ns.append(namespace)
                self.key_raw.append(raw)
            self.key_nos[raw] = key_no
            self._maybe_unused_keys.add(key_no)  # freed after the batch if nothing holds it
        return key_no

    def known_key_no(self, key: EncodedObjectKey) -> int | None:
        """The key's number if it has one. Looked up, not interned: deleting or accessing
        what was never stored must not grow the table."""
        return self.key_nos.get(
            (key.model_name, key.cache_salt, key.kv_rank, key.object_group_id))

    def free_unused(self) -> None:
        """Forget places and keys no placement refers to (after a batch, committed or
        not)."""
        refs = self._place_refs
        for place_no in self._maybe_unused:
            if place_no in refs or self.places[place_no] is None:
                continue
            del self._place_nos[self.places[place_no]]
            self.places[place_no] = None
            ident_no = self.place_idents[place_no]
            self._ident_refs[ident_no] -= 1
            if not self._ident_refs[ident_no]:
                del self._ident_refs[ident_no]
                del self._ident_nos[self._idents.pop(ident_no)]
            self._free_place_nos.append(place_no)
        self._maybe_unused.clear()
        self._free_unused_keys()

    def _free_unused_keys(self) -> None:
        refs = self._key_refs
        for key_no in self._maybe_unused_keys:
            if key_no in refs or self.key_raw[key_no] is None:
                continue
            del self.key_nos[self.key_raw[key_no]]
            namespace = self.key_ns[key_no]
            self._namespace_refs[namespace] -= 1
            if not self._namespace_refs[namespace]:
                del self._namespace_refs[namespace]
                del self._namespaces[namespace]
            self.key_ns[key_no] = self.key_raw[key_no] = None
            self._free_key_nos.append(key_no)
        self._maybe_unused_keys.clear()

    def _count(self, place_no: int, delta: int) -> None:
        """Move the running totals by `delta` placements at one place (added if positive,
        removed if negative)."""
        place = self.places[place_no]
        refs = self._place_refs.get(place_no, 0) + delta
        if refs:
            self._place_refs[place_no] = refs
        else:
            del self._place_refs[place_no]
            self._maybe_unused.add(place_no)
        totals = self.tier_totals[place[TIER]]
        totals[0] += delta
        totals[1] += delta * place[SIZE]
        if place[TIER] == "l1":
            instance_id = place[INSTANCE]
            count = self.l1_by_instance.get(instance_id, 0) + delta
            if count:
                self.l1_by_instance[instance_id] = count
            else:
                del self.l1_by_instance[instance_id]

    # --- placements of one chunk (flat tuple, or _ManyKeys past FEW) ------------------

    def add(self, holds, key_no: int, place_no: int) -> tuple[object, bool]:
        """Record `(key_no, place_no)`; returns (holds, whether the key's namespace is
        new to this chunk). Counts keys and placements."""
        if not holds:
            return self.add_first(key_no, place_no, 1), True
        key_ns, namespace = self.key_ns, self.key_ns[key_no]
        idents, ident = self.place_idents, self.place_idents[place_no]
        if type(holds) is tuple:
            new_key = new_claim = True
            for i in range(0, len(holds), 2):
                if holds[i] == key_no:
                    new_key = new_claim = False
                    if idents[holds[i + 1]] == ident:
                        if holds[i + 1] != place_no:  # reported again: the latest report
                            self._replace_place(holds[i + 1], place_no)
                            holds = holds[:i + 1] + (place_no,) + holds[i + 2:]
                        return holds, False
                elif key_ns[holds[i]] == namespace:
                    new_claim = False
            holds += (key_no, place_no)
            if len(holds) > 2 * FEW:
                holds = self._many_keys(holds)
        else:
            places = holds.places.get(key_no)
            new_key = places is None
            if new_key:
                new_claim = namespace not in holds.keys_in
                holds.keys_in[namespace] = holds.keys_in.get(namespace, 0) + 1
                places = ()
            else:
                new_claim = False
                for i, held in enumerate(places):
                    if idents[held] == ident:
                        if held != place_no:  # reported again: the latest report
                            self._replace_place(held, place_no, holds)
                            holds.places[key_no] = places[:i] + (place_no,) + places[i + 1:]
                        return holds, False
            holds.places[key_no] = places + (place_no,)
            instance = self.places[place_no][0]
            holds.placements_of[instance] = holds.placements_of.get(instance, 0) + 1
            holds.count += 1
        if new_key:
            self._key_refs[key_no] = self._key_refs.get(key_no, 0) + 1
            self.num_keys += 1
        self.num_placements += 1
        self._count(place_no, 1)
        return holds, new_claim

    def add_first(self, key_no: int, place_no: int, chunks: int) -> tuple[int, int]:
        """Record `(key_no, place_no)` as the first placement of `chunks` chunks at once:
        the `holds` they all share (a tuple: shared safely). Counts keys and placements."""
        self._key_refs[key_no] = self._key_refs.get(key_no, 0) + chunks
        self.num_keys += chunks
        self.num_placements += chunks
        self._count(place_no, chunks)
        return key_no, place_no

    def _replace_place(self, old: int, new: int, many: _ManyKeys | None = None) -> None:
        """A placement's place is replaced by a new report of the same identity (another
        size or incarnation, or, for a shared pool, another reporter)."""
        self._count(old, -1)
        self._count(new, 1)
        if many is not None:
            old_instance, new_instance = self.places[old][0], self.places[new][0]
            if old_instance != new_instance:
                many.placements_of[old_instance] -= 1
                if not many.placements_of[old_instance]:
                    del many.placements_of[old_instance]
                many.placements_of[new_instance] = many.placements_of.get(new_instance, 0) + 1

    def held_place(self, holds, key_no: int, ident: int) -> int | None:
        """The place number holding `key_no` with identity `ident`, if any."""
        idents = self.place_idents
        if type(holds) is tuple:
            for i in range(0, len(holds), 2):
                if holds[i] == key_no and idents[holds[i + 1]] == ident:
                    return holds[i + 1]
            return None
        for place_no in holds.places.get(key_no, ()):
            if idents[place_no] == ident:
                return place_no
        return None

    def remove(self, holds, key_no: int, place_no: int):
        """Drop `(key_no, place_no)`: (holds, whether the key lost its last placement,
        whether the key's namespace lost its last key here, whether the place's instance
        lost its last placement here), or None if there is no such placement. Counts keys
        and placements."""
        key_ns, places = self.key_ns, self.places
        instance = places[place_no][0]
        if type(holds) is tuple:
            for i in range(0, len(holds), 2):
                if holds[i] == key_no and holds[i + 1] == place_no:
                    break
            else:
                return None
            holds = holds[:i] + holds[i + 2:]
            key_gone = key_no not in holds[0::2]
            namespace = key_ns[key_no]
            claim_gone = key_gone and all(key_ns[k] != namespace for k in holds[0::2])
            instance_gone = all(places[p][0] != instance for p in holds[1::2])
        else:
            holds, key_gone, claim_gone, instance_gone = self._remove_many(
                holds, key_no, place_no, instance)
            if holds is None:
                return None
        if key_gone:
            refs = self._key_refs[key_no] - 1
            if refs:
                self._key_refs[key_no] = refs
            else:
                del self._key_refs[key_no]
                self._maybe_unused_keys.add(key_no)
            self.num_keys -= 1
        self.num_placements -= 1
        self._count(place_no, -1)
        return holds, key_gone, claim_gone, instance_gone

    def _remove_many(self, holds: _ManyKeys, key_no: int, place_no: int, instance: str):
        """`remove` from a `_ManyKeys` (holds None: no such placement)."""
        kept = holds.places.get(key_no, ())
        if place_no not in kept:
            return None, False, False, False
        kept = tuple(p for p in kept if p != place_no)
        key_gone = not kept
        claim_gone = False
        if key_gone:
            del holds.places[key_no]
            namespace = self.key_ns[key_no]
            holds.keys_in[namespace] -= 1
            if not holds.keys_in[namespace]:
                del holds.keys_in[namespace]
                claim_gone = True
        else:
            holds.places[key_no] = kept
        holds.placements_of[instance] -= 1
        instance_gone = not holds.placements_of[instance]
        if instance_gone:
            del holds.placements_of[instance]
        holds.count -= 1
        if holds.count <= FEW // 2:  # small again: back to a flat tuple
            holds = tuple(v for k, p in placements_in(holds) for v in (k, p))
        return holds, key_gone, claim_gone, instance_gone

    def _many_keys(self, flat: tuple[int, ...]) -> _ManyKeys:
        many = _ManyKeys(self._journal)
        for i in range(0, len(flat), 2):
            key_no, place_no = flat[i], flat[i + 1]
            if key_no not in many.places:
                namespace = self.key_ns[key_no]
                many.keys_in[namespace] = many.keys_in.get(namespace, 0) + 1
            many.places[key_no] = many.places.get(key_no, ()) + (place_no,)
            instance = self.places[place_no][0]
            many.placements_of[instance] = many.placements_of.get(instance, 0) + 1
        many.count = len(flat) // 2
        return many

    def instance_of(self, place_no: int) -> str:
        """The instance a place names (its latest reporter, for a shared pool)."""
        return self.places[place_no][INSTANCE]

    def namespaces_of(self, holds) -> list[BlendNamespace]:
        if type(holds) is not tuple:
            return list(holds.keys_in)
        found: list[BlendNamespace] = []
        for key_no in holds[0::2]:
            namespace = self.key_ns[key_no]
            if namespace not in found:
                found.append(namespace)
        return found

    def alone(self, holds, namespace: BlendNamespace) -> bool:
        """Whether `namespace` is the only one with keys on the chunk."""
        if type(holds) is tuple:
            key_ns = self.key_ns
            return all(key_ns[key_no] == namespace for key_no in holds[0::2])
        return len(holds.keys_in) == 1
