"""The references `make bench-rag` measures everything against, on workloads small enough
to work out by hand: the two brute forces and LMCache's selection after its lookup."""

from __future__ import annotations

import numpy as np

from benchmarks.bench_rag import (lmcache_selection, reusable_tokens, stored_contents,
                                  token_ceiling)

LANE = "unit"

C = 2


def contents(*held: tuple[list[int], int]) -> dict[bytes, int]:
    return {np.asarray(tokens, dtype=np.uint32).tobytes(): n for tokens, n in held}


def reuse(query: list[int], prefix: int, stored: dict[bytes, int], once: bool) -> int:
    return reusable_tokens(np.asarray(query, dtype=np.uint32), prefix, C, stored, once)


def test_stored_contents_counts_the_distinct_chunks_holding_each_content():
    store = {b"h1": np.array([1, 2], dtype=np.uint32), b"h2": np.array([3, 4], dtype=np.uint32),
             b"h3": np.array([3, 4], dtype=np.uint32)}
    assert stored_contents(store) == contents(([1, 2], 1), ([3, 4], 2))


def test_each_chunk_serves_one_position_only_with_once():
    # [1, 2] occurs at 1 and 3, held by one chunk; [3, 4] at 5, 7 and 9, held by two.
    query = [9, 1, 2, 1, 2, 3, 4, 3, 4, 3, 4]
    stored = contents(([1, 2], 1), ([3, 4], 2))
    assert reuse(query, 0, stored, once=False) == 5 * C   # 1, 3, 5, 7, 9
    assert reuse(query, 0, stored, once=True) == 3 * C    # 1, 5, 7
    # The prefix covers positions 0-1 (and counts as reused): [1, 2] at 1 is inside it, so
    # its one chunk serves position 3.
    assert reuse(query, 2, stored, once=False) == 2 + 4 * C  # 3, 5, 7, 9
    assert reuse(query, 2, stored, once=True) == 2 + 3 * C   # 3, 5, 7


def test_kept_positions_never_overlap_leftmost_first():
    stored = contents(([5, 5], 1))
    assert reuse([5, 5, 5, 5, 5], 0, stored, once=False) == 4  # 0 and 2, never 1 or 3
    assert reuse([5, 5, 5, 5, 5], 0, stored, once=True) == 2   # one chunk: 0 only
    assert reuse([5, 5, 5, 5, 5], 0, contents(([5, 5], 3)), once=True) == 4
    # [2, 3] at 1 overlaps [1, 2] kept at 0: dropped, nothing after it.
    assert reuse([1, 2, 3], 0, contents(([1, 2], 1), ([2, 3], 1)), once=False) == 2
    assert reuse([7, 7, 7], 0, stored, once=False) == 0


def test_lmcache_selection_drops_the_prefix_the_unfetchable_and_overlaps():
    matches = [(6, b"d"), (0, b"a"), (3, b"b"), (4, b"c"), (9, b"gone")]
    kept = lmcache_selection(matches, prefix_tokens=1, chunk=C,
                             fetchable=lambda h: h != b"gone")
    # a is inside the prefix; b at 3 is kept, c at 4 overlaps it; d at 6; gone is not found.
    assert kept == [(3, b"b"), (6, b"d")]


def test_token_ceiling_is_the_prefix_and_the_held_span_counted_once():
    assert token_ceiling(0, (10, 50)) == 40
    assert token_ceiling(16, (10, 50)) == 16 + 34     # the prefix covers 10..16 already
    assert token_ceiling(64, (0, 50)) == 64           # all inside the prefix
    assert token_ceiling(5, (0, 50)) == 50
