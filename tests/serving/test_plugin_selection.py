"""The unified lookup's selection against a brute force, over random workloads.

Two real content indexes stand for the legs (this server's chunks, and the fleet's as the
coordinator's candidates form names them); some chunks are in both. Queries are built from
stored contents with overlaps, repeats, periodic runs and noise, behind a random prefix.
The brute force states the target the obvious way: at every position past the prefix where
some stored chunk's content equals the window, leftmost-greedy keeps the position if it does
not overlap the last kept one and some chunk of that content is still unused ("each chunk
once"). The selection must be a valid result (ascending, non-overlapping, every chunk's
content equal to its window, each chunk once, nothing in the prefix) and reuse at least
what the brute force does over the union, and at least what either leg's chunks alone allow.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from local_matcher import ContentIndex
from plugin.lookup import select
from plugin.types import FoundColumns, Place

LANE = "unit"

C = 4
NS = "ns"
CONTENTS = [(0, 1, 2, 3), (1, 2, 3, 0), (2, 2, 2, 2), (0, 0, 1, 1), (3, 1, 3, 1)]

chunk = st.tuples(st.sampled_from(CONTENTS), st.sampled_from(["local", "fleet", "both"]),
                  st.integers(0, 64))
piece = st.one_of(st.sampled_from(CONTENTS).map(list),
                  st.sampled_from(CONTENTS).map(lambda c: list(c[1:])),  # a shifted overlap
                  st.sampled_from(CONTENTS).map(lambda c: list(c[:2])),
                  st.just([2] * 9),                                     # a periodic run
                  st.lists(st.integers(0, 3), min_size=1, max_size=3))
workload = st.tuples(st.lists(chunk, min_size=1, max_size=10),
                     st.lists(piece, max_size=10).map(lambda ps: [t for p in ps for t in p]),
                     st.integers(0, 12))


def legs(chunks):
    """Index each stored chunk in its leg(s); the chunk list as (hash, content, leg)."""
    local, fleet = ContentIndex(C), ContentIndex(C)
    stored = []
    for i, (content, where, offset) in enumerate(chunks):
        chunk_hash = bytes([i])
        if where in ("local", "both"):
            local.add(np.array(content, dtype=np.uint32), chunk_hash, offset, NS)
        if where in ("fleet", "both"):
            fleet.add(np.array(content, dtype=np.uint32), chunk_hash, offset, NS)
        stored.append((chunk_hash, content, where))
    return local, fleet, stored


def as_found(index, query, place):
    return FoundColumns.of(index.candidate_columns(np.array(query, dtype=np.uint32), NS), place)


def brute_force(query, chunks, prefix) -> int:
    """Positions the leftmost-greedy pass keeps when each chunk serves at most once."""
    used, kept, end = set(), 0, None
    for p in range(prefix, len(query) - C + 1):
        if end is not None and p < end:
            continue
        window = tuple(query[p:p + C])
        free = [h for h, content in chunks if content == window and h not in used]
        if free:
            used.add(free[0])
            kept += 1
            end = p + C
    return kept


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload)
def test_selection_reuses_at_least_the_brute_force_and_either_leg(case):
    chunks, query, prefix = case
    local, fleet, stored = legs(chunks)
    prefix = min(prefix, len(query))
    mine = as_found(local, query, Place.THIS_SERVER)
    theirs = as_found(fleet, query, Place.PEER)
    kept = select(mine, theirs, prefix, C)

    contents = {h: content for h, content, _ in stored}
    hashes = [c.segment.hash for c in kept]
    assert len(hashes) == len(set(hashes)), "a chunk named twice"
    end = prefix
    for candidate in kept:
        s = candidate.segment
        assert s.cur_st >= end and s.cur_ed == s.cur_st + C, "overlapping or in the prefix"
        assert tuple(query[s.cur_st:s.cur_ed]) == contents[s.hash], "wrong content"
        end = s.cur_ed
    union = [(h, content) for h, content, _ in stored]
    only_local = [(h, content) for h, content, where in stored if where != "fleet"]
    only_fleet = [(h, content) for h, content, where in stored if where != "local"]
    assert len(kept) >= brute_force(query, union, prefix)
    assert len(kept) >= brute_force(query, only_local, prefix)
    assert len(kept) >= brute_force(query, only_fleet, prefix)
    assert len(kept) >= len(select([], theirs, prefix, C))
    assert len(kept) >= len(select(mine, [], prefix, C))


def test_a_local_chunk_is_preferred_and_sources_say_which_leg():
    local, fleet, _ = legs([((0, 1, 2, 3), "both", 0), ((0, 1, 2, 3), "fleet", 8)])
    query = [0, 1, 2, 3, 9, 0, 1, 2, 3]
    kept = select(as_found(local, query, Place.THIS_SERVER),
                  as_found(fleet, query, Place.PEER), 0, C)
    # Both positions are kept: the chunk both legs hold (local, so first) at 0, the
    # fleet's other chunk at 5.
    assert [(c.segment.cur_st, c.segment.hash, c.source) for c in kept] == [
        (0, b"\x00", "both"), (5, b"\x01", "fleet")]
