"""The selection rule of a unified lookup, on plain data: candidates in, kept positions out.

One rule, two users: the plugin's `plugin.lookup.select` (what a server prefetches) and the
coordinator's blend score per instance (what that instance's lookup would select), so a
router's score and a server's reuse cannot drift apart. Standard library only.

Input: legs, each a sequence of groups `(positions, place, chunks)`: the ascending query
positions where one content occurs, where its chunks are held (an int, the lower the
cheaper: the plugin's `Place`; one group per place), and those chunks as `(chunk_hash,
old_st)` in the order the leg named them. `plugin.types.FoundContent` has that shape.

The rule: merge the legs, drop positions inside the prefix, then one ascending pass keeps a
position starting at or after the end of the last kept one and gives it the cheapest unused
chunk (ties: the first leg's, then the leg's order); when that pass went short of chunks,
each leg alone is selected too and the most positions win (the union on a tie).
docs/DESIGN.md, "Plugin", says why.
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
