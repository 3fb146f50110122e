"""ContentIndex with many chunks per content: the match rule and costs that do not grow.

The rule (DESIGN.md, content index item 2; WIRE.md, blend-lookup): at most one match per
query position and each chunk at most once; at a position, the first occupant of the
requester's namespace (in the order it claimed them) not yet named in this query.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import python_lines
from local_matcher import BlendMatch, ContentIndex

LANE = "unit"

C = 4
A, B = "tenant-a", "tenant-b"
X = [1, 2, 3, 4]
Y = [5, 6, 7, 8]


@pytest.fixture
def index() -> ContentIndex:
    return ContentIndex(chunk_size=C)


def test_lmcache_example_second_occurrence_gets_the_second_chunk():
    # LMCache's test: tokens T stored as chunk aa (offset 0) and bb (offset 512);
    # a query T T answers [aa, 0, 0], [bb, 512, 256].
    index = ContentIndex(chunk_size=256)
    tokens = np.arange(1000, 1256, dtype=np.uint32)
    index.add(tokens, bytes.fromhex("aa"), 0, A)
    index.add(tokens, bytes.fromhex("bb"), 512, A)
    assert index.match(np.concatenate([tokens, tokens]), A) == [
        BlendMatch(bytes.fromhex("aa"), 0, 0), BlendMatch(bytes.fromhex("bb"), 512, 256)]


def test_repeated_content_takes_occupants_in_order_until_they_run_out(index):
    for i in range(3):
        index.add(X, f"x{i}".encode(), 100 * i, A)
    query = X + [0] + X + X + Y + X + X
    assert index.match(query, A) == [
        BlendMatch(b"x0", 0, 0), BlendMatch(b"x1", 100, 5), BlendMatch(b"x2", 200, 9)]


def test_a_content_held_by_thousands_of_chunks_costs_one_match_per_occurrence(index):
    index.add_many(np.tile(np.array(X, dtype=np.uint32), (2000, 1)), list(range(2000)),
                   [C * i for i in range(2000)], A)
    assert index.match(X + X, A) == [BlendMatch(0, 0, 0), BlendMatch(1, C, C)]


def test_periodic_content_matches_at_consecutive_positions_while_occupants_last(index):
    periodic = [7, 7, 7, 7]
    index.add(periodic, b"p0", 0, A)
    index.add(periodic, b"p1", 4, A)
    # Windows at 0, 1, 2 and 3 all hold the content: two occupants, two matches.
    assert index.match([7] * 7, A) == [BlendMatch(b"p0", 0, 0), BlendMatch(b"p1", 4, 1)]
    for i in range(2, 10):
        index.add(periodic, f"p{i}".encode(), 4 * i, A)
    assert [m.cur_st for m in index.match([7] * 7, A)] == [0, 1, 2, 3]


def test_period_two_content_overlapping_itself(index):
    index.add([1, 2, 1, 2], b"a", 0, A)
    index.add([2, 1, 2, 1], b"b", 0, A)
    index.add([1, 2, 1, 2], b"c", 8, A)
    assert index.match([1, 2, 1, 2, 1, 2, 1], A) == [
        BlendMatch(b"a", 0, 0), BlendMatch(b"b", 0, 1), BlendMatch(b"c", 8, 2)]


def test_namespaces_sharing_a_content_each_get_their_own_occupants(index):
    index.add(X, b"a1", 0, A)
    index.add(X, b"b1", 10, B)
    index.add(X, b"a2", 20, A)
    index.add(X, b"b2", 30, B)
    index.add(X, b"b3", 40, B)
    query = X + X + X
    assert index.match(query, A) == [BlendMatch(b"a1", 0, 0), BlendMatch(b"a2", 20, 4)]
    assert index.match(query, B) == [BlendMatch(b"b1", 10, 0), BlendMatch(b"b2", 30, 4),
                                     BlendMatch(b"b3", 40, 8)]


def test_a_chunk_two_namespaces_claim_is_named_in_lmcaches_order(index):
    # LMCache's order: per content, occupants in the order they were first indexed on it,
    # whichever namespace indexed them; B joining an older occupant puts it first for B.
    index.add(X, b"shared", 0, A)
    index.add(X, b"mine", 8, B)
    index.add(X, b"shared", 0, B)  # B claims it after its own chunk
    assert index.match(X + X, A) == [BlendMatch(b"shared", 0, 0)]
    assert index.match(X + X, B) == [BlendMatch(b"shared", 0, 0), BlendMatch(b"mine", 8, 4)]
    index.remove_claim(b"shared", A)  # the occupant lives on in B: its place too
    assert index.match(X + X, B) == [BlendMatch(b"shared", 0, 0), BlendMatch(b"mine", 8, 4)]
    assert index.match(X + X, A) == []
    index.remove_claim(b"shared", B)  # gone, then indexed again: it goes last
    index.add(X, b"shared", 0, B)
    assert index.match(X + X, B) == [BlendMatch(b"mine", 8, 0), BlendMatch(b"shared", 0, 4)]


def test_joining_an_older_occupant_is_placed_among_the_namespaces_own_in_order(index):
    for name in (b"o1", b"o2", b"o3"):
        index.add(X, name, 0, A)  # occupants in order o1, o2, o3
    for name in (b"m1", b"m2"):
        index.add(X, name, 0, B)  # then m1, m2
    index.add(X, b"o2", 0, B)
    index.add(X, b"o3", 0, B)
    index.add(X, b"o1", 0, B)
    assert [m.chunk_hash for m in index.match(X * 5, B)] == [b"o1", b"o2", b"o3", b"m1", b"m2"]
    index.remove_claim(b"o1", A)
    index.remove_claim(b"o2", B)
    assert [m.chunk_hash for m in index.match(X * 5, B)] == [b"o1", b"o3", b"m1", b"m2"]
    assert [m.chunk_hash for m in index.match(X * 5, A)] == [b"o2", b"o3"]


def test_readding_keeps_a_chunks_place_and_removal_of_any_place_keeps_the_order(index):
    for name in (b"a", b"b", b"c", b"d"):
        index.add(X, name, 0, A)
    index.add(X, b"a", 64, A)  # an offset update, not a new claim
    assert [m.chunk_hash for m in index.match(X * 4, A)] == [b"a", b"b", b"c", b"d"]
    index.remove_chunk(b"a")  # the head
    index.remove_claim(b"c", A)  # the middle
    assert [m.chunk_hash for m in index.match(X * 4, A)] == [b"b", b"d"]
    index.remove_chunks([b"d"])  # the tail
    index.add(X, b"e", 0, A)
    assert [m.chunk_hash for m in index.match(X * 4, A)] == [b"b", b"e"]


def test_another_tenants_occupants_neither_answer_nor_exhaust_mine(index):
    index.add_many(np.tile(np.array(X, dtype=np.uint32), (10_000, 1)), list(range(10_000)),
                   [0] * 10_000, B)
    index.add(X, b"mine", 4, A)
    assert index.match([9] + X * 50, A) == [BlendMatch(b"mine", 4, 1)]
    assert len(index.match(X * 3, B)) == 3


def test_stats_count_occupants_and_claims(index):
    index.add(X, b"a", 0, A)
    index.add(X, b"b", 0, A)
    index.add(X, b"b", 0, B)
    stats = index.stats()
    assert (stats["num_contents"], stats["num_chunks"], stats["num_claims"],
            stats["num_namespaces"]) == (1, 2, 3, 2)
    index.remove_chunks([b"a", b"b"])
    stats = index.stats()
    assert (stats["num_contents"], stats["num_chunks"], stats["num_claims"],
            stats["num_namespaces"]) == (0, 0, 0, 0)


# --- work does not grow with multiplicity (counted, not timed) ---------------------------




def _one_content_many_chunks(n: int, namespaces: int = 1) -> ContentIndex:
    index = ContentIndex(chunk_size=C)
    rows = np.tile(np.array(X, dtype=np.uint32), (n, 1))
    for ns in range(namespaces):
        index.add_many(rows, [(ns, i) for i in range(n)], [0] * n, ns)
    return index


@pytest.mark.parametrize("how", ["remove_chunk", "remove_claim", "remove_chunks"])
def test_removing_n_occupants_of_one_content_is_linear_work(how):
    def remove_all(index: ContentIndex, n: int) -> None:
        if how == "remove_chunk":
            for i in range(n):
                index.remove_chunk((0, i))
        elif how == "remove_claim":
            for i in range(n):
                index.remove_claim((0, i), 0)
        else:
            index.remove_chunks([(0, i) for i in range(n)])

    work = {}
    for n in (500, 4000):
        index = _one_content_many_chunks(n)
        work[n] = python_lines(lambda: remove_all(index, n), "local_matcher")
        assert index.stats()["num_chunks"] == 0
    assert work[4000] < 9 * work[500], work  # linear: 8x; quadratic would be 64x


def test_adding_n_occupants_of_one_content_is_linear_work():
    work = {}
    for n in (500, 4000):
        index = ContentIndex(chunk_size=C)
        work[n] = python_lines(
            lambda: [index.add(X, i, 0, A) for i in range(n)], "local_matcher")
    assert work[4000] < 9 * work[500], work


def test_a_lookup_costs_the_same_however_many_occupants_other_tenants_hold():
    work = {}
    for n in (10, 10_000):
        index = _one_content_many_chunks(n, namespaces=2)
        index.add(X, b"mine", 0, "small")
        query = [0] + X * 20
        found = []
        work[n] = python_lines(lambda: found.append(index.match(query, "small")),
                                "local_matcher")
        assert found == [[BlendMatch(b"mine", 0, 1)]]
    assert work[10_000] <= work[10] + 5, work


def test_memory_per_claim_does_not_grow_with_the_number_of_namespaces():
    """Claims are not a bit set over namespace numbers. n chunks each claimed by the
    oldest namespace and then by one of n new ones cost what n chunks each claimed by
    the oldest and one other cost, plus the new namespaces' own interning; a bit set
    would add n/16 bytes per chunk on average (13 KB at 100k namespaces)."""
    import tracemalloc

    n = 8192
    rows = np.arange(n * C, dtype=np.uint32).reshape(n, C)

    def second_claims(namespace_of) -> float:
        index = ContentIndex(chunk_size=C)
        index.add_many(rows, list(range(n)), [0] * n, "oldest")
        tracemalloc.start()
        try:
            for i in range(n):
                index.add(rows[i], i, 0, namespace_of(i))
            return tracemalloc.get_traced_memory()[0] / n
        finally:
            tracemalloc.stop()

    one_other = second_claims(lambda i: "other")
    many_others = second_claims(lambda i: f"tenant-{i}")
    assert many_others - one_other < 400, (one_other, many_others)  # a bit set: ~1,000


def test_a_chunk_many_namespaces_claim_serves_each_until_its_claim_goes(index):
    tenants = [f"t{i}" for i in range(20)]
    for tenant in tenants:
        index.add(X, b"shared", 0, tenant)
    index.add(X, b"shared", 8, tenants[0])  # an offset update is that namespace's only
    assert index.match(X, tenants[0]) == [BlendMatch(b"shared", 8, 0)]
    assert all(index.match(X, t) == [BlendMatch(b"shared", 0, 0)] for t in tenants[1:])
    index.add(X, b"shared", 8, tenants[0])
    for tenant in tenants[1:]:
        index.add(X, b"shared", 8, tenant)
    for i, tenant in enumerate(tenants[:-1]):
        index.remove_claim(b"shared", tenant)
        assert index.match(X, tenant) == []
        assert index.match(X, tenants[-1]) == [BlendMatch(b"shared", 8, 0)]
        assert index.stats()["num_claims"] == len(tenants) - i - 1
    index.remove_claim(b"shared", tenants[-1])
    stats = index.stats()
    assert (stats["num_chunks"], stats["num_claims"], stats["num_contents"]) == (0, 0, 0)
    for tenant in tenants:
        index.add(X, b"shared", 0, tenant)
    index.remove_chunk(b"shared")
    assert index.stats()["num_claims"] == 0
