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
