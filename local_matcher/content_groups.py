"""A probe's contents numbered in order of first occurrence: a small open-addressing map
from content id to group number, kept in a scratch buffer the size of the query.

Why not an array indexed by content id (what the content store had): that costs bytes
per *stored* content, for good, to serve one query at a time; this costs bytes per
window of the query being probed, and stays in cache. docs/DESIGN.md, "The content
index", item 10.

Layout: ``groups[2s]`` is content id + 1 (0: empty), ``groups[2s+1]`` its group number;
`begin` sizes the map to at least twice the contents it will hold (at most half full)
and clears only that prefix, so a probe's cost follows its candidates, not the buffer.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_FACTOR = np.uint64(0x9E3779B97F4A7C15)


def buffer_for(windows: int) -> np.ndarray:
    """A buffer for maps of up to `windows` contents."""
    return np.zeros(4 << max(windows - 1, 1).bit_length(), dtype=np.int32)


@njit(cache=True, inline="always")
def begin(groups, count):
    """Bits of a map for up to `count` contents (its prefix of `groups` cleared)."""
    bits = 1
    while (np.int64(1) << bits) < 2 * count:
        bits += 1
    groups[:np.int64(2) << bits] = 0
    return bits


@njit(cache=True, inline="always")
def _slot(groups, bits, cid):
    mask = (np.int64(1) << bits) - 1
    s = np.int64((np.uint64(cid) * _FACTOR) >> np.uint64(64 - bits))
    while groups[2 * s] != 0 and groups[2 * s] != cid + 1:
        s = (s + 1) & mask
    return s


@njit(cache=True, inline="always")
def group_of(groups, bits, cid):
    """The group number of content `cid`, or -1."""
    s = _slot(groups, bits, cid)
    return groups[2 * s + 1] if groups[2 * s] != 0 else -1


@njit(cache=True, inline="always")
def add(groups, bits, cid, group):
    """Number content `cid` (not yet in the map) as `group`."""
    s = _slot(groups, bits, cid)
    groups[2 * s] = cid + 1
    groups[2 * s + 1] = group
