"""An undo journal, so the key directory can apply a batch all or nothing.

Contract:
- `JournaledDict(journal)` and `JournaledSet(journal)` are a `dict` and a `set` whose
  mutations, while `journal.recording`, first record how to undo them. Reads are the
  native ones (no overhead); a write costs one tuple appended to the journal.
- `journal.begin()` starts recording; `journal.commit()` forgets the records;
  `journal.rollback()` undoes every recorded mutation, newest first, so every journaled
  structure is exactly as it was at `begin()`. `note(obj, attr)` records an attribute
  of any object the same way (for the few counters kept on objects).
- A plain `set` stored into a `JournaledDict` is stored as a `JournaledSet` with the same
  elements, so sets created by code under the journal are journaled from then on.
- Only the mutating methods the directory uses are journaled (`[]=`, `del`, `pop`,
  `setdefault`, `insert_absent`; `add`, `add_all`, `discard`, `remove`); the others raise
  rather than mutate silently. `insert_absent(keys, values)` and `add_all(elements)` are
  one record however many they add (`insert_absent` refuses, changing nothing, if any key
  is present); `journal.keys_changed(target)` names the keys of a dict changed since
  `begin()`; `record(undo, target, key, old)` journals a change of any other kind.

Picklable (a replica's snapshot holds the directory): each structure travels with its
journal and its plain contents.

Not thread-safe: used under the directory lock, by one writer at a time.
"""

from __future__ import annotations

from typing import Any

_MISSING = object()


class Journal:
    __slots__ = ("records",)

    def __init__(self) -> None:
        self.records: list | None = None  # a list while recording

    @property
    def recording(self) -> bool:
        return self.records is not None

    def begin(self) -> None:
        self.records = []

    def commit(self) -> None:
        self.records = None

    def note(self, obj: object, attr: str) -> None:
        """Record `obj.attr` (about to change) so a rollback restores it."""
        if self.records is not None:
            self.records.append((_undo_attr, obj, attr, getattr(obj, attr)))

    def record(self, undo, target: object, key: object, old: object) -> None:
        """Record how to undo a change of any other kind: `undo(target, key, old)`."""
        if self.records is not None:
            self.records.append((undo, target, key, old))

    def rollback(self) -> None:
        records, self.records = self.records, None
        for undo, target, key, old in reversed(records or ()):
            undo(target, key, old)

    def keys_changed(self, target: dict, singly: bool = False) -> set:
        """The keys of `target` (a `JournaledDict`) changed since `begin()`; `singly`:
        only those changed one by one (not by `insert_absent`)."""
        changed = set()
        for undo, obj, key, _ in self.records or ():
            if obj is target:
                if undo is not _undo_absent:
                    changed.add(key)
                elif not singly:
                    changed.update(key)
        return changed


def _undo_item(target: dict, key: Any, old: Any) -> None:
    if old is _MISSING:
        dict.pop(target, key, None)
    else:
        dict.__setitem__(target, key, old)


def _undo_absent(target: dict, keys: list, _: None) -> None:
    for key in keys:
        dict.pop(target, key, None)


def _undo_member(target: set, element: Any, was_present: bool) -> None:
    if was_present:
        set.add(target, element)
    else:
        set.discard(target, element)


def _undo_members_added(target: set, elements: set, _: None) -> None:
    set.difference_update(target, elements)


def _undo_attr(target: object, attr: str, old: Any) -> None:
    setattr(target, attr, old)


class JournaledDict(dict):
    __slots__ = ("journal",)

    def __init__(self, journal: Journal, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.journal = journal

    def __setitem__(self, key, value) -> None:
        if type(value) is set:
            value = JournaledSet(self.journal, value)
        records = self.journal.records
        if records is not None:
            records.append((_undo_item, self, key, dict.get(self, key, _MISSING)))
        dict.__setitem__(self, key, value)

    def __delitem__(self, key) -> None:
        records = self.journal.records
        if records is not None:
            records.append((_undo_item, self, key, dict.__getitem__(self, key)))
        dict.__delitem__(self, key)

    def pop(self, key, default=_MISSING):
        if key in self:
            value = dict.__getitem__(self, key)
            del self[key]
            return value
        if default is _MISSING:
            raise KeyError(key)
        return default

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return dict.__getitem__(self, key)

    def insert_absent(self, keys: list, values) -> None:
        """Add each of `keys` with its value from `values` (an iterable as long, stored as
        given): one record for them all. ValueError, and nothing changed, if any of them
        is present."""
        if not self.keys().isdisjoint(keys):
            raise ValueError("insert_absent: some keys are present")
        records = self.journal.records
        if records is not None:
            records.append((_undo_absent, self, keys, None))
        dict.update(self, zip(keys, values))

    def _refuse(self, *args, **kwargs):
        raise TypeError("not journaled: use [] =, del, pop, setdefault or insert_absent")

    update = popitem = clear = __ior__ = _refuse

    def __reduce__(self):
        return JournaledDict, (self.journal, dict(self))


class JournaledSet(set):
    __slots__ = ("journal",)

    def __init__(self, journal: Journal, elements=()) -> None:
        super().__init__(elements)
        self.journal = journal

    def add(self, element) -> None:
        records = self.journal.records
        if records is not None and element not in self:
            records.append((_undo_member, self, element, False))
        set.add(self, element)

    def discard(self, element) -> None:
        records = self.journal.records
        if records is not None and element in self:
            records.append((_undo_member, self, element, True))
        set.discard(self, element)

    def add_all(self, elements: list) -> None:
        """`add` of each element: one record for them all."""
        records = self.journal.records
        if records is not None:
            # Usually none is here yet: then the list itself says what to take out.
            added = elements if self.isdisjoint(elements) else set(elements).difference(self)
            if added:
                records.append((_undo_members_added, self, added, None))
        set.update(self, elements)  # in their order: the set `add` by `add` would leave

    def remove(self, element) -> None:
        if element not in self:
            raise KeyError(element)
        self.discard(element)

    def _refuse(self, *args, **kwargs):
        raise TypeError("not journaled: use add, add_all, discard or remove")

    pop = clear = update = difference_update = intersection_update = \
        symmetric_difference_update = __ior__ = __iand__ = __isub__ = __ixor__ = _refuse

    def __reduce__(self):
        return JournaledSet, (self.journal, set(self))
