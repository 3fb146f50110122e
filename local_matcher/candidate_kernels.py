"""Numba kernels of the candidates form: what a probe found, grouped by content, and the
first chunks of each content's list of occupants (`local_matcher.index.ContentIndex.
candidate_columns`; docs/DESIGN.md, "The content index", item 5). Plain-array signatures;
`local_matcher.store.ContentStore` and the index are the callers."""

from __future__ import annotations

import numpy as np
from numba import njit

from local_matcher import content_groups
from local_matcher.kernels import _same_windows


@njit(cache=True, nogil=True)
def group_occurrences(query, first_pos, first_cid, repeat_pos, repeat_cid, width, groups,
                      max_positions):
    """Every verified occurrence, grouped by content, at most `max_positions` per content
    (its leftmost): (positions, sizes, cut), `cut` True when some content had more.

    Group i is the content first found at ``first_pos[i]``; its positions, ascending, are
    ``positions[sum(sizes[:i]):][:sizes[i]]`` (a content's first occurrence precedes its
    repeats, which `probe` returns ascending). The candidates form names every position
    of a content, not only as many as it has occupants, so each repeat is compared token
    by token with its content's first occurrence, verified against the stored row (a
    mismatch stops at its first differing token) until its content is full;
    one more verified repeat of a full content says it was cut, and the rest of that
    content's repeats are not compared: the work is bounded by the cap, not the query's
    repetitions. `width`: the chunk size; `groups`: a `content_groups.buffer_for` the
    firsts, overwritten."""
    count = first_cid.shape[0]
    bits = content_groups.begin(groups, count)
    for i in range(count):
        content_groups.add(groups, bits, first_cid[i], i)
    sizes = np.ones(count, dtype=np.int64)
    was_cut = np.zeros(count, dtype=np.uint8)  # 1: full, and one more verified
    ok = np.zeros(repeat_pos.shape[0], dtype=np.uint8)
    cut = False
    for j in range(repeat_pos.shape[0]):
        g = content_groups.group_of(groups, bits, repeat_cid[j])
        if was_cut[g] or not _same_windows(query, repeat_pos[j], first_pos[g], width):
            continue
        if sizes[g] >= max_positions:
            was_cut[g] = 1
            cut = True
            continue
        ok[j] = 1
        sizes[g] += 1
    fill = np.empty(count, dtype=np.int64)
    total = 0
    for i in range(count):
        fill[i] = total
        total += sizes[i]
    positions = np.empty(total, dtype=np.int64)
    for i in range(count):
        positions[fill[i]] = first_pos[i]
        fill[i] += 1
    for j in range(repeat_pos.shape[0]):
        if ok[j]:
            g = content_groups.group_of(groups, bits, repeat_cid[j])
            positions[fill[g]] = repeat_pos[j]
            fill[g] += 1
    return positions, sizes, cut


@njit(cache=True, nogil=True)
def walk_lists(heads, limits, next_slot):
    """The first ``limits[i]`` slots of each circular list starting at ``heads[i]``.

    Returns (slots, counts): list i's slots are ``slots[sum(counts[:i]):][:counts[i]]``,
    in list order; a list shorter than its limit gives all of its slots once."""
    total = 0
    for i in range(heads.shape[0]):
        total += limits[i]
    slots = np.empty(total, dtype=np.int64)
    counts = np.zeros(heads.shape[0], dtype=np.int64)
    k = 0
    for i in range(heads.shape[0]):
        head = heads[i]
        if head == -1:
            continue
        slot = head
        while counts[i] < limits[i]:
            slots[k] = slot
            k += 1
            counts[i] += 1
            slot = next_slot[slot]
            if slot == head:
                break
    return slots[:k], counts
