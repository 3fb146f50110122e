"""Numba kernels of the content store: fingerprints, probing, insertion, removal.

Plain-array signatures only; `local_matcher.store.ContentStore` owns the arrays and
is the only caller. Every kernel is compiled with ``cache=True`` and ``nogil=True``
(callers hold the store's lock, not the GIL, while a kernel runs).

Fingerprint of a window of C tokens (all arithmetic mod 2**64)::

    v_i = mix(token_i + salt)                  # per-token scramble, keyed per process
    h   = sum_j v_{p+j} * base**(C-1-j)        # polynomial, rolled one token at a time
    fp  = mix(h ^ salt)

`mix` is the splitmix64 finaliser. `salt` and the odd `base` are drawn at random per
process, so fingerprints never leave the process and collisions cannot be precomputed.
Collisions still cost nothing but time: every candidate is compared token by token.

Table layout (the invariants every kernel keeps):

- ``table_fp[s]``/``table_cid[s]``: open addressing with linear probing, ``cid == -1``
  is empty. An entry's home slot is the top ``table_bits`` bits of its fingerprint.
  Several entries may share a fingerprint (different contents): it is a multimap.
  Deletion shifts later entries back, so there are no tombstones.
- ``filter_words``: one bit per filter slot; a slot is the top ``filter_bits`` bits of a
  fingerprint (``filter_bits >= table_bits``). A bit is set iff some live entry maps to
  it. Entries sharing a filter slot share a home slot, so they sit in one probe cluster:
  removal clears a bit after scanning only that cluster.
- ``tokens[cid]``: the content's tokens; ``free_ids[:free_top[0]]`` the unused ids.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_ONE = np.uint64(1)
_SIX = np.uint64(6)
_LOW6 = np.uint64(63)


@njit(cache=True, inline="always")
def _mix(x):
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


@njit(cache=True, inline="always")
def _scramble(token, salt):
    return _mix(np.uint64(token) + salt)


@njit(cache=True, nogil=True)
def fingerprint_rows(rows, salt, base):
    """Fingerprint of every row of a (n, C) uint32 array."""
    n, width = rows.shape
    out = np.empty(n, dtype=np.uint64)
    for i in range(n):
        h = np.uint64(0)
        for j in range(width):
            h = h * base + _scramble(rows[i, j], salt)
        out[i] = _mix(h ^ salt)
    return out


@njit(cache=True, inline="always")
def _filter_test(filter_words, slot):
    return (filter_words[slot >> _SIX] >> (slot & _LOW6)) & _ONE


@njit(cache=True, inline="always")
def _same_tokens(query, start, tokens, cid):
    width = tokens.shape[1]
    for j in range(width):
        if query[start + j] != tokens[cid, j]:
            return False
    return True


@njit(cache=True, nogil=True)
def probe(query, stride, salt, base, base_top, filter_words, filter_shift,
          table_fp, table_cid, table_shift, tokens, ns_mask, ns_bit, seen, epoch):
    """First verified occurrence of every stored content in `query`.

    Windows start at multiples of `stride`. A candidate must pass the filter, have
    its fingerprint in the table, carry `ns_bit` in its namespace mask (a cheap
    over-approximation of "claimed by the requester") and not be seen yet in this
    call; only then are its tokens compared. ``seen[cid] = epoch`` marks a content
    as found for this call, after verification. Returns (positions, cids), ascending.
    """
    n = query.shape[0]
    width = tokens.shape[1]
    if n < width:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    scrambled = np.empty(n, dtype=np.uint64)
    for i in range(n):
        scrambled[i] = _scramble(query[i], salt)
    h = np.uint64(0)
    for j in range(width):
        h = h * base + scrambled[j]
    table_mask = table_cid.shape[0] - 1
    last = n - width
    out_pos = np.empty(last // stride + 1, dtype=np.int64)
    out_cid = np.empty(last // stride + 1, dtype=np.int64)
    found = 0
    for p in range(last + 1):
        if p % stride == 0:
            fp = _mix(h ^ salt)
            if _filter_test(filter_words, fp >> filter_shift):
                s = np.int64(fp >> table_shift)
                while table_cid[s] != -1:
                    cid = table_cid[s]
                    if (table_fp[s] == fp and seen[cid] != epoch
                            and (ns_mask[cid] & ns_bit) != 0
                            and _same_tokens(query, p, tokens, cid)):
                        seen[cid] = epoch
                        out_pos[found] = p
                        out_cid[found] = cid
                        found += 1
                    s = (s + 1) & table_mask
        if p < last:
            h = (h - scrambled[p] * base_top) * base + scrambled[p + width]
    return out_pos[:found], out_cid[:found]


@njit(cache=True, inline="always")
def _find(row_tokens, i, fp, tokens, table_fp, table_cid, table_shift):
    """Slot-free lookup of row `i`'s content: its id, or -1."""
    table_mask = table_cid.shape[0] - 1
    width = tokens.shape[1]
    s = np.int64(fp >> table_shift)
    while table_cid[s] != -1:
        if table_fp[s] == fp:
            cid = table_cid[s]
            same = True
            for j in range(width):
                if row_tokens[i, j] != tokens[cid, j]:
                    same = False
                    break
            if same:
                return cid
        s = (s + 1) & table_mask
    return -1


@njit(cache=True, inline="always")
def _place(fp, cid, table_fp, table_cid, table_shift, filter_words, filter_shift):
    table_mask = table_cid.shape[0] - 1
    s = np.int64(fp >> table_shift)
    while table_cid[s] != -1:
        s = (s + 1) & table_mask
    table_fp[s] = fp
    table_cid[s] = cid
    slot = fp >> filter_shift
    filter_words[slot >> _SIX] |= _ONE << (slot & _LOW6)


@njit(cache=True, nogil=True)
def insert_rows(rows, salt, base, tokens, table_fp, table_cid, table_shift,
                filter_words, filter_shift, free_ids, free_top):
    """Find-or-insert every row; returns (content ids, 1 where newly stored).

    The caller guarantees room: at least ``len(rows)`` free ids and a table that
    stays at most half full after inserting them all.
    """
    fps = fingerprint_rows(rows, salt, base)
    n, width = rows.shape
    cids = np.empty(n, dtype=np.int64)
    fresh = np.zeros(n, dtype=np.uint8)
    for i in range(n):
        cid = _find(rows, i, fps[i], tokens, table_fp, table_cid, table_shift)
        if cid == -1:
            free_top[0] -= 1
            cid = free_ids[free_top[0]]
            for j in range(width):
                tokens[cid, j] = rows[i, j]
            _place(fps[i], cid, table_fp, table_cid, table_shift, filter_words, filter_shift)
            fresh[i] = 1
        cids[i] = cid
    return cids, fresh


@njit(cache=True, nogil=True)
def remove_contents(cids, salt, base, tokens, table_fp, table_cid, table_shift,
                    filter_words, filter_shift, free_ids, free_top):
    """Drop stored contents by id and return their ids to the free list."""
    table_mask = table_cid.shape[0] - 1
    fps = fingerprint_rows(tokens[cids], salt, base) if cids.shape[0] else np.empty(0, np.uint64)
    for k in range(cids.shape[0]):
        cid = cids[k]
        fp = fps[k]
        home = np.int64(fp >> table_shift)
        s = home
        while table_cid[s] != cid:
            if table_cid[s] == -1:  # not stored: nothing to do
                s = -1
                break
            s = (s + 1) & table_mask
        if s == -1:
            continue
        # Backward-shift deletion keeps every entry reachable from its home slot.
        hole = s
        j = s
        while True:
            j = (j + 1) & table_mask
            if table_cid[j] == -1:
                break
            want = np.int64(table_fp[j] >> table_shift)
            if hole <= j:
                stays = hole < want <= j
            else:
                stays = hole < want or want <= j
            if not stays:
                table_fp[hole] = table_fp[j]
                table_cid[hole] = table_cid[j]
                hole = j
        table_cid[hole] = -1
        # Clear the filter bit unless another entry of the cluster maps to it.
        slot = fp >> filter_shift
        shared = False
        j = home
        while table_cid[j] != -1:
            if (table_fp[j] >> filter_shift) == slot:
                shared = True
                break
            j = (j + 1) & table_mask
        if not shared:
            filter_words[slot >> _SIX] &= ~(_ONE << (slot & _LOW6))
        free_ids[free_top[0]] = cid
        free_top[0] += 1


@njit(cache=True, nogil=True)
def rebuild_table(old_fp, old_cid, table_fp, table_cid, table_shift, filter_words, filter_shift):
    """Re-place every live entry of an old table into fresh (empty) arrays."""
    for s in range(old_cid.shape[0]):
        if old_cid[s] != -1:
            _place(old_fp[s], old_cid[s], table_fp, table_cid, table_shift,
                   filter_words, filter_shift)
