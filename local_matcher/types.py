"""Match result types shared by the local matcher, the coordinator and the plugin.

`BlendMatch` is what a content index reports: one stored chunk found in a query.
`CBMatchResult` is what a serving process prefetches: the same chunk as two
half-open token ranges, where it was stored (`old_st..old_ed`) and where it sits
now (`cur_st..cur_ed`), with `ed = st + chunk_size`.
"""

from __future__ import annotations

from typing import Hashable, NamedTuple, Sequence

import numpy as np

# The wire's values (UNKNOWN_TOKEN_OFFSET: an `old_st` never reported; the candidates
# form's limits), owned by blend_wire.
from blend_wire.values import (CANDIDATE_SPARE_CHUNKS, MAX_CANDIDATE_CHUNKS,
                               MAX_CANDIDATE_POSITIONS, MAX_REPLY_ENTRIES, UNKNOWN_TOKEN_OFFSET)


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


class ContentCandidates(NamedTuple):
    """One stored content found in a query, in the candidates form of a lookup.

    `positions`: every query position where the content occurs, verified token by token,
    ascending (at most `MAX_CANDIDATE_POSITIONS`, the leftmost: WIRE.md, "Limits"). `chunks`: `(chunk_hash, old_st)` of chunks holding it that the requester's
    namespace claims, first indexed first (LMCache's order), at most
    `min(len(positions) + CANDIDATE_SPARE_CHUNKS, MAX_CANDIDATE_CHUNKS)`.
    """

    positions: tuple[int, ...]
    chunks: tuple[tuple[Hashable, int], ...]


class CandidateColumns(NamedTuple):
    """The candidates form of a lookup as columns: `ContentCandidates` of every content
    found, in order of first position, without a Python object per content or chunk.

    Content i's positions are ``positions[position_start[i]:position_start[i + 1]]``
    (ascending) and its chunks ``chunk_start[i]:chunk_start[i + 1]`` of the per-chunk
    columns: `old_st` and `chunk_hashes` (the index's own hash objects, first indexed
    first). `truncated`: a limit cut positions or contents (WIRE.md, "Limits"). `slots`:
    each chunk's claim slot (`ContentIndex.only_claim_slots`) as of the lookup, for a
    caller that keeps data by slot (None where not known)."""

    position_start: np.ndarray
    positions: np.ndarray
    chunk_start: np.ndarray
    old_st: np.ndarray
    chunk_hashes: Sequence[Hashable]
    truncated: bool = False
    slots: np.ndarray | None = None

    @property
    def num_contents(self) -> int:
        return len(self.position_start) - 1

    def as_contents(self) -> list[ContentCandidates]:
        """One `ContentCandidates` per content (plain data, for cold callers and tests)."""
        positions, offsets = self.positions.tolist(), self.old_st.tolist()
        pos, chunks = self.position_start.tolist(), self.chunk_start.tolist()
        return [ContentCandidates(tuple(positions[pos[i]:pos[i + 1]]), tuple(zip(
                    self.chunk_hashes[chunks[i]:chunks[i + 1]], offsets[chunks[i]:chunks[i + 1]])))
                for i in range(self.num_contents)]


EMPTY_COLUMNS = CandidateColumns(np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64),
                                 np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64), ())
