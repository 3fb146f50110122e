"""Merging the two legs of a unified lookup into segments to prefetch. Pure functions.

Order matters and is the contract (DESIGN.md, "Unified lookup"):
1. union of the local matches and the coordinator's, the latter turned into `CBMatchResult`s
   with `old_ed = old_st + C`, `cur_ed = cur_st + C`;
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

from plugin.types import BlendMatch, CBMatchResult

LOCAL, FLEET, BOTH = "local", "fleet", "both"


class Candidate(NamedTuple):
    """A segment that could be blended in, and which leg(s) reported it."""

    segment: CBMatchResult
    source: str  # LOCAL, FLEET or BOTH


def merge_candidates(local: Iterable[CBMatchResult], fleet: Iterable[BlendMatch],
                     prefix_coverage_tokens: int, chunk_size: int) -> list[Candidate]:
    """Steps 1-3: the usable candidates, ascending by `cur_st`, possibly overlapping."""
    by_hash: dict[Hashable, Candidate] = {}
    union = [Candidate(s, LOCAL) for s in local]
    union += [Candidate(CBMatchResult.from_match(m, chunk_size), FLEET) for m in fleet]
    for candidate in union:
        segment = candidate.segment
        if segment.cur_st < prefix_coverage_tokens:
            continue  # inside the prefix: already reused, and must not shadow anything
        seen = by_hash.get(segment.hash)
        if seen is None:
            by_hash[segment.hash] = candidate
        elif seen.source != candidate.source and seen.source != BOTH:
            # Reported by both legs: keep one, at the earlier position (local on a tie).
            keep = seen if (seen.segment.cur_st, seen.source != LOCAL) <= (
                segment.cur_st, candidate.source != LOCAL) else candidate
            by_hash[segment.hash] = Candidate(keep.segment, BOTH)
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
    return (s.cur_st, s.cur_ed, candidate.source == FLEET, repr(s.hash))
