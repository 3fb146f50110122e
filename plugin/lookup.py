"""Selecting what a unified lookup prefetches, from both legs' candidates. Pure functions.

The rule itself lives in `local_matcher.selection` (plain data, shared with the
coordinator's per-instance score); this module is the plugin's wrapper: its types in,
`Candidate` segments (with the leg that offered each) out.

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

from local_matcher.selection import offers_by_position, select_offers
from plugin.types import CBMatchResult, FoundContent, Source


class Candidate(NamedTuple):
    """A segment to blend in, and which leg(s) offered its chunk."""

    segment: CBMatchResult
    source: Source


def select(local: Sequence[FoundContent], fleet: Sequence[FoundContent],
           prefix_coverage_tokens: int, chunk_size: int, *,
           available: frozenset[bytes] | set[bytes] | None = None) -> list[Candidate]:
    """The segments to reuse: steps 1-3 of the module doc, the best of union and legs
    (`local_matcher.selection.select_offers`, the local leg first).

    `available`, when given, limits the offers to those chunk hashes (the ones a prefetch of
    every offered chunk found)."""
    local_hashes = _hashes(local)
    fleet_hashes = _hashes(fleet)
    kept = select_offers((local, fleet), prefix_coverage_tokens, chunk_size,
                         available=available)
    return [Candidate(CBMatchResult(offer.old_st, offer.old_st + chunk_size, position,
                                    position + chunk_size, offer.chunk_hash),
                      _source(offer.chunk_hash, local_hashes, fleet_hashes))
            for position, offer in kept]


def every_offer(local: Sequence[FoundContent], fleet: Sequence[FoundContent],
                prefix_coverage_tokens: int, chunk_size: int) -> list[CBMatchResult]:
    """One segment per distinct chunk offered at a usable position (its first such one):
    what a prefetch loads when overlaps are resolved among the chunks it found
    (`PluginConfig.resolve_after_prefetch`)."""
    segments: dict[bytes, CBMatchResult] = {}
    for position, offer_lists in sorted(
            offers_by_position((local, fleet), prefix_coverage_tokens).items()):
        for offers in offer_lists:
            for offer in offers:
                if offer.chunk_hash not in segments:
                    segments[offer.chunk_hash] = CBMatchResult(
                        offer.old_st, offer.old_st + chunk_size, position,
                        position + chunk_size, offer.chunk_hash)
    return list(segments.values())


def _hashes(leg: Sequence[FoundContent]) -> set[bytes]:
    return {offer.chunk_hash for found in leg for offer in found.offers}


def _source(chunk_hash: bytes, local: set[bytes], fleet: set[bytes]) -> Source:
    if chunk_hash in local:
        return Source.BOTH if chunk_hash in fleet else Source.LOCAL
    return Source.FLEET
