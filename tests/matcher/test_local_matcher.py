"""LocalMatcher: the per-process view of the content index a serving process uses."""

from __future__ import annotations

import threading

import numpy as np

from local_matcher import CBMatchResult, LocalMatcher

LANE = "unit"

C = 16


def tokens(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=count, dtype=np.uint32)


def test_match_returns_segments_with_ends_and_registered_hash():
    matcher = LocalMatcher(chunk_size=C)
    stored = tokens(3 * C, seed=1)
    matcher.register(stored, [b"c0", b"c1", b"c2"], position_offset=100)
    query = np.concatenate([tokens(5, seed=2), stored[2 * C:3 * C], stored[:C]])
    assert matcher.match(query) == [
        CBMatchResult(old_st=100 + 2 * C, old_ed=100 + 3 * C, cur_st=5, cur_ed=5 + C, hash=b"c2"),
        CBMatchResult(old_st=100, old_ed=100 + C, cur_st=5 + C, cur_ed=5 + 2 * C, hash=b"c0"),
    ]


def test_chunk_registered_just_before_a_lookup_is_found():
    matcher = LocalMatcher(chunk_size=C)
    stored = tokens(C, seed=3)
    matcher.register(stored, [b"fresh"])  # no flush: match must drain what is pending
    assert [r.hash for r in matcher.match(stored)] == [b"fresh"]


def test_trailing_partial_chunk_and_extra_hashes_are_ignored():
    matcher = LocalMatcher(chunk_size=C)
    stored = tokens(2 * C + 5, seed=4)
    matcher.register(stored, [b"a", b"b", b"c"])
    matcher.flush()
    assert matcher.stats()["num_chunks"] == 2
    assert [r.hash for r in matcher.match(stored)] == [b"a", b"b"]


def test_registered_tokens_are_copied():
    matcher = LocalMatcher(chunk_size=C)
    stored = tokens(C, seed=5)
    original = stored.copy()
    matcher.register(stored, [b"x"])
    stored[:] = 0  # the caller reuses its buffer
    assert [r.hash for r in matcher.match(original)] == [b"x"]


def test_evict_removes_and_ignores_unknown_hashes():
    matcher = LocalMatcher(chunk_size=C)
    stored = tokens(2 * C, seed=6)
    matcher.register(stored, [b"a", b"b"])
    matcher.evict([b"a", b"never-registered"])
    assert [r.hash for r in matcher.match(stored)] == [b"b"]
    assert matcher.stats()["num_contents"] == 1


def test_operations_apply_in_order():
    matcher = LocalMatcher(chunk_size=C)
    stored = tokens(C, seed=7)
    matcher.register(stored, [b"x"])
    matcher.evict([b"x"])
    matcher.register(stored, [b"x"], position_offset=C)
    assert matcher.match(stored) == [CBMatchResult(C, 2 * C, 0, C, b"x")]


def test_namespaces_are_kept_apart_and_eviction_leaves_all_of_them():
    matcher = LocalMatcher(chunk_size=C)
    stored = tokens(2 * C, seed=8)
    matcher.register(stored[:C], [b"a"], namespace="tenant-1")
    matcher.register(stored[C:], [b"b"], namespace="tenant-2")
    matcher.register(stored[C:], [b"b"], position_offset=C, namespace="tenant-1")
    assert [r.hash for r in matcher.match(stored, namespace="tenant-1")] == [b"a", b"b"]
    assert [r.hash for r in matcher.match(stored, namespace="tenant-2")] == [b"b"]
    assert matcher.match(stored) == []  # the implicit namespace holds nothing
    matcher.evict([b"b"])
    assert [r.hash for r in matcher.match(stored, namespace="tenant-1")] == [b"a"]
    assert matcher.match(stored, namespace="tenant-2") == []


def test_a_document_stored_behind_two_prefixes_serves_two_occurrences():
    matcher = LocalMatcher(chunk_size=C)
    document = tokens(C, seed=9)
    matcher.register(np.concatenate([tokens(C, seed=10), document]), [b"p1", b"d1"])
    matcher.register(np.concatenate([tokens(C, seed=11), document]), [b"p2", b"d2"])
    query = np.concatenate([document, tokens(3, seed=12), document, document])
    assert matcher.match(query) == [CBMatchResult(C, 2 * C, 0, C, b"d1"),
                                    CBMatchResult(C, 2 * C, C + 3, 2 * C + 3, b"d2")]


def test_long_lived_matcher_survives_more_than_2_pow_20_cycles():
    """LMCache 0.5.6 stops indexing after 2**20 registrations; this must not."""
    chunk = 4
    matcher = LocalMatcher(chunk_size=chunk)
    batch, cycles = 4000, 300  # 1.2 million register/evict cycles
    offsets = np.arange(batch * chunk, dtype=np.uint32)
    for cycle in range(cycles):
        # Every cycle stores content never seen before.
        sequence = offsets + np.uint32(cycle * batch * chunk)
        hashes = range(cycle * batch, (cycle + 1) * batch)
        matcher.register(sequence, hashes)
        if cycle == 0:
            matcher.flush()
            first = matcher.stats()
        if cycle % 50 == 0 or cycle == cycles - 1:
            found = matcher.match(sequence)
            assert [r.hash for r in found] == list(hashes), f"cycle {cycle} lost recall"
        matcher.evict(hashes)
    matcher.flush()
    last = matcher.stats()
    assert last["num_contents"] == last["num_chunks"] == 0
    assert last["table_size"] == first["table_size"]
    assert last["bytes"] <= first["bytes"] + 4096, "memory did not return to its level"


def _matcher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("local-matcher") and t.is_alive()]


def test_a_matcher_without_an_executor_stops_its_own_thread_on_close_and_stays_usable():
    # Threads of matchers other tests left behind may come and go: compare identities.
    before = set(_matcher_threads())
    matcher = LocalMatcher(chunk_size=C)
    assert not set(_matcher_threads()) - before  # no thread until the first store
    first, second = tokens(C, 1), tokens(C, 2)
    matcher.register(first, [b"first"])
    own = set(_matcher_threads()) - before
    assert len(own) == 1
    matcher.close()
    assert not any(t.is_alive() for t in own)
    matcher.register(second, [b"second"])  # after close: applied by the next match
    assert [m.hash for m in matcher.match(np.concatenate([first, second]))] == [b"first", b"second"]
    assert not set(_matcher_threads()) - before


def test_a_matcher_given_an_executor_runs_on_it_and_leaves_it_open():
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1, thread_name_prefix="owner-pool") as pool:
        before = set(_matcher_threads())
        matcher = LocalMatcher(chunk_size=C, executor=pool)
        matcher.register(tokens(C, 3), [b"x"])
        matcher.close()
        assert not set(_matcher_threads()) - before
        assert pool.submit(lambda: 42).result() == 42  # still the owner's to shut down


def test_a_range_longer_than_a_staging_buffer_and_many_small_ones_are_all_indexed():
    from local_matcher import kernels
    chunk = 4
    matcher = LocalMatcher(chunk_size=chunk)
    count = kernels.BLOCK_ROWS + 100  # more rows than one staging buffer holds
    sequence = np.arange(count * chunk, dtype=np.uint32)
    matcher.register(sequence, range(count))
    small = np.arange(count * chunk, (count + 300) * chunk, dtype=np.uint32)
    for i in range(300):  # fills the rest of a buffer and moves on to the next
        matcher.register(small[i * chunk:(i + 1) * chunk], [count + i])
    found = matcher.match(np.concatenate([sequence, small]))
    assert [m.hash for m in found] == list(range(count + 300))


def test_stores_during_matches_from_other_threads_are_all_found():
    matcher = LocalMatcher(chunk_size=C)
    stored = tokens(400 * C, seed=13)
    errors: list[BaseException] = []

    def store() -> None:
        try:
            for i in range(0, 400, 4):
                matcher.register(stored[i * C:(i + 4) * C], range(i, i + 4), position_offset=i * C)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    writer = threading.Thread(target=store)
    writer.start()
    while writer.is_alive():
        found = matcher.match(stored)
        assert [m.hash for m in found] == list(range(len(found)))  # stored in order
    writer.join()
    assert errors == []
    assert [m.cur_st for m in matcher.match(stored)] == [i * C for i in range(400)]


class _IdleExecutor:
    """Runs nothing: what is queued stays queued until the test flushes."""

    def submit(self, fn, *args, **kwargs):
        return None


def test_a_failed_batch_is_dropped_and_the_operations_queued_after_it_still_apply():
    matcher = LocalMatcher(chunk_size=C, executor=_IdleExecutor())
    first, second = tokens(C, seed=14), tokens(C, seed=15)
    matcher.register(first, [b"first"], namespace="a")
    matcher.register(second, [b"second"], namespace="b")
    add_many = matcher._index.add_many

    def fail_once(*args, **kwargs):
        matcher._index.add_many = add_many
        raise MemoryError("injected")

    matcher._index.add_many = fail_once
    try:
        matcher.flush()
    except MemoryError:
        pass
    assert matcher.match(first, namespace="a") == []
    assert [m.hash for m in matcher.match(second, namespace="b")] == [b"second"]
