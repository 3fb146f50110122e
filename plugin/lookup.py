"""Merging the two legs of a unified lookup into segments to prefetch. Pure functions.

Both legs hand over the same shape, `CBMatchResult` (the local matcher and the coordinator
client each build it where their matches enter), so merging converts nothing.

Order matters and is the contract (DESIGN.md, "Unified lookup"):
1. union of the local matches and the coordinator's;
2. drop every match that starts inside the prefix coverage, *before* resolving overlaps, so a
   prefix-covered match cannot shadow a usable one that overlaps it;
3. collapse a chunk both sources report into one candidate (the local one wins a tie: its
   position is first-hand);
4. resolve overlaps leftmost-greedy: ascending `cur_st`, keep a candidate when it starts at or
   after the end of the last kept one. For equal-length chunks this maximises coverage.
Results are ascending by `cur_st` and never overlap.
"""

from __future__ import annotations

from typing import Hashable, Iterable, NamedTuple, Sequence

from plugin.types import CBMatchResult, Source


class Candidate(NamedTuple):
    """A segment that could be blended in, and which leg(s) reported it."""

    segment: CBMatchResult
    source: Source


def merge_candidates(local: Iterable[CBMatchResult], fleet: Iterable[CBMatchResult],
                     prefix_coverage_tokens: int) -> list[Candidate]:
    """Steps 1-3: the usable candidates, ascending by `cur_st`, possibly overlapping."""
    by_hash: dict[Hashable, Candidate] = {}
    union = [Candidate(s, Source.LOCAL) for s in local]
    union += [Candidate(s, Source.FLEET) for s in fleet]
    for candidate in union:
        segment = candidate.segment
        if segment.cur_st < prefix_coverage_tokens:
            continue  # inside the prefix: already reused, and must not shadow anything
        seen = by_hash.get(segment.hash)
        if seen is None:
            by_hash[segment.hash] = candidate
        elif seen.source is not candidate.source and seen.source is not Source.BOTH:
            # Reported by both legs: keep one, at the earlier position (local on a tie).
            keep = seen if (seen.segment.cur_st, seen.source is not Source.LOCAL) <= (
                segment.cur_st, candidate.source is not Source.LOCAL) else candidate
            by_hash[segment.hash] = Candidate(keep.segment, Source.BOTH)
    return sorted(by_hash.values(), key=_order)


def resolve_overlaps(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Step 4: leftmost-greedy over candidates; ascending and non-overlapping."""
    kept: list[Candidate] = []
    end = None
    for candidate in sorted(candidates, key=_order):
        if end is None or candidate.segment.cur_st >= end:
            kept.append(candidate)
            end = candidate.segment.cur_ed
    return kept


def _order(candidate: Candidate) -> tuple:
    # Earliest start first; on a tie the shorter segment (frees the query sooner), then a
    # first-hand local one, then the hash's repr for a deterministic order.
    s = candidate.segment
    return (s.cur_st, s.cur_ed, candidate.source is Source.FLEET, repr(s.hash))
