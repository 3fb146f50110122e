"""Selecting what a unified lookup prefetches, from both legs' candidates. Pure functions.

The rest of its contract: docs/CONTRACTS.md, `plugin.lookup`.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from local_matcher.selection import groups_by_position, select_offers
from plugin.types import CBMatchResult, FoundContent, Source

_SOURCES = (Source.LOCAL, Source.FLEET)  # by leg index


class Candidate(NamedTuple):
    """A segment to blend in, and which leg(s) offered its chunk."""

    segment: CBMatchResult
    source: Source


def select(local: Sequence[FoundContent], fleet: Sequence[FoundContent],
           prefix_coverage_tokens: int, chunk_size: int, *,
           available: frozenset[bytes] | set[bytes] | None = None) -> list[Candidate]:
    """The segments to reuse: steps 1-3 of the module doc, the best of union and legs
    (`local_matcher.selection.select_offers`, the local leg first).

    `available`, when given, limits the chunks to those hashes (the ones a prefetch of
    every offered chunk found)."""
    kept = select_offers((local, fleet), prefix_coverage_tokens, chunk_size,
                         available=available)
    both = _named_by_both(local, fleet) if local and fleet else ()
    return [Candidate(CBMatchResult(old_st, old_st + chunk_size, position,
                                    position + chunk_size, chunk_hash),
                      Source.BOTH if chunk_hash in both else _SOURCES[leg])
            for position, chunk_hash, old_st, _, leg in kept]


def every_offer(local: Sequence[FoundContent], fleet: Sequence[FoundContent],
                prefix_coverage_tokens: int, chunk_size: int) -> list[CBMatchResult]:
    """One segment per distinct chunk offered at a usable position (its first such one):
    what a prefetch loads when overlaps are resolved among the chunks it found
    (`PluginConfig.resolve_after_prefetch`)."""
    segments: dict[bytes, CBMatchResult] = {}
    at = groups_by_position((local, fleet), prefix_coverage_tokens)
    for position in sorted(at):
        for _, chunks, _ in at[position]:
            for chunk_hash, old_st in chunks:
                if chunk_hash not in segments:
                    segments[chunk_hash] = CBMatchResult(
                        old_st, old_st + chunk_size, position, position + chunk_size,
                        chunk_hash)
    return list(segments.values())


def _named_by_both(local: Sequence[FoundContent], fleet: Sequence[FoundContent]) -> set[bytes]:
    mine = {chunk[0] for found in local for chunk in found.chunks}
    return {chunk[0] for found in fleet for chunk in found.chunks if chunk[0] in mine}
