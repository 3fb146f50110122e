"""The selection rule written the plain way, in Python, as the reference the kernel
(`local_matcher.selection`) is tested against (tests/matcher/test_selection_kernel.py): the rule's
first implementation, kept only here. Steps as docs/DESIGN.md, "Plugin", states them."""

from __future__ import annotations

from typing import Collection, Hashable, Sequence

_NO_PLACE = 1 << 30  # above every place


def select_offers(legs: Sequence[Sequence], prefix_tokens: int, chunk_size: int, *,
                  available: Collection[Hashable] | None = None) -> list[tuple]:
    """What steps 1-3 keep, ascending by position, the best of the union and each leg."""
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


def groups_by_position(legs, prefix_tokens, available=None) -> dict[int, list]:
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
                    at.setdefault(position, []).append(entry)
    return at


def _assign(at: dict[int, list], chunk_size: int) -> tuple[list, bool]:
    """Step 3, the leftmost-greedy pass; and whether it skipped a non-overlapping position
    because every chunk offered there was used."""
    kept: list = []
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
