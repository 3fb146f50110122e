"""The numba kernels of the token codec (blend_wire.tokens loads this module on first use,
so `import blend_wire` loads no numba).

Plain array signatures, ``cache=True``, ``nogil=True`` (each is one call per query or per
batch, never per token or per entry: releasing and re-taking the GIL per small call would
make threads queue behind each other).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from blend_wire.values import LIST_NOT_PLAIN, LIST_OK, LIST_OUT_OF_RANGE

_PAD = ord("=")
_SPACE, _TAB, _LF, _CR = 32, 9, 10, 13
_COMMA, _MINUS, _OPEN, _CLOSE = 44, 45, 91, 93
_ZERO, _NINE, _DOT, _LOWER_E, _UPPER_E = 48, 57, 46, 101, 69


@njit(cache=True, nogil=True)
def b64_decode(text, values):
    """Strict base64 to bytes; returns (bytes, -1) or (empty, index of the first bad char).

    Runs without the GIL: a coordinator decodes every query on a worker thread while its
    event loop goes on serving.
    """
    n = text.shape[0]
    pad = 0
    if n >= 1 and text[n - 1] == _PAD:
        pad = 2 if n >= 2 and text[n - 2] == _PAD else 1
    out = np.empty(n // 4 * 3, dtype=np.uint8)
    for i in range(0, n, 4):
        acc = np.uint32(0)
        for j in range(4):
            c = text[i + j]
            v = values[c]
            if v == 255:
                if i + j < n - pad:
                    return out[:0], i + j
                v = 0  # padding, already checked to be only at the very end
            acc = (acc << np.uint32(6)) | np.uint32(v)
        out[i // 4 * 3] = (acc >> np.uint32(16)) & np.uint32(255)
        out[i // 4 * 3 + 1] = (acc >> np.uint32(8)) & np.uint32(255)
        out[i // 4 * 3 + 2] = acc & np.uint32(255)
    return out[: out.shape[0] - pad], -1



@njit(cache=True, inline="always")
def _skip_space(text, i, end):
    while i < end:
        c = text[i]
        if c != _SPACE and c != _LF and c != _CR and c != _TAB:
            break
        i += 1
    return i


@njit(cache=True, inline="always")
def _parse_list(text, i, end, ids, count):
    """Parse `text[i:end]` as a JSON array of integers, writing in-range ids to
    `ids[count:]`. Returns (ids written, LIST_OK | LIST_OUT_OF_RANGE | LIST_NOT_PLAIN).

    Accepts exactly `ws [ ws ] ws` or `ws [ ws int (ws , ws int)* ws ] ws`, an int being
    JSON's `-?(0|[1-9][0-9]*)` (so `-0` is 0, as msgspec reads it). A fraction or an
    exponent (a float to msgspec), anything that is not a number, and any malformed text
    are LIST_NOT_PLAIN: msgspec decides and words the error.
    """
    start_count = count
    status = LIST_OK
    i = _skip_space(text, i, end)
    if i == end or text[i] != _OPEN:
        return 0, LIST_NOT_PLAIN
    i = _skip_space(text, i + 1, end)
    if i < end and text[i] == _CLOSE:
        i += 1
    else:
        while True:
            negative = i < end and text[i] == _MINUS
            if negative:
                i += 1
            first = i
            value = 0
            while i < end and _ZERO <= text[i] <= _NINE:
                if i - first < 11:  # more digits than that: out of range anyway
                    value = value * 10 + (np.int64(text[i]) - _ZERO)
                i += 1
            digits = i - first
            if digits == 0 or (digits > 1 and text[first] == _ZERO):
                return 0, LIST_NOT_PLAIN
            if i < end and (text[i] == _DOT or text[i] == _LOWER_E or text[i] == _UPPER_E):
                return 0, LIST_NOT_PLAIN  # a float
            if digits > 10 or value > 0xFFFFFFFF or (negative and value != 0):
                status = LIST_OUT_OF_RANGE
            else:
                ids[count] = value
                count += 1
            i = _skip_space(text, i, end)
            if i == end:
                return 0, LIST_NOT_PLAIN
            if text[i] == _CLOSE:
                i += 1
                break
            if text[i] != _COMMA:
                return 0, LIST_NOT_PLAIN
            i = _skip_space(text, i + 1, end)
    if _skip_space(text, i, end) != end:
        return 0, LIST_NOT_PLAIN
    if status != LIST_OK:
        return 0, status
    return count - start_count, status


@njit(cache=True, nogil=True)
def parse_lists(text, ends):
    """Parse the JSON lists `text[ends[k-1]:ends[k]]` (`ends`: int64, cumulative).

    Returns (ids, id_ends, status): the in-range lists' ids back to back (uint32), where
    each list's ids end in them (int64, cumulative), and a status per list (int8).
    """
    commas = 0
    for i in range(text.shape[0]):
        if text[i] == _COMMA:
            commas += 1
    lists = ends.shape[0]
    ids = np.empty(commas + lists, dtype=np.uint32)  # no list holds more ids than that
    id_ends = np.empty(lists, dtype=np.int64)
    status = np.empty(lists, dtype=np.int8)
    count = 0
    begin = 0
    for k in range(lists):
        written, status[k] = _parse_list(text, begin, ends[k], ids, count)
        count += written
        id_ends[k] = count
        begin = ends[k]
    return ids[:count], id_ends, status


@njit(cache=True, inline="always")
def _decimal_width(v):
    if v < 100000:
        if v < 100:
            return 1 if v < 10 else 2
        if v < 10000:
            return 3 if v < 1000 else 4
        return 5
    if v < 10000000:
        return 6 if v < 1000000 else 7
    if v < 1000000000:
        return 8 if v < 100000000 else 9
    return 10


@njit(cache=True, nogil=True)
def write_lists(tokens, ends, out, pairs):
    """List k (``tokens[ends[k-1]:ends[k]]``) written as JSON into `out`, one after the
    other; returns where each ends. Digits are written from the last, two at a time."""
    list_ends = np.empty(ends.shape[0], dtype=np.int64)
    o = begin = 0
    for k in range(ends.shape[0]):
        out[o] = _OPEN
        o += 1
        for i in range(begin, ends[k]):
            v = np.int64(tokens[i])
            o += _decimal_width(v)
            e = o
            while v >= 100:
                pair = (v % 100) * 2
                v //= 100
                e -= 2
                out[e] = pairs[pair]
                out[e + 1] = pairs[pair + 1]
            if v >= 10:
                out[e - 2] = pairs[v * 2]
                out[e - 1] = pairs[v * 2 + 1]
            else:
                out[e - 1] = _ZERO + v
            out[o] = _COMMA
            o += 1
        if ends[k] > begin:
            o -= 1  # the last id's comma
        out[o] = _CLOSE
        o += 1
        list_ends[k] = o
        begin = ends[k]
    return list_ends
