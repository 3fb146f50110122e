"""The candidates form's limits (docs/WIRE.md, "Limits"): what a cut reply keeps.

Against the uncut reply of the same index (limits lifted): a cut keeps, per content, the
leftmost positions, and in all every occurrence left of one query position, the furthest
that fits; `truncated` is set exactly when something was left out.
"""

from __future__ import annotations

import numpy as np
import pytest

from blend_wire import MAX_CANDIDATE_CHUNKS, MAX_CANDIDATE_POSITIONS, MAX_REPLY_ENTRIES
from local_matcher.index import ContentIndex

LANE = "unit"

CHUNK = 4
UNCUT = {"max_positions": 1 << 30, "max_entries": 1 << 30}


def _index(contents: list[np.ndarray], chunks_each: int = 2) -> ContentIndex:
    index = ContentIndex(CHUNK, fingerprint_key=(3, 5))
    for c, tokens in enumerate(contents):
        for k in range(chunks_each):
            index.add(tokens, f"c{c}-{k}", 100 * k, "ns")
    return index


def _occurrences(columns) -> list[tuple[int, int, tuple]]:
    """(position, content's first position, its chunks) of every listed occurrence."""
    found = []
    for content in columns.as_contents():
        found += [(p, content.positions[0], content.chunks) for p in content.positions]
    return sorted(found)


def test_limits_are_the_documented_ones():
    assert (MAX_CANDIDATE_POSITIONS, MAX_REPLY_ENTRIES, MAX_CANDIDATE_CHUNKS) == (1024, 32768, 64)


def test_a_content_repeated_past_the_cap_keeps_its_leftmost_positions():
    repeated = np.full(CHUNK, 7, dtype=np.uint32)
    other = np.arange(CHUNK, dtype=np.uint32) + 100
    index = _index([repeated, other])
    query = np.concatenate([np.full(3000, 7, dtype=np.uint32), other,
                            np.full(50, 7, dtype=np.uint32)])
    cut = index.candidate_columns(query, "ns")
    assert cut.truncated
    first, second = cut.as_contents()
    assert first.positions == tuple(range(MAX_CANDIDATE_POSITIONS))
    assert second.positions == (3000,)  # another content keeps its own
    assert len(first.chunks) == 2 and len(second.chunks) == 2
    whole = index.candidate_columns(query, "ns", **UNCUT)
    assert not whole.truncated and len(whole.as_contents()[0].positions) > 3000
    # Exactly at the cap: nothing left out, nothing said.
    exact = np.full(MAX_CANDIDATE_POSITIONS + CHUNK - 1, 7, dtype=np.uint32)
    at_cap = index.candidate_columns(exact, "ns")
    assert not at_cap.truncated
    assert at_cap.as_contents()[0].positions == tuple(range(MAX_CANDIDATE_POSITIONS))


@pytest.mark.parametrize("seed", range(6))
def test_a_reply_over_the_entries_cap_keeps_every_occurrence_left_of_one_position(seed):
    rng = np.random.default_rng(seed)
    contents = [rng.integers(0, 1000, CHUNK).astype(np.uint32) for _ in range(30)]
    index = _index(contents, chunks_each=int(rng.integers(1, 4)))
    picks = rng.integers(0, len(contents), 200)
    query = np.concatenate([contents[i] for i in picks] + [rng.integers(0, 1000, 7).astype(
        np.uint32)])
    whole = index.candidate_columns(query, "ns", **UNCUT)
    everything = _occurrences(whole)
    total = len(whole.positions) + len(whole.old_st)
    max_entries = int(rng.integers(5, total))
    cut = index.candidate_columns(query, "ns", max_entries=max_entries)
    kept = _occurrences(cut)
    assert cut.truncated
    assert len(cut.positions) + len(cut.old_st) <= max_entries
    assert kept == everything[:len(kept)]  # a leading run of the occurrences by position
    # The furthest cut that fits: one more occurrence would not.
    contents_kept = {first for _, first, _ in kept}
    _, next_first, next_chunks = everything[len(kept)]
    more = len(cut.positions) + len(cut.old_st) + 1 + (
        0 if next_first in contents_kept else len(next_chunks))
    assert more > max_entries
    # Under the cap: the reply as it is, uncut.
    same = index.candidate_columns(query, "ns", max_entries=total)
    assert not same.truncated and _occurrences(same) == everything
