"""Selecting what a unified lookup prefetches, from both legs' candidates. Pure functions.

Both legs hand over the candidates form, `FoundContent`: per content found, every query
position where it occurs and the chunks that hold it, each with its `Place`. The rule is
selection after merging, assignment after selection (docs/DESIGN.md, "Unified lookup"):

1. merge: every position either leg found, with every chunk either leg offers there (a chunk
   both legs name is one chunk, at the cheaper of its places);
2. drop every position inside the prefix coverage (already reused, and it must not shadow a
   usable position that overlaps it);
3. one ascending pass over the positions: keep a position when it starts at or after the end
   of the last kept one and some chunk offered there is still unused, and give it the
   cheapest unused one (`Place` order; on a tie the local leg's, then the order the leg
   named them). Each chunk hash serves at most one position of a result.

No chunk is spent on a position the pass drops, so a content that occurs twice (overlapping
retrieved passages) is reused at whichever occurrence the selection keeps. With equal-length
chunks leftmost-greedy keeps the most positions when every position has a chunk to spare;
when a content has fewer chunks than occurrences a greedy pass can keep fewer than the best
choice, so the union's selection is compared with each leg's alone and the one covering most
wins: the union is never worse than either leg. Results ascend by `cur_st`, never overlap.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from plugin.types import CBMatchResult, ChunkOffer, FoundContent, Source


class Candidate(NamedTuple):
    """A segment to blend in, and which leg(s) offered its chunk."""

    segment: CBMatchResult
    source: Source


def select(local: Sequence[FoundContent], fleet: Sequence[FoundContent],
           prefix_coverage_tokens: int, chunk_size: int, *,
           available: frozenset[bytes] | set[bytes] | None = None) -> list[Candidate]:
    """The segments to reuse: steps 1-3 of the module doc, the best of union and legs.

    `available`, when given, limits the offers to those chunk hashes (the ones a prefetch of
    every offered chunk found)."""
    local_hashes = _hashes(local)
    fleet_hashes = _hashes(fleet)
    best = _assign(_positions(local, fleet, prefix_coverage_tokens, available), chunk_size)
    if local and fleet:
        for leg in (fleet, local):
            alone = _assign(_positions(leg, (), prefix_coverage_tokens, available), chunk_size)
            if len(alone) > len(best):
                best = alone
    return [Candidate(CBMatchResult(offer.old_st, offer.old_st + chunk_size, position,
                                    position + chunk_size, offer.chunk_hash),
                      _source(offer.chunk_hash, local_hashes, fleet_hashes))
            for position, offer in best]


def every_offer(local: Sequence[FoundContent], fleet: Sequence[FoundContent],
                prefix_coverage_tokens: int, chunk_size: int) -> list[CBMatchResult]:
    """One segment per distinct chunk offered at a usable position (its first such one):
    what a prefetch loads when overlaps are resolved among the chunks it found
    (`PluginConfig.resolve_after_prefetch`)."""
    segments: dict[bytes, CBMatchResult] = {}
    for position, offer_lists in sorted(
            _positions(local, fleet, prefix_coverage_tokens, None).items()):
        for offers in offer_lists:
            for offer in offers:
                if offer.chunk_hash not in segments:
                    segments[offer.chunk_hash] = CBMatchResult(
                        offer.old_st, offer.old_st + chunk_size, position,
                        position + chunk_size, offer.chunk_hash)
    return list(segments.values())


def _positions(first: Sequence[FoundContent], second: Sequence[FoundContent],
               prefix_coverage_tokens: int, available) -> dict[int, list]:
    """Steps 1 and 2: position -> the offer tuples of every content found there."""
    offers_at: dict[int, list] = {}
    for leg in (first, second):
        for found in leg:
            offers = found.offers
            if available is not None:
                offers = tuple(o for o in offers if o.chunk_hash in available)
            if not offers:
                continue
            for position in found.positions:
                if position >= prefix_coverage_tokens:
                    at = offers_at.get(position)
                    if at is None:
                        offers_at[position] = [offers]
                    else:
                        at.append(offers)
    return offers_at


def _assign(offers_at: dict[int, list], chunk_size: int) -> list[tuple[int, ChunkOffer]]:
    """Step 3: the leftmost-greedy pass, each chunk at most once, cheapest first."""
    kept: list[tuple[int, ChunkOffer]] = []
    used: set[bytes] = set()
    end = None
    for position in sorted(offers_at):
        if end is not None and position < end:
            continue
        best = None
        for offers in offers_at[position]:
            for offer in offers:
                if offer.chunk_hash not in used and (best is None or offer.place < best.place):
                    best = offer
        if best is not None:
            kept.append((position, best))
            used.add(best.chunk_hash)
            end = position + chunk_size
    return kept


def _hashes(leg: Sequence[FoundContent]) -> set[bytes]:
    return {offer.chunk_hash for found in leg for offer in found.offers}


def _source(chunk_hash: bytes, local: set[bytes], fleet: set[bytes]) -> Source:
    if chunk_hash in local:
        return Source.BOTH if chunk_hash in fleet else Source.LOCAL
    return Source.FLEET
