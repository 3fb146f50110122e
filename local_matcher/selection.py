"""The selection rule of a unified lookup, on plain data: candidates in, kept positions out.

One rule, two users: the plugin selects what a serving process prefetches
(`plugin.lookup.select`), and the coordinator scores, per instance, what that instance's
lookup would select (`POST /directory/blend-score`). Both call this module, so a router's
score and a server's reuse cannot drift apart. It loads nothing but the standard library.

Input: legs, each a sequence of *groups*, a group being `(positions, place, chunks)`: every
query position where one content occurs (ascending), where its `chunks` are held, and those
chunks as `(chunk_hash, old_st)` in the order the leg named them. `place` is an int, the
lower the cheaper (the plugin's `Place`: 0 this server's L1, 1 a shared tier, 2 a peer's L1);
a content whose chunks are held in several places is one group per place.
`plugin.types.FoundContent` has that shape and passes as it is.

The rule (docs/DESIGN.md, "Unified lookup"):

1. merge: every position any leg found, with every chunk any leg offers there;
2. drop every position inside the prefix coverage (already reused, and it must not shadow a
   usable position that overlaps it);
3. one ascending pass over the positions: keep a position when it starts at or after the end
   of the last kept one and some chunk offered there is still unused, and give it the
   cheapest unused one (lowest `place`; on a tie the first leg's, then the order the leg
   named them). Each chunk hash serves at most one position of a result.

Greedy with fewer chunks than occurrences can keep fewer positions than the best choice. So
when the union's pass skipped a position for want of an unused chunk, each leg's selection
alone is computed too and the one keeping the most positions wins (the union on a tie): the
union is never worse than either leg. A pass that never went short is plain leftmost-greedy
over the union's positions, the most non-overlapping positions there are, so no leg can
beat it and none is tried.
"""

from __future__ import annotations

from typing import Collection, Hashable, Sequence

#: `(positions, place, ((chunk_hash, old_st), ...))`.
Group = tuple[Sequence[int], int, Sequence[tuple[Hashable, int]]]
#: What a selection keeps: `(position, chunk_hash, old_st, place, leg index)`.
Kept = tuple[int, Hashable, int, int, int]

_NO_PLACE = 1 << 30  # above every place


def select_offers(legs: Sequence[Sequence[Group]], prefix_tokens: int, chunk_size: int, *,
                  available: Collection[Hashable] | None = None) -> list[Kept]:
    """What steps 1-3 keep, ascending by position, the best of the union and each leg.

    `available`, when given, limits the chunks to those hashes."""
    kept, starved = _assign(groups_by_position(legs, prefix_tokens, available), chunk_size)
    if starved and sum(1 for leg in legs if leg) > 1:
        for index, leg in enumerate(legs):
            if leg:
                alone, _ = _assign(groups_by_position(
                    [leg if i == index else () for i in range(len(legs))], prefix_tokens,
                    available), chunk_size)
                if len(alone) > len(kept):
                    kept = alone
    return kept


def groups_by_position(legs: Sequence[Sequence[Group]], prefix_tokens: int,
                       available: Collection[Hashable] | None = None
                       ) -> dict[int, list[tuple[int, Sequence[tuple[Hashable, int]], int]]]:
    """Steps 1 and 2: position -> `(place, chunks, leg index)` of every group found there,
    the first leg's first."""
    at: dict[int, list] = {}
    for index, leg in enumerate(legs):
        for positions, place, chunks in leg:
            if available is not None:
                chunks = tuple(c for c in chunks if c[0] in available)
            if not chunks:
                continue
            entry = (place, chunks, index)
            for position in positions:
                if position >= prefix_tokens:
                    here = at.get(position)
                    if here is None:
                        at[position] = [entry]
                    else:
                        here.append(entry)
    return at


def _assign(at: dict[int, list], chunk_size: int) -> tuple[list[Kept], bool]:
    """Step 3, the leftmost-greedy pass; and whether it skipped a non-overlapping position
    because every chunk offered there was used."""
    kept: list[Kept] = []
    used: set = set()
    end, starved = 0, False
    for position in sorted(at):
        if position < end:
            continue
        best, best_place, best_leg = None, _NO_PLACE, 0
        for place, chunks, leg in at[position]:
            if place < best_place:
                for chunk in chunks:
                    if chunk[0] not in used:
                        best, best_place, best_leg = chunk, place, leg
                        break
        if best is None:
            starved = True
            continue
        kept.append((position, best[0], best[1], best_place, best_leg))
        used.add(best[0])
        end = position + chunk_size
    return kept, starved
