"""ContentStore's table and filter against their invariants, under random inserts and removals.

The kernels keep a multimap table (a fingerprint and a content id in 12 bytes a slot, any
number of slots, homes scaled from the fingerprint's top bits, linear probing,
backward-shift deletion) and a blocked filter whose words hold exactly the bits of the live
entries mapping to them. A table of 16 or 13 slots, a tiny alphabet and, in most runs, base 1 (every
permutation of a row collides) make clusters, shared words and equal fingerprints common.
The fingerprints are checked against the contract's formula written out in Python."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from local_matcher.store import ContentStore

LANE = "unit"

C = 3
MASK = 2**64 - 1


def _mix(x: int, factor: int) -> int:
    x = (x * factor) & MASK
    return x ^ (x >> 32)


def fingerprint(tokens, salt: int, base: int) -> int:
    """`local_matcher.kernels` (its module doc): v_j = mix(t_j + salt, K1),
    fp = mix(sum_j v_j B**(C-1-j) ^ salt, K2)."""
    h = 0
    for token in tokens:
        h = (h * base + _mix((int(token) + salt) & MASK, 0x9E3779B97F4A7C15)) & MASK
    return _mix(h ^ salt, 0xBF58476D1CE4E5B9)


def _filter_bits(fp: int) -> int:
    return (1 << (fp & 63)) | (1 << ((fp >> 6) & 63)) | (1 << ((fp >> 12) & 63))


def check_invariants(store: ContentStore, live: dict[tuple, int]) -> None:
    slots = store.table_size
    words = store._table.reshape(-1, 3).astype(np.uint64)  # fingerprint low, high; id + 1
    table = np.stack([words[:, 0] | (words[:, 1] << np.uint64(32)), words[:, 2]], axis=1)
    filter_shift = int(store._filter_shift)
    salt, base = int(store._salt), int(store._base)
    occupied = table[:, 1] != 0
    assert sorted(int(c) - 1 for c in table[occupied, 1]) == sorted(live.values())
    expected_words = np.zeros_like(store._filter)
    for s in np.flatnonzero(occupied).tolist():
        fp, cid = int(table[s, 0]), int(table[s, 1]) - 1
        assert fp == fingerprint(store.row(cid), salt, base)
        home = ((fp >> 32) * slots) >> 32
        # Reachable from its home slot: no empty slot between them.
        j = home
        while j != s:
            assert occupied[j], "an entry sits beyond an empty slot"
            j = (j + 1) % slots
        expected_words[fp >> filter_shift] |= np.uint64(_filter_bits(fp))
    assert np.array_equal(store._filter, expected_words)
    for tokens, cid in live.items():
        assert tuple(store.row(cid).tolist()) == tokens


def small_store(salt: int, base: int, slots: int) -> ContentStore:
    """A store whose table has `slots` slots (two filter words), kept there: clusters,
    wrap-around and shared words are the rule. The caller keeps it at most half full, as
    `ContentStore._reserve` would by growing it."""
    store = ContentStore(C, fingerprint_key=(salt, base))
    store._allocate_table(slots)
    store._reserve = lambda extra: None
    return store


rows = st.lists(st.tuples(*[st.integers(0, 2)] * C), min_size=1, max_size=8)
operations = st.lists(st.tuples(st.sampled_from(["insert", "remove"]), rows), max_size=25)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=operations, base=st.sampled_from([1, 1, 0x9E3779B97F4A7C15]),
       salt=st.integers(0, MASK), slots=st.sampled_from([16, 13]))
def test_table_and_filter_keep_their_invariants(operations, base, salt, slots):
    store = small_store(salt, base, slots)
    live: dict[tuple, int] = {}
    for kind, batch in operations:
        if kind == "insert":
            room = slots // 2 - len(live)
            batch = [tokens for tokens in batch if tokens in live or (room := room - 1) >= 0]
            if not batch:
                continue
            cids, fresh = store.insert(np.array(batch, dtype=np.uint32))
            for tokens, cid, new in zip(batch, cids.tolist(), fresh.tolist()):
                assert new == (tokens not in live)
                assert live.setdefault(tokens, cid) == cid
        else:
            gone = [live.pop(tokens) for tokens in dict.fromkeys(batch) if tokens in live]
            store.remove(np.array(gone, dtype=np.int64))
        check_invariants(store, live)


def test_every_window_fingerprint_equals_its_rows():
    """A query's rolled fingerprints are the stored rows' own: a stored row is found at
    every offset and every probe stride that lands on it."""
    rng = np.random.default_rng(7)
    store = ContentStore(5, fingerprint_key=(12345, 0x9E3779B97F4A7C15))
    query = rng.integers(0, 2**32, size=200, dtype=np.uint32)
    cids, _ = store.insert(np.stack([query[p:p + 5] for p in range(0, 196, 7)]))
    store.ns_mask[cids] = 1
    for stride in (1, 7):
        first_pos, first_cid, _, _ = store.probe(query, stride, 1)
        assert first_pos.tolist() == list(range(0, 196, 7))
        assert first_cid.tolist() == cids.tolist()


def test_tokens_take_three_bytes_until_an_id_needs_four():
    """Block rows hold three bytes a token while every id is below 2^24; the first larger
    id widens the store, and every content is still found and compared exactly."""
    store = ContentStore(4)
    small = np.array([[1, 2, 3, 4], [2**24 - 1, 0, 5, 2**16]], dtype=np.uint32)
    small_cids, _ = store.insert(small)
    assert store.packed and store._block_arrays[0].shape[1] == 3 * 4
    assert store._block_arrays[0].dtype == np.uint8
    # A query token differing from a stored one only above the low 24 bits is no match.
    store.ns_mask[small_cids] = 1
    near = small[0].copy()
    near[3] += 2**24
    assert store.probe(near, 1, 1)[0].size == 0
    wide = np.array([[2**24, 7, 8, 9], [2**32 - 1, 1, 2, 3]], dtype=np.uint32)
    wide_cids, fresh = store.insert(wide)
    assert not store.packed and fresh.tolist() == [1, 1]
    cids = small_cids.tolist() + wide_cids.tolist()
    store.ns_mask[cids] = 1
    both = np.concatenate([small, wide])
    for tokens, cid in zip(both.tolist(), cids):
        assert store.row(cid).tolist() == tokens
    positions, found, _, _ = store.probe(both.ravel(), 1, 1)
    assert positions.tolist() == [0, 4, 8, 12] and found.tolist() == cids
    again, fresh = store.insert(both)
    assert again.tolist() == cids and not fresh.any()


def test_the_filter_stays_selective_in_a_large_table():
    """The filter's bits come from the fingerprint's low bits and its word from the top
    ones, apart however large the table: with a million contents (a table 40-50 % full,
    its filter a power of two words, 8-16 bits a slot) a random window passes about once
    in 140 (1 in 640 in a build whose filter had 14 bits a slot here). (A build whose table
    kept only the top 32 bits and took the filter's bits from them read 1 in 50 at 8 bits a
    slot, and 1 in 132 with those bits mixed, but its probe was 20 % slower:
    docs/BENCHMARKS.md.)"""
    from local_matcher import kernels

    rng = np.random.default_rng(0)
    store, width = ContentStore(4, (12345, 6789)), 4
    for _ in range(20):
        store.insert(rng.integers(0, 128_000, (50_000, width), dtype=np.uint32))
    assert 2 <= store.table_size / store.num_contents <= 2.5
    query = rng.integers(0, 128_000, 200_000, dtype=np.uint32)
    scratch = np.empty(2 * query.size + 64, dtype=np.uint64)
    found = np.empty((4, query.size), dtype=np.int64)
    passes = kernels._filter_passes(query, 1, store._salt, store._base, store._base_pow,
                                    width, store._filter, store._filter_shift, scratch, found)
    assert passes < query.size / 100


def test_the_free_stack_holds_what_was_removed_and_is_taken_first():
    """Removed contents' ids are handed out again before new ones; the stack grows with
    what is removed, not with what is stored (no 4 bytes a stored content)."""
    rng = np.random.default_rng(3)
    store = ContentStore(4)
    cids, _ = store.insert(rng.integers(0, 1000, (5000, 4), dtype=np.uint32))
    assert cids.tolist() == list(range(5000)) and len(store._free_ids) == 0
    gone = cids[[7, 4000, 123]]
    store.remove(gone)
    assert store.num_contents == 4997 and len(store._free_ids) == 16  # its least size
    again, fresh = store.insert(rng.integers(1000, 2000, (4, 4), dtype=np.uint32))
    assert fresh.all() and sorted(again[:3].tolist()) == sorted(gone.tolist())
    assert again[3] == 5000 and store.num_contents == 5001
