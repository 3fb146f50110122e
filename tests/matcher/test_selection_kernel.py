"""The selection kernel (`local_matcher.selection`) equals the rule written plainly in
Python (tests/selection_reference.py) on random inputs: several legs, contents found at
several places, repeated contents and chunks named by several legs, a prefix, a set of
available chunks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from local_matcher.selection import select_offers
from selection_reference import select_offers as reference

LANE = "unit"

hashes = st.sampled_from([bytes([i]) for i in range(12)])
group = st.tuples(
    st.lists(st.integers(0, 60), max_size=6).map(lambda ps: tuple(sorted(set(ps)))),
    st.integers(0, 3),
    st.lists(st.tuples(hashes, st.integers(0, 500)), max_size=5,
             unique_by=lambda chunk: chunk[0]).map(tuple))
legs = st.lists(st.lists(group, max_size=6), min_size=1, max_size=3)


@settings(max_examples=600, deadline=None)
@given(legs, st.integers(0, 40), st.integers(1, 9),
       st.none() | st.sets(hashes, max_size=12))
def test_kernel_equals_the_plain_rule(legs, prefix, chunk_size, available):
    assert (select_offers(legs, prefix, chunk_size, available=available)
            == reference(legs, prefix, chunk_size, available=available))


def test_a_chunk_two_legs_name_serves_once():
    legs = [[((0, 10), 2, ((b"a", 5),))], [((0, 10), 0, ((b"a", 7), (b"b", 9)))]]
    assert select_offers(legs, 0, 4) == reference(legs, 0, 4) == [
        (0, b"a", 7, 0, 1), (10, b"b", 9, 0, 1)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5000), max_size=40).map(lambda ps: sorted(set(ps))),
                max_size=40), st.integers(0, 3000), st.sampled_from([1, 7, 400]))
def test_occurrences_are_ordered_by_position_then_entry(entries, prefix, spread):
    # Both sorts the kernel picks between (by counting when the positions are close
    # together, else a merge sort) keep entry order within a position; `spread` moves the
    # positions apart so that each is taken.
    import numpy as np

    from local_matcher import selection_kernels

    lists = [[p * spread for p in ps] for ps in entries]
    starts = np.cumsum([0] + [len(ps) for ps in lists]).astype(np.int64)
    flat = np.array([p for ps in lists for p in ps], dtype=np.int64)
    occ_pos, occ_entry = selection_kernels.occurrences(starts, flat, prefix)
    expected = sorted((p, e) for e, ps in enumerate(lists) for p in ps if p >= prefix)
    assert list(zip(occ_pos.tolist(), occ_entry.tolist())) == expected
