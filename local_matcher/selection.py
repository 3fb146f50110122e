"""The selection rule of a unified lookup, on plain data: candidates in, kept positions out.

One rule, two users: the plugin selects what a serving process prefetches
(`plugin.lookup.select`), and the coordinator scores, per instance, what that instance's
lookup would select (`POST /directory/blend-score`). Both call this module, so a router's
score and a server's reuse cannot drift apart. It loads nothing but the standard library.

Input: legs, each a sequence of *contents*, a content being a pair `(positions, offers)`:
every query position where it occurs (ascending) and the chunks holding it, each offer a
triple `(chunk_hash, old_st, place)` in the order the leg named them. `place` is an int,
the lower the cheaper (the plugin's `Place`: 0 this server's L1, 1 a shared tier, 2 a peer's
L1). Named tuples of that shape (`plugin.types.FoundContent` / `ChunkOffer`) pass as they are.

The rule (docs/DESIGN.md, "Unified lookup"):

1. merge: every position any leg found, with every offer any leg makes there;
2. drop every position inside the prefix coverage (already reused, and it must not shadow a
   usable position that overlaps it);
3. one ascending pass over the positions: keep a position when it starts at or after the end
   of the last kept one and some chunk offered there is still unused, and give it the
   cheapest unused one (lowest `place`; on a tie the first leg's, then the order the leg
   named them). Each chunk hash serves at most one position of a result.

With more than one leg, each leg's selection alone is computed too and the one keeping the
most positions wins (the union on a tie, then the later leg) (greedy with fewer chunks than occurrences can keep fewer than the best
choice): the union is never worse than either leg.
"""

from __future__ import annotations

from typing import Collection, Hashable, Sequence

#: `(chunk_hash, old_st, place)`.
Offer = tuple[Hashable, int, int]
#: `(positions, offers)`.
Content = tuple[Sequence[int], Sequence[Offer]]


def select_offers(legs: Sequence[Sequence[Content]], prefix_tokens: int, chunk_size: int, *,
                  available: Collection[Hashable] | None = None) -> list[tuple[int, Offer]]:
    """`(position, offer)` kept by steps 1-3, ascending, the best of the union and each leg.

    `available`, when given, limits the offers to those chunk hashes."""
    legs = [leg for leg in legs if leg]
    best = assign(offers_by_position(legs, prefix_tokens, available), chunk_size)
    if len(legs) > 1:
        for leg in reversed(legs):  # on a tie with the union's, the last leg's first
            alone = assign(offers_by_position((leg,), prefix_tokens, available), chunk_size)
            if len(alone) > len(best):
                best = alone
    return best


def offers_by_position(legs: Sequence[Sequence[Content]], prefix_tokens: int,
                       available: Collection[Hashable] | None = None
                       ) -> dict[int, list[Sequence[Offer]]]:
    """Steps 1 and 2: position -> the offer sequences of every content found there."""
    offers_at: dict[int, list] = {}
    for leg in legs:
        for positions, offers in leg:
            if available is not None:
                offers = tuple(o for o in offers if o[0] in available)
            if not offers:
                continue
            for position in positions:
                if position >= prefix_tokens:
                    at = offers_at.get(position)
                    if at is None:
                        offers_at[position] = [offers]
                    else:
                        at.append(offers)
    return offers_at


def assign(offers_at: dict[int, list[Sequence[Offer]]], chunk_size: int
           ) -> list[tuple[int, Offer]]:
    """Step 3: the leftmost-greedy pass, each chunk at most once, cheapest first."""
    kept: list[tuple[int, Offer]] = []
    used: set = set()
    end = None
    for position in sorted(offers_at):
        if end is not None and position < end:
            continue
        best = None
        for offers in offers_at[position]:
            for offer in offers:
                if offer[0] not in used and (best is None or offer[2] < best[2]):
                    best = offer
        if best is not None:
            kept.append((position, best))
            used.add(best[0])
            end = position + chunk_size
    return kept
