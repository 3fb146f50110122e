"""Selecting what a unified lookup prefetches, from both legs' candidates (columns in,
segments out; the rule itself is `local_matcher.selection`'s kernel).

The rule itself lives in `local_matcher.selection` (a numba kernel over columns, shared
with the coordinator's per-instance score); this module is the plugin's wrapper: its types
in, `Candidate` segments (with the leg that offered each) out; Python objects are made only
for the segments kept.

Both legs hand over the candidates form as columns, `FoundColumns`: per content found,
every query position where it occurs and the chunks that hold it, with where they are held
(`Place`), in CSR arrays (a leg given as `FoundContent`s, plain data, is converted first).
The rule is selection after merging, assignment after selection (docs/DESIGN.md, "Plugin"):

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
choice, so when the union's pass went short of chunks it is compared with each leg's alone
and the one covering most wins: the union is never worse than either leg. Results ascend
by `cur_st` and never overlap.
"""

from __future__ import annotations

from itertools import repeat
from typing import NamedTuple, Sequence

import numpy as np

from local_matcher import selection
from plugin.types import CBMatchResult, FoundColumns, FoundContent, Place, Source

_SOURCE_CODES = (Source.LOCAL, Source.FLEET, Source.BOTH)  # by leg index, 2: both legs


class Candidate(NamedTuple):
    """A segment to blend in, and which leg(s) offered its chunk."""

    segment: CBMatchResult
    source: Source


Leg = FoundColumns | Sequence[FoundContent]


def select(local: Leg, fleet: Leg, prefix_coverage_tokens: int,
           chunk_size: int, *, available: frozenset[bytes] | set[bytes] | None = None
           ) -> list[Candidate]:
    """The segments to reuse: steps 1-3 of the module doc, the best
    of union and legs (`local_matcher.selection.select`, the local leg first). Python
    objects are made only for the segments kept.

    `available`, when given, limits the chunks to those hashes (the ones a prefetch of
    every offered chunk found). A leg given as `FoundContent`s (plain data) is
    converted first."""
    local, fleet = columns_of(local), columns_of(fleet)
    offers, hashes, offsets = selection.merged((local, fleet))
    chunk_ok = None if available is None else np.fromiter(
        map(available.__contains__, hashes), dtype=np.uint8, count=len(hashes))
    kept_pos, kept_chunk = selection.select(offers, prefix_coverage_tokens, chunk_size,
                                            chunk_ok)
    if not kept_pos.size:
        return []
    local_chunks = len(local.old_st)
    both = _named_by_both(offers.chunk_id, local_chunks)
    source = (kept_chunk >= local_chunks).astype(np.int64)
    if both is not None:
        source[both[offers.chunk_id[kept_chunk]]] = 2
    old_st, kept = offsets[kept_chunk], kept_chunk.tolist()
    # One segment and one candidate per kept chunk, made in C: `tuple.__new__` is what a
    # NamedTuple's `_make` calls, without a Python call per segment (chunk 32 keeps ~180
    # of a RAG prompt, and their making was most of this function's time).
    segments = map(tuple.__new__, repeat(CBMatchResult), zip(
        old_st.tolist(), (old_st + chunk_size).tolist(), kept_pos.tolist(),
        (kept_pos + chunk_size).tolist(), map(hashes.__getitem__, kept)))
    return list(map(tuple.__new__, repeat(Candidate), zip(
        segments, map(_SOURCE_CODES.__getitem__, source.tolist()))))


def every_offer(local: Leg, fleet: Leg, prefix_coverage_tokens: int,
                chunk_size: int) -> list[CBMatchResult]:
    """One segment per distinct chunk offered at a usable position (its first such one):
    what a prefetch loads when overlaps are resolved among the chunks it found
    (`PluginConfig.resolve_after_prefetch`)."""
    offers, hashes, offsets = selection.merged((columns_of(local), columns_of(fleet)))
    positions, chunks = selection.first_offers(offers, prefix_coverage_tokens)
    return [CBMatchResult(old_st, old_st + chunk_size, position, position + chunk_size,
                          hashes[c])
            for position, c, old_st in zip(positions.tolist(), chunks.tolist(),
                                           offsets[chunks].tolist())]


def columns_of(leg: Leg) -> FoundColumns:
    """A leg as columns (`FoundContent`s converted: plain data, tests and LMCache's reply)."""
    return leg if type(leg) is FoundColumns else FoundColumns.of_groups(leg)


def found_contents(leg: FoundColumns) -> list[FoundContent]:
    """A leg as `FoundContent`s, one per content and place (plain data, for tests)."""
    return [FoundContent(positions, Place(place), chunks)
            for positions, place, chunks in leg.groups()]


def _named_by_both(chunk_id: np.ndarray, local_chunks: int) -> np.ndarray | None:
    """Per chunk id, whether both legs name it (None: one leg names nothing)."""
    if not local_chunks or local_chunks == len(chunk_id):
        return None
    size = int(chunk_id.max()) + 1
    in_local = np.zeros(size, dtype=bool)
    in_local[chunk_id[:local_chunks]] = True
    in_fleet = np.zeros(size, dtype=bool)
    in_fleet[chunk_id[local_chunks:]] = True
    return in_local & in_fleet
