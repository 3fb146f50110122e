"""Numba kernels of the selection rule (`local_matcher.selection` states the rule and owns
the columns these read): one pass over a request's occurrences, each content's chunks
walked by a cursor per place, so a selection costs O(occurrences + chunks) however the
chunks are placed, and a blend score runs it once per instance inside one call.

Input columns (every array int64 unless said): `entry_leg` per entry (a content as one
leg named it); `position_start`/`positions` and `chunk_start` CSR over the entries; per
chunk `chunk_rank` (its place as a rank, 0 the cheapest), `chunk_id` (equal ids: one
chunk, whichever leg named it) and `chunk_ok` (uint8, 1: may be used). Occurrences are the
(position, entry) pairs at or past the prefix, ordered by position then entry (`order`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

_NO_RANK = 1 << 30


#: A counting sort by position when the positions span at most this many per occurrence
#: (work O(occurrences) either way); else a merge sort.
_COUNTING_SPAN = 16


@njit(cache=True, nogil=True)
def occurrences(position_start, positions, prefix):
    """(position, entry) of every occurrence at or past `prefix`, ordered by position,
    then entry: the order the rule visits them in."""
    entries = position_start.shape[0] - 1
    count = 0
    top = prefix
    for e in range(entries):
        for k in range(position_start[e], position_start[e + 1]):
            if positions[k] >= prefix:
                count += 1
                top = max(top, positions[k])
    occ_pos = np.empty(count, dtype=np.int64)
    occ_entry = np.empty(count, dtype=np.int64)
    span = top - prefix + 1
    if span > _COUNTING_SPAN * count:
        n = 0
        for e in range(entries):
            for k in range(position_start[e], position_start[e + 1]):
                if positions[k] >= prefix:
                    occ_pos[n] = positions[k]
                    occ_entry[n] = e
                    n += 1
        order = np.argsort(occ_pos, kind="mergesort")  # stable: entry order within a position
        return occ_pos[order], occ_entry[order]
    # Counting sort: each position's first slot, then the occurrences in entry order (so
    # stable, as the merge sort). Small chunks find many occurrences close together.
    at = np.zeros(span + 1, dtype=np.int64)
    for e in range(entries):
        for k in range(position_start[e], position_start[e + 1]):
            if positions[k] >= prefix:
                at[positions[k] - prefix + 1] += 1
    for i in range(span):
        at[i + 1] += at[i]
    for e in range(entries):
        for k in range(position_start[e], position_start[e + 1]):
            p = positions[k]
            if p >= prefix:
                slot = at[p - prefix]
                at[p - prefix] = slot + 1
                occ_pos[slot] = p
                occ_entry[slot] = e
    return occ_pos, occ_entry


@njit(cache=True, nogil=True)
def _assign(occ_pos, occ_entry, entry_leg, leg, chunk_start, chunk_rank, chunk_id, chunk_ok,
            has_ok, ranks, ids, chunk_size, prefix, kept_pos, kept_chunk):
    """The leftmost-greedy pass over the occurrences of leg `leg` (-1: every leg) at or
    past `prefix`. Writes
    the kept positions and chunk indices; returns (how many, starved): starved when a
    position that did not overlap had offers but every chunk offered there was used."""
    entries = chunk_start.shape[0] - 1
    cursor = np.empty((entries, ranks), dtype=np.int64)
    for e in range(entries):
        for r in range(ranks):
            cursor[e, r] = chunk_start[e]
    used = np.zeros(ids, dtype=np.uint8)
    end = np.int64(prefix)
    kept, starved = 0, False
    i, n = 0, occ_pos.shape[0]
    while i < n:
        p = occ_pos[i]
        j = i
        while j < n and occ_pos[j] == p:
            j += 1
        if p < end:
            i = j
            continue
        best, best_rank, offered = -1, _NO_RANK, False
        for k in range(i, j):
            e = occ_entry[k]
            if (leg >= 0 and entry_leg[e] != leg) or not has_ok[e]:
                continue
            offered = True
            stop = chunk_start[e + 1]
            for r in range(min(ranks, best_rank)):
                c = cursor[e, r]
                while c < stop and (chunk_rank[c] != r or not chunk_ok[c]
                                    or used[chunk_id[c]]):
                    c += 1
                cursor[e, r] = c
                if c < stop:
                    best, best_rank = c, r
                    break
        if best < 0:
            starved = starved or offered
        else:
            kept_pos[kept] = p
            kept_chunk[kept] = best
            kept += 1
            used[chunk_id[best]] = 1
            end = p + chunk_size
        i = j
    return kept, starved


@njit(cache=True, nogil=True)
def select(occ_pos, occ_entry, entry_leg, legs, chunk_start, chunk_rank, chunk_id,
           chunk_ok, ranks, ids, chunk_size):
    """The rule: the union's pass; when it starved and more than one leg has entries,
    each such leg alone too, the one keeping most positions winning (the union on a tie).
    Returns (kept positions, kept chunk indices, the leg whose pass won, -1: the union)."""
    entries = chunk_start.shape[0] - 1
    has_ok = np.zeros(entries, dtype=np.uint8)
    for e in range(entries):
        for c in range(chunk_start[e], chunk_start[e + 1]):
            if chunk_ok[c]:
                has_ok[e] = 1
                break
    kept_pos = np.empty(occ_pos.shape[0], dtype=np.int64)
    kept_chunk = np.empty(occ_pos.shape[0], dtype=np.int64)
    kept, starved = _assign(occ_pos, occ_entry, entry_leg, -1, chunk_start, chunk_rank,
                            chunk_id, chunk_ok, has_ok, ranks, ids, chunk_size, 0, kept_pos,
                            kept_chunk)
    winner = -1
    with_entries = np.zeros(legs, dtype=np.uint8)
    for e in range(entries):
        with_entries[entry_leg[e]] = 1
    if starved and with_entries.sum() > 1:
        alone_pos = np.empty_like(kept_pos)
        alone_chunk = np.empty_like(kept_chunk)
        for leg in range(legs):
            if not with_entries[leg]:
                continue
            count, _ = _assign(occ_pos, occ_entry, entry_leg, leg, chunk_start, chunk_rank,
                               chunk_id, chunk_ok, has_ok, ranks, ids, chunk_size, 0,
                               alone_pos, alone_chunk)
            if count > kept:
                kept, winner = count, leg
                kept_pos[:count] = alone_pos[:count]
                kept_chunk[:count] = alone_chunk[:count]
    return kept_pos[:kept], kept_chunk[:kept], winner


@njit(cache=True, nogil=True)
def score(occ_pos, occ_entry, chunk_start, shared, holder_start, holders, prefixes,
          chunk_size):
    """Tokens each instance's selection keeps by place, in one call: row i for the
    instance numbered i (its L1 holds the chunks whose `holders` CSR names it; the last
    row, numbered past every holder, holds none: every stranger shares it), past its
    prefix `prefixes[i]`. Columns: (this L1, a shared tier, elsewhere). One leg; each
    chunk its own id; `occ_*` the occurrences from position 0."""
    instances = prefixes.shape[0] - 1
    chunks = chunk_start[chunk_start.shape[0] - 1]
    entries = chunk_start.shape[0] - 1
    entry_leg = np.zeros(entries, dtype=np.int64)
    ok = np.ones(chunks, dtype=np.uint8)
    ids = np.arange(chunks)
    # Per instance the chunks it holds: the holders CSR turned around.
    held_count = np.zeros(instances + 1, dtype=np.int64)
    for k in range(holders.shape[0]):
        held_count[holders[k] + 1] += 1
    held_start = np.cumsum(held_count)
    held = np.empty(holders.shape[0], dtype=np.int64)
    fill = held_start[:-1].copy()
    for c in range(chunks):
        for k in range(holder_start[c], holder_start[c + 1]):
            held[fill[holders[k]]] = c
            fill[holders[k]] += 1
    base = np.empty(chunks, dtype=np.int64)
    for c in range(chunks):
        base[c] = 1 if shared[c] else 2
    tokens = np.zeros((instances + 1, 3), dtype=np.int64)
    kept_pos = np.empty(occ_pos.shape[0], dtype=np.int64)
    kept_chunk = np.empty(occ_pos.shape[0], dtype=np.int64)
    has_ok = np.ones(entries, dtype=np.uint8)
    for c in range(entries):
        has_ok[c] = chunk_start[c + 1] > chunk_start[c]
    rank = base.copy()
    for i in range(instances + 1):
        if i < instances:
            for k in range(held_start[i], held_start[i + 1]):
                rank[held[k]] = 0
        kept, _ = _assign(occ_pos, occ_entry, entry_leg, -1, chunk_start, rank, ids, ok,
                          has_ok, 3, chunks, chunk_size, prefixes[i], kept_pos, kept_chunk)
        for k in range(kept):
            tokens[i, rank[kept_chunk[k]]] += chunk_size
        if i < instances:
            for k in range(held_start[i], held_start[i + 1]):
                rank[held[k]] = base[held[k]]
    return tokens
