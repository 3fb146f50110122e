"""The table of claim-list heads the lookup kernels read (local_matcher.head_table)."""

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from local_matcher.head_table import NONE, HeadTable, heads_of

LANE = "unit"


def _key(ns_id: int, cid: int) -> int:
    return ns_id << 32 | cid


def _kernel_get(table: HeadTable, ns_id: int, cids: list[int]) -> list[int]:
    """What a lookup kernel reads for these contents when no first list is `ns_id`'s."""
    width = max(cids, default=0) + 1
    head = np.full(width, -1, dtype=np.int32)
    return heads_of(np.array(cids, dtype=np.int64), ns_id, head, np.zeros(1, np.int32),
                    *table.for_kernels).tolist()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "delete"]), st.integers(0, 3),
                          st.integers(0, 40), st.integers(0, 10**6)), max_size=300))
def test_table_is_a_dict_for_python_and_kernels(operations):
    table, model = HeadTable(), {}
    for op, ns_id, cid, slot in operations:
        key = _key(ns_id, cid)
        if op == "set":
            table.set(key, slot)
            model[key] = slot
        elif key in model:
            table.delete(key)
            del model[key]
        assert len(table) == len(model)
    assert dict(table.items()) == model
    for ns_id in range(4):
        cids = list(range(41))
        expected = [model.get(_key(ns_id, cid), NONE) for cid in cids]
        assert [table.get(_key(ns_id, cid)) for cid in cids] == expected
        assert _kernel_get(table, ns_id, cids) == expected


def test_removal_keeps_every_cluster_reachable_when_it_wraps_round_the_end():
    # Many keys in a small table: clusters run past the last slot and back to the first,
    # so removal must shift entries across the end (the condition that is easy to get wrong).
    rng = random.Random(7)
    table, model = HeadTable(), {}
    for _ in range(20_000):
        key = _key(rng.randrange(2), rng.randrange(64))
        if key in model and rng.random() < 0.5:
            table.delete(key)
            del model[key]
        else:
            slot = rng.randrange(1000)
            table.set(key, slot)
            model[key] = slot
        assert len(table.keys) <= 4 * max(len(model), 4)
    assert dict(table.items()) == model


def test_table_grows_past_half_full_and_keeps_its_entries():
    table = HeadTable()
    for cid in range(1000):
        table.set(_key(1, cid), cid)
    assert len(table) == 1000 and len(table.keys) >= 2000
    assert _kernel_get(table, 1, list(range(1000))) == list(range(1000))
    assert _kernel_get(table, 2, [0, 5]) == [NONE, NONE]


def test_removing_a_key_that_is_not_there_says_so():
    table = HeadTable()
    table.set(_key(1, 2), 5)
    with pytest.raises(KeyError):
        table.delete(_key(1, 3))
    assert dict(table.items()) == {_key(1, 2): 5}
