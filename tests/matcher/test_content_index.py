"""ContentIndex: exact, complete, namespaced matching at any offset."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

from local_matcher import BlendMatch, ContentIndex, head_table, kernels

LANE = "unit"

C = 4
A, B = "tenant-a", "tenant-b"


def chunk(*tokens: int) -> list[int]:
    assert len(tokens) == C
    return list(tokens)


X = chunk(1, 2, 3, 4)
Y = chunk(5, 6, 7, 8)
Z = chunk(9, 10, 11, 12)


@pytest.fixture
def index() -> ContentIndex:
    return ContentIndex(chunk_size=C)


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="chunk_size"):
        ContentIndex(chunk_size=0)
    with pytest.raises(ValueError, match="probe_stride"):
        ContentIndex(chunk_size=4, probe_stride=0)


def test_content_found_at_query_offset_with_stored_offset(index):
    index.add(X, b"x", 512, A)
    assert index.match([0, 0, 0] + X + [0], A) == [BlendMatch(b"x", 512, 3)]


def test_old_st_and_cur_st_are_independent(index):
    index.add(X, b"x", 0, A)
    index.add(Y, b"y", 4, A)
    # Stored in order X, Y; found in order Y, X at unrelated positions.
    assert index.match([7] + Y + [7, 7] + X, A) == [BlendMatch(b"y", 4, 1), BlendMatch(b"x", 0, 7)]


def test_several_chunks_come_back_ascending(index):
    for i, content in enumerate((X, Y, Z)):
        index.add(content, bytes([i]), i * C, A)
    query = Z + [0] + X + Y + [0, 0]
    assert [m.cur_st for m in index.match(query, A)] == [0, 5, 9]
    assert [m.chunk_hash for m in index.match(query, A)] == [b"\x02", b"\x00", b"\x01"]


def test_repeated_content_with_one_occupant_matches_once_at_first_position(index):
    index.add(X, b"x", 0, A)
    assert index.match([0] + X + X + [0] + X, A) == [BlendMatch(b"x", 0, 1)]


def test_short_query_and_absent_content_match_nothing(index):
    index.add(X, b"x", 0, A)
    assert index.match(X[:3], A) == []
    assert index.match([], A) == []
    assert index.match(Y + Z, A) == []


def test_window_differing_in_one_token_is_rejected(index):
    index.add(X, b"x", 0, A)
    assert index.match([1, 2, 3, 5], A) == []
    assert index.match([0, 2, 3, 4], A) == []


def test_fingerprint_equal_window_is_still_compared_token_by_token():
    # With base 1 the fingerprint ignores token order: every permutation collides,
    # so only the token comparison can tell them apart.
    index = ContentIndex(chunk_size=C, fingerprint_key=(12345, 1))
    index.add(X, b"x", 0, A)
    assert index.match([2, 1, 3, 4, 4, 3, 2, 1], A) == []
    assert index.match([2, 1, 3, 4] + X, A) == [BlendMatch(b"x", 0, 4)]


def test_longer_window_containing_the_content_matches_at_its_offset(index):
    index.add(X, b"x", 8, A)
    assert index.match([3, 1, 2] + X + [5, 6, 1], A) == [BlendMatch(b"x", 8, 3)]


def test_add_is_idempotent(index):
    index.add(X, b"x", 0, A)
    before = index.stats()
    index.add(X, b"x", 0, A)
    assert index.stats() == before
    assert index.match(X, A) == [BlendMatch(b"x", 0, 0)]


def test_readding_a_chunk_updates_its_offset(index):
    index.add(X, b"x", 0, A)
    index.add(X, b"x", 768, A)
    assert index.match(X, A) == [BlendMatch(b"x", 768, 0)]
    assert index.stats()["num_chunks"] == 1


def test_content_of_wrong_length_is_skipped_without_error(index):
    index.add([1, 2, 3], b"short", 0, A)
    index.add([1, 2, 3, 4, 5], b"long", 0, A)
    assert index.stats()["num_contents"] == 0
    assert index.match([1, 2, 3, 4, 5], A) == []


def test_unknown_offset_is_not_indexed(index):
    index.add(X, b"x", -1, A)
    assert index.stats()["num_chunks"] == 0
    assert index.match(X, A) == []


def test_readding_a_hash_with_new_content_moves_it(index):
    index.add(X, b"h", 0, A)
    index.add(Y, b"h", 4, A)
    assert index.match(X, A) == []
    assert index.match(Y, A) == [BlendMatch(b"h", 4, 0)]
    assert index.stats()["num_contents"] == 1


def test_remove_makes_content_undiscoverable(index):
    index.add(X, b"x", 0, A)
    index.add(Y, b"y", 4, A)
    index.remove_chunk(b"x")
    assert index.match(X + Y, A) == [BlendMatch(b"y", 4, 4)]
    assert index.remove_claim(b"y", A).tolist() == list(Y)  # what the claim held
    assert index.match(X + Y, A) == []
    assert index.stats()["num_contents"] == 0


def test_removing_unknown_things_is_a_no_op(index):
    index.add(X, b"x", 0, A)
    before = index.stats()
    index.remove_chunk(b"unknown")
    assert index.remove_claim(b"unknown", A) is None
    assert index.remove_claim(b"x", B) is None  # namespace without a claim
    assert index.remove_claim(b"x", "never-seen") is None
    index.remove_chunks([b"nope"])
    assert index.stats() == before
    assert index.match(X, A) == [BlendMatch(b"x", 0, 0)]


def test_identical_content_under_two_hashes_survives_removal_of_one(index):
    index.add(X, b"first", 0, A)
    index.add(X, b"second", 40, A)
    assert index.stats()["num_contents"] == 1
    # One match per position: the first-indexed occupant.
    assert index.match(X, A) == [BlendMatch(b"first", 0, 0)]
    index.remove_chunk(b"first")
    assert index.match(X, A) == [BlendMatch(b"second", 40, 0)]


def test_tokens_of_returns_a_copy_of_the_indexed_content(index):
    index.add(X, b"x", 0, A)
    tokens = index.tokens_of(b"x")
    assert tokens.tolist() == X
    tokens[:] = 0
    assert index.match(X, A) == [BlendMatch(b"x", 0, 0)]
    assert index.tokens_of(b"unknown") is None


def test_other_namespace_chunk_is_not_offered(index):
    index.add(X, b"x", 0, A)
    assert index.match(X, B) == []
    assert index.match(X, "unknown-namespace") == []


def test_own_chunk_is_found_behind_another_namespace_occupant(index):
    index.add(X, b"theirs", 0, A)
    index.add(X, b"mine", 64, B)
    assert index.match(X, B) == [BlendMatch(b"mine", 64, 0)]
    assert index.match(X, A) == [BlendMatch(b"theirs", 0, 0)]


def test_chunk_claimed_by_two_namespaces(index):
    index.add(X, b"x", 0, A)
    index.add(X, b"x", 0, B)
    stats = index.stats()
    assert (stats["num_contents"], stats["num_chunks"], stats["num_claims"],
            stats["num_namespaces"]) == (1, 1, 2, 2)
    assert index.match(X, A) == index.match(X, B) == [BlendMatch(b"x", 0, 0)]

    index.remove_claim(b"x", A)
    assert index.match(X, A) == []
    assert index.match(X, B) == [BlendMatch(b"x", 0, 0)]
    assert index.stats()["num_namespaces"] == 1

    index.remove_claim(b"x", B)
    assert index.match(X, B) == []
    stats = index.stats()
    assert (stats["num_contents"], stats["num_chunks"], stats["num_claims"],
            stats["num_namespaces"]) == (0, 0, 0, 0)


def test_remove_chunk_retires_every_namespace_at_once(index):
    for namespace in (A, B, "c"):
        index.add(X, b"x", 0, namespace)
    index.remove_chunk(b"x")
    assert all(index.match(X, ns) == [] for ns in (A, B, "c"))
    assert index.stats()["num_claims"] == 0


def test_namespaces_beyond_64_stay_separate(index):
    # Namespace ids past 63 share pre-test bits with lower ones; results must not.
    for i in range(70):
        index.add([i, i, i, i], f"h{i}".encode(), i, f"ns{i}")
    for i in (0, 6, 64, 69):
        query = [t for j in range(70) for t in [j] * C]
        assert index.match(query, f"ns{i}") == [BlendMatch(f"h{i}".encode(), i, i * C)]


def test_probe_stride_equal_to_chunk_size():
    index = ContentIndex(chunk_size=C, probe_stride=C)
    index.add(X, b"x", 0, A)
    assert index.match([0, 0, 0, 0] + X, A) == [BlendMatch(b"x", 0, 4)]
    assert index.match([0, 0, 0, 0, 0] + X, A) == []


def test_two_contents_with_the_same_fingerprint_are_both_matchable():
    # Base 1 makes the fingerprint order-blind, so X and its reverse collide.
    index = ContentIndex(chunk_size=C, fingerprint_key=(99, 1))
    reverse = X[::-1]
    index.add(X, b"x", 0, A)
    index.add(reverse, b"r", 4, B)
    assert index.stats()["num_contents"] == 2
    assert index.match(reverse + X, A) == [BlendMatch(b"x", 0, 4)]
    assert index.match(reverse + X, B) == [BlendMatch(b"r", 4, 0)]
    index.remove_chunk(b"x")
    assert index.match(reverse + X, B) == [BlendMatch(b"r", 4, 0)]


def test_what_one_probe_numbered_does_not_hide_a_content_from_the_next(index):
    # A probe numbers the contents it finds in a map over a scratch buffer kept between
    # queries: a smaller later query reads a prefix of it, which must start empty, or a
    # content the earlier query found would pass for one this query already found.
    rows = np.arange(1, 1 + 64 * C, dtype=np.uint32).reshape(64, C)
    index.add_many(rows, [bytes([i]) for i in range(64)], [C * i for i in range(64)], A)
    everything = rows[::-1].ravel().tolist()
    assert len(index.match(everything, A)) == 64
    for i in (0, 17, 63):
        query = rows[i].tolist() + rows[i].tolist()
        assert index.match(query, A) == [BlendMatch(bytes([i]), C * i, 0)]
        columns = index.candidate_columns(query, A)
        assert columns.positions.tolist() == [0, C]


def test_a_pickle_of_an_earlier_build_loads_as_this_one_keeps_it(index):
    import pickle

    index.add(X, b"x", 0, A)
    store = index._store
    store._free_ids = store._free_ids.astype(np.int64)  # as an older build kept them
    for name in ("_first", "_cursor", "_seen"):  # per-content scratch, per query now
        setattr(store, name, np.zeros(store.capacity, dtype=np.int64))
    store._epoch = 7
    # Masks of 64 bits, A's bit where a namespace id of 32 would have put it (bit 32).
    store.ns_mask = store.ns_mask.astype(np.uint64) << np.uint64(32)
    loaded = pickle.loads(pickle.dumps(index))
    assert loaded._store._free_ids.dtype == np.dtype(np.int32)
    assert loaded._store.ns_mask.dtype == np.dtype(np.uint32)
    assert not {"_first", "_cursor", "_seen", "_epoch"} & set(vars(loaded._store))
    assert loaded.match(Y + X, A) == [BlendMatch(b"x", 0, 4)]


def test_fingerprint_key_is_random_per_instance():
    keys = {(int(ContentIndex(C)._store._salt), int(ContentIndex(C)._store._base))
            for _ in range(3)}
    assert len(keys) == 3


def test_kernels_are_compiled_when_an_index_is_built():
    index = ContentIndex(chunk_size=C)
    kernel_list = (kernels.probe, kernels.match_occupants, kernels.insert_rows,
                   kernels.remove_contents, kernels.rebuild_table, head_table.heads_of,
                   head_table.rehash)
    for kernel in kernel_list:
        assert kernel.signatures, f"{kernel.__name__} was not warmed"
    compiled = [len(kernel.signatures) for kernel in kernel_list]
    index.add(X, b"x", 0, A)
    index.add(X, b"y", 0, A)
    assert len(index.match(X + X, A)) == 2  # every path: probe, repeats, occupants
    index.remove_chunks([b"x", b"y"])
    assert [len(kernel.signatures) for kernel in kernel_list] == compiled, \
        "real use compiled another specialisation: the warm-up does not cover it"


def _distinct_rows(count: int, start: int = 0) -> np.ndarray:
    """`count` distinct C-token rows: row i is [i, i+1, i+2, i+3] shifted into a range."""
    base = np.arange(start, start + count, dtype=np.uint32)[:, None] * C
    return base + np.arange(C, dtype=np.uint32)


def test_contents_stay_matchable_across_table_growth_and_mass_removal(index):
    count = 3 * kernels.BLOCK_ROWS + 123  # three block additions, two table rebuilds
    rows = _distinct_rows(count)
    table_sizes = set()
    for start in range(0, count, 5000):
        part = rows[start:start + 5000]
        index.add_many(part, list(range(start, start + len(part))),
                       [i * C for i in range(start, start + len(part))], A)
        table_sizes.add(index.stats()["table_size"])
    assert len(table_sizes) >= 2, "the table never grew: the test does not cover growth"
    found = index.match(rows.ravel(), A)
    assert [m.chunk_hash for m in found] == list(range(count))
    assert all(m.old_st == m.cur_st for m in found)

    survivors = set(range(0, count, 10))
    index.remove_chunks(h for h in range(count) if h not in survivors)
    assert index.stats()["num_contents"] == len(survivors)
    found = index.match(rows.ravel(), A)
    assert {m.chunk_hash for m in found} == survivors
    assert all(m.cur_st == m.chunk_hash * C for m in found)


def test_concurrent_add_remove_and_match_stay_consistent(index):
    errors: list[BaseException] = []
    rounds = 300

    def worker(tid: int) -> None:
        try:
            rows = _distinct_rows(8, start=1000 * tid)
            hashes = [(tid, i) for i in range(8)]
            query = rows.ravel()
            for r in range(rounds):
                index.add_many(rows, hashes, [0] * 8, tid)
                assert len(index.match(query, tid)) == 8
                index.remove_chunks(hashes[: r % 8])
                assert len(index.match(query, tid)) == 8 - r % 8
                index.remove_chunks(hashes)
                assert index.match(query, tid) == []
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert index.stats()["num_contents"] == 0
    assert index.stats()["num_claims"] == 0


def test_add_many_with_shared_rows_claims_each_chunk_with_its_row(index):
    rows = np.array([X, Y], dtype=np.uint32)
    index.add_many(rows, [b"x1", b"y", b"x2", b"skipped"], [0, 4, 8, -1], [A, A, B, B],
                   row_of=[0, 1, 0, 1])
    assert index.match(X + Y, A) == [BlendMatch(b"x1", 0, 0), BlendMatch(b"y", 4, 4)]
    assert index.match(X + Y, B) == [BlendMatch(b"x2", 8, 0)]  # -1: not indexed
    assert index.stats()["num_contents"] == 2
    with pytest.raises(ValueError, match="row_of"):
        index.add_many(rows, [b"z"], [0], A, row_of=[2])


@pytest.mark.parametrize("stride", [1, 2])
def test_many_contents_sharing_one_fingerprint_are_found_where_they_occur(stride):
    # Base 1: all six orders of three tokens share a fingerprint, and every window of the
    # query is a candidate for each of them. Each window can hold only one; the index must
    # report the same as a direct comparison (and stay within its buffers doing so).
    index = ContentIndex(chunk_size=3, probe_stride=stride, fingerprint_key=(99, 1))
    orders = [list(order) for order in itertools.permutations([0, 1, 2])]
    for i, order in enumerate(orders):
        index.add(order, f"h{i}".encode(), 0, A)
    query = [t for order in orders for t in order] * 3
    at = {tuple(order): i for i, order in enumerate(orders)}
    where = [(p, at[tuple(query[p:p + 3])]) for p in range(0, len(query) - 2, stride)
             if tuple(query[p:p + 3]) in at]
    first = {}
    for p, i in where:
        first.setdefault(i, p)
    assert index.match(query, A) == [BlendMatch(f"h{i}".encode(), 0, p)
                                     for p, i in sorted((p, i) for i, p in first.items())]
    found = index.candidates(query, A)
    assert {c.chunks[0][0]: c.positions for c in found} == {
        f"h{i}".encode(): tuple(p for p, j in where if j == i) for i in first}


def test_namespaces_that_share_a_mask_bit_see_only_their_own_chunks():
    # The store's namespace masks have 32 bits: namespace ids 0 and 32 share one. That
    # lets the other's contents through the probe's pre-test, never into a match.
    index = ContentIndex(chunk_size=C)
    names = [f"tenant-{i}" for i in range(33)]
    for i, name in enumerate(names):  # ids by first claim: tenant-i is id i
        index.add(chunk(100 + i, 1, 2, 3), bytes([i]), 0, name)
    index.add(X, b"x32", 0, names[32])
    assert index.match(Y + X, names[0]) == []
    assert index.candidate_columns(Y + X, names[0]).positions.size == 0
    assert index.match(Y + X, names[32]) == [BlendMatch(b"x32", 0, 4)]
