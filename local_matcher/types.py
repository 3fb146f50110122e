"""Match result types shared by the local matcher, the coordinator and the plugin.

`BlendMatch` is what a content index reports: one stored chunk found in a query.
`CBMatchResult` is what a serving process prefetches: the same chunk as two
half-open token ranges, where it was stored (`old_st..old_ed`) and where it sits
now (`cur_st..cur_ed`), with `ed = st + chunk_size`.
"""

from __future__ import annotations

from typing import Hashable, NamedTuple

#: `old_st` of a chunk whose stored position was never reported; never read as 0.
UNKNOWN_TOKEN_OFFSET = -1

#: Token ids are uint32 everywhere: in the index, on the wire.
MAX_TOKEN_ID = 2**32 - 1


class BlendMatch(NamedTuple):
    """A stored chunk found in a query: its hash, stored start and query start."""

    chunk_hash: Hashable
    old_st: int
    cur_st: int


class CBMatchResult(NamedTuple):
    """One reusable segment: stored range `[old_st, old_ed)` found at `[cur_st, cur_ed)`."""

    old_st: int
    old_ed: int
    cur_st: int
    cur_ed: int
    hash: Hashable

    @classmethod
    def from_match(cls, match: BlendMatch, chunk_size: int) -> "CBMatchResult":
        return cls(
            match.old_st,
            match.old_st + chunk_size,
            match.cur_st,
            match.cur_st + chunk_size,
            match.chunk_hash,
        )


#: The candidates form names, per content, at most this many chunks beyond one per
#: position it occurs at (so a caller preferring some placements has a choice), and at most
#: `MAX_CANDIDATE_CHUNKS` in all. A chunk can serve one position of a result, so more than
#: one per position is only ever a choice, never more reuse.
CANDIDATE_SPARE_CHUNKS = 4
MAX_CANDIDATE_CHUNKS = 64


class ContentCandidates(NamedTuple):
    """One stored content found in a query, in the candidates form of a lookup.

    `positions`: every query position where the content occurs, verified token by token,
    ascending. `chunks`: `(chunk_hash, old_st)` of chunks holding it that the requester's
    namespace claims, first indexed first (LMCache's order), at most
    `min(len(positions) + CANDIDATE_SPARE_CHUNKS, MAX_CANDIDATE_CHUNKS)`.
    """

    positions: tuple[int, ...]
    chunks: tuple[tuple[Hashable, int], ...]
