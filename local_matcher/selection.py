"""The selection rule of a unified lookup: candidates in, kept positions out.

One rule, two users: the plugin's `plugin.lookup.select` (what a server prefetches) and the
coordinator's blend score per instance (what that instance's lookup would select), so a
router's score and a server's reuse cannot drift apart. The rule runs as a numba kernel
over columns (`local_matcher.selection_kernels`), never per content in Python.

Input: legs, each a list of entries: one content the leg found, with the ascending query
positions where it occurs and the chunks holding it, each chunk with where it is held (its
place, an int, the lower the cheaper: the plugin's `Place`) and its identity (equal ids:
one chunk, whichever leg named it), in the order the leg named them. `Offers` holds them
as columns; `offers_of` builds them from plain groups `(positions, place, chunks)`.

The rule: merge the legs, drop positions inside the prefix, then one ascending pass keeps a
position starting at or after the end of the last kept one and gives it the cheapest unused
chunk (ties: the first leg's, then the leg's order); when that pass went short of chunks,
each leg alone is selected too and the most positions win (the union on a tie).
docs/DESIGN.md, "Plugin", says why.
"""

from __future__ import annotations

import itertools
from typing import Collection, Hashable, NamedTuple, Sequence

import numpy as np

from local_matcher import selection_kernels

#: `(positions, place, ((chunk_hash, old_st), ...))`.
Group = tuple[Sequence[int], int, Sequence[tuple[Hashable, int]]]
#: What a selection keeps: `(position, chunk_hash, old_st, place, leg index)`.
Kept = tuple[int, Hashable, int, int, int]


class Offers(NamedTuple):
    """Legs' entries as columns (module doc): `entry_leg` per entry; `position_start` /
    `positions` and `chunk_start` CSR over the entries; `chunk_place`, `chunk_id` per
    chunk; `legs`, how many legs there are (a leg may have no entry)."""

    entry_leg: np.ndarray
    position_start: np.ndarray
    positions: np.ndarray
    chunk_start: np.ndarray
    chunk_place: np.ndarray
    chunk_id: np.ndarray
    legs: int

    def chunk_leg(self) -> np.ndarray:
        """The leg that named each chunk."""
        return np.repeat(self.entry_leg, np.diff(self.chunk_start))


class LegColumns(NamedTuple):
    """One leg's candidates as columns: `local_matcher.types.CandidateColumns`' columns
    plus each chunk's place (`chunk_place`, int64). Built where the candidates enter
    (the local index, a coordinator's reply), never per content."""

    position_start: np.ndarray
    positions: np.ndarray
    chunk_start: np.ndarray
    old_st: np.ndarray
    chunk_hashes: Sequence[Hashable]
    chunk_place: np.ndarray

    @property
    def num_contents(self) -> int:
        return len(self.position_start) - 1

    @classmethod
    def of(cls, columns, place: int | np.ndarray) -> "LegColumns":
        """`CandidateColumns` whose chunks are all held at `place` (or at `place[i]`)."""
        places = (np.full(len(columns.old_st), place, dtype=np.int64)
                  if np.isscalar(place) else place)
        return cls(columns.position_start, columns.positions, columns.chunk_start,
                   columns.old_st, columns.chunk_hashes, places)

    @classmethod
    def of_groups(cls, groups: Sequence[Group]) -> "LegColumns":
        """Plain groups `(positions, place, chunks)` as columns (tests, LMCache's reply)."""
        offers, hashes, offsets = offers_of([groups])
        return cls(offers.position_start, offers.positions, offers.chunk_start,
                   np.array(offsets, dtype=np.int64), hashes, offers.chunk_place)

    def __eq__(self, other) -> bool:
        """Equal when they name the same groups (arrays compare by value)."""
        return isinstance(other, LegColumns) and self.groups() == other.groups()

    __hash__ = None  # arrays: not hashable

    def groups(self) -> list[Group]:
        """Plain groups, one per content and place (the inverse of `of_groups`, up to
        splitting a content by place)."""
        positions, offsets = self.positions.tolist(), self.old_st.tolist()
        places = self.chunk_place.tolist()
        pos, chunks = self.position_start.tolist(), self.chunk_start.tolist()
        found = []
        for i in range(self.num_contents):
            by_place: dict[int, list] = {}
            for c in range(chunks[i], chunks[i + 1]):
                by_place.setdefault(places[c], []).append((self.chunk_hashes[c], offsets[c]))
            found.extend((tuple(positions[pos[i]:pos[i + 1]]), place, tuple(held))
                         for place, held in by_place.items())
        return found


def merged(legs: Sequence[LegColumns]) -> tuple[Offers, list[Hashable], np.ndarray]:
    """The legs as one `Offers`, with every chunk's hash and stored offset. A chunk's
    identity is its hash: the one step per chunk in Python (a dict of the hashes; ids
    need not be dense)."""
    hashes: list[Hashable] = []
    for leg in legs:
        hashes.extend(leg.chunk_hashes)
    ids: dict = {}
    chunk_id = np.fromiter(map(ids.setdefault, hashes, itertools.count()), dtype=np.int64,
                           count=len(hashes))
    position_start, chunk_start, entry_leg = [np.zeros(1, dtype=np.int64)], [
        np.zeros(1, dtype=np.int64)], []
    positions_done = chunks_done = 0
    for index, leg in enumerate(legs):
        position_start.append(leg.position_start[1:] + positions_done)
        chunk_start.append(leg.chunk_start[1:] + chunks_done)
        entry_leg.append(np.full(leg.num_contents, index, dtype=np.int64))
        positions_done += len(leg.positions)
        chunks_done += len(leg.old_st)
    concat = np.concatenate
    offers = Offers(concat(entry_leg) if legs else np.zeros(0, dtype=np.int64),
                    concat(position_start), concat([leg.positions for leg in legs] or [[]]).astype(np.int64),
                    concat(chunk_start),
                    concat([leg.chunk_place for leg in legs] or [[]]).astype(np.int64),
                    chunk_id, len(legs))
    return offers, hashes, concat([leg.old_st for leg in legs] or [[]]).astype(np.int64)


def first_offers(offers: Offers, prefix_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Each distinct chunk once, at the first usable position any entry names it: (those
    positions, the chunk indices), in order of (position, entry, chunk)."""
    occ_pos, occ_entry = selection_kernels.occurrences(offers.position_start,
                                                       offers.positions, prefix_tokens)
    entries = len(offers.entry_leg)
    entry_order, first = np.unique(occ_entry, return_index=True)
    rank = np.full(entries, len(occ_entry), dtype=np.int64)
    rank[entry_order] = first
    chunk_rank = np.repeat(rank, np.diff(offers.chunk_start))
    order = np.lexsort((np.arange(len(chunk_rank)), chunk_rank))
    order = order[chunk_rank[order] < len(occ_entry)]
    _, once = np.unique(offers.chunk_id[order], return_index=True)
    order = order[np.sort(once)]
    return occ_pos[chunk_rank[order]], order


def select(offers: Offers, prefix_tokens: int, chunk_size: int,
           chunk_ok: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The rule (module doc): (kept positions, the chunk index serving each), ascending.
    `chunk_ok`, when given, 1 for each chunk that may be used."""
    chunks = offers.chunk_id.shape[0]
    if not chunks or not offers.positions.size:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    places, ranks = np.unique(offers.chunk_place, return_inverse=True)
    ids = int(offers.chunk_id.max()) + 1
    ok = np.ones(chunks, dtype=np.uint8) if chunk_ok is None else chunk_ok
    occ_pos, occ_entry = selection_kernels.occurrences(offers.position_start,
                                                       offers.positions, prefix_tokens)
    kept_pos, kept_chunk, _ = selection_kernels.select(
        occ_pos, occ_entry, offers.entry_leg, offers.legs, offers.chunk_start,
        ranks.astype(np.int64), offers.chunk_id, ok, places.size, ids, chunk_size)
    return kept_pos, kept_chunk


def score(columns, shared: np.ndarray, holder_start: np.ndarray, holders: np.ndarray,
          prefixes: np.ndarray, chunk_size: int) -> np.ndarray:
    """The rule once per instance, in one kernel call, on one leg of `CandidateColumns`
    whose chunks are placed per instance: this instance's L1 (instance i holds chunk c
    when `holders[holder_start[c]:holder_start[c + 1]]` names i), else a shared tier
    (`shared[c]`), else elsewhere. Row i: the tokens instance i keeps past its prefix
    `prefixes[i]` from (its L1, shared, elsewhere); the last row: an instance holding
    nothing in L1."""
    if not len(columns.old_st):
        return np.zeros((len(prefixes), 3), dtype=np.int64)
    occ_pos, occ_entry = selection_kernels.occurrences(columns.position_start,
                                                       columns.positions, 0)
    return selection_kernels.score(occ_pos, occ_entry, columns.chunk_start, shared,
                                   holder_start, holders, prefixes, chunk_size)


def offers_of(legs: Sequence[Sequence[Group]]
              ) -> tuple[Offers, list[Hashable], list[int]]:
    """Plain groups as `Offers`, with each chunk's hash and stored offset (chunk ids by
    hash: a hash two legs name is one chunk). For callers holding plain data (tests,
    benchmarks, LMCache's default reply); hot paths build columns directly."""
    entry_leg, position_start, positions, chunk_start = [], [0], [], [0]
    places, hashes, offsets = [], [], []
    for leg_index, leg in enumerate(legs):
        for group_positions, place, chunks in leg:
            entry_leg.append(leg_index)
            positions.extend(group_positions)
            position_start.append(len(positions))
            for chunk_hash, old_st in chunks:
                hashes.append(chunk_hash)
                offsets.append(old_st)
                places.append(int(place))
            chunk_start.append(len(hashes))
    ids: dict = {}
    chunk_id = [ids.setdefault(chunk_hash, len(ids)) for chunk_hash in hashes]
    as_int = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
    return Offers(as_int(entry_leg), as_int(position_start), as_int(positions),
                  as_int(chunk_start), as_int(places), as_int(chunk_id),
                  len(legs)), hashes, offsets


def select_offers(legs: Sequence[Sequence[Group]], prefix_tokens: int, chunk_size: int, *,
                  available: Collection[Hashable] | None = None) -> list[Kept]:
    """`select` on plain groups: what it keeps, ascending by position, as `Kept` tuples.
    `available`, when given, limits the chunks to those hashes."""
    offers, hashes, offsets = offers_of(legs)
    chunk_ok = None if available is None else np.fromiter(
        (chunk_hash in available for chunk_hash in hashes), dtype=np.uint8, count=len(hashes))
    kept_pos, kept_chunk = select(offers, prefix_tokens, chunk_size, chunk_ok)
    legs_of = offers.chunk_leg()
    return [(position, hashes[c], offsets[c], int(offers.chunk_place[c]), int(legs_of[c]))
            for position, c in zip(kept_pos.tolist(), kept_chunk.tolist())]
