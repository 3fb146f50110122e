"""Numba kernels of `queries.place_columns`: the chunks' placement records numbered by
first mention, and each chunk's holders gathered from its record's, in one pass each
instead of a sort and a dozen array operations (a lookup at chunk 32 names hundreds of
chunks but a handful of distinct records). Plain-array signatures; `queries` is the
caller. docs/DESIGN.md, "Key directory internals"."""

from __future__ import annotations

import numpy as np
from numba import njit

_FACTOR = np.uint64(0x9E3779B97F4A7C15)


@njit(cache=True, nogil=True)
def number_records(codes):
    """(of_chunk, firsts): each chunk's record number, records numbered in order of first
    mention, and the index of each record's first chunk. `codes`: a chunk's record as
    one int64 (`BindingTable.hold_codes`), equal codes the same record."""
    n = codes.shape[0]
    bits = 4
    while (1 << bits) < 2 * n:
        bits += 1
    mask = (1 << bits) - 1
    keys = np.empty(1 << bits, dtype=np.int64)
    numbers = np.full(1 << bits, -1, dtype=np.int64)
    of_chunk = np.empty(n, dtype=np.int64)
    firsts = np.empty(n, dtype=np.int64)
    records = 0
    for i in range(n):
        code = codes[i]
        s = np.int64((np.uint64(code) * _FACTOR) >> np.uint64(64 - bits))
        while numbers[s] != -1 and keys[s] != code:
            s = (s + 1) & mask
        if numbers[s] == -1:
            keys[s] = code
            numbers[s] = records
            firsts[records] = i
            records += 1
        of_chunk[i] = numbers[s]
    return of_chunk, firsts[:records]


@njit(cache=True, nogil=True)
def gather_holders(of_chunk, record_counts, record_holders):
    """(holder_start, holders): chunk i's holders are its record's, ``record_holders``
    holding record r's ``record_counts[r]`` holders after those of the records before."""
    record_start = np.zeros(record_counts.shape[0] + 1, dtype=np.int64)
    for r in range(record_counts.shape[0]):
        record_start[r + 1] = record_start[r] + record_counts[r]
    n = of_chunk.shape[0]
    holder_start = np.zeros(n + 1, dtype=np.int64)
    for i in range(n):
        holder_start[i + 1] = holder_start[i] + record_counts[of_chunk[i]]
    holders = np.empty(holder_start[n], dtype=np.int64)
    for i in range(n):
        r = of_chunk[i]
        for j in range(record_counts[r]):
            holders[holder_start[i] + j] = record_holders[record_start[r] + j]
    return holder_start, holders
