"""The numba kernels of the token codec (blend_wire.tokens loads this module on first use,
so `import blend_wire` loads no numba).

Plain array signatures, ``cache=True``, ``nogil=True`` (each is one call per query or per
batch, never per token or per entry: releasing and re-taking the GIL per small call would
make threads queue behind each other).
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros

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
def _at(text, i):
    return text[np.uint64(i)]  # unsigned: no negative-index wraparound on every byte


@njit(cache=True, inline="always")
def _is_space(c):
    return c == _SPACE or c == _LF or c == _CR or c == _TAB


@njit(cache=True, inline="always")
def _skip_space(text, i):
    """The first non-space byte from `i` on; callers know one lies ahead (a list's `]`)."""
    c = _at(text, i)
    while c <= _SPACE and _is_space(c):
        i += 1
        c = _at(text, i)
    return i


_HIGH_NIBBLES = np.uint64(0xF0F0F0F0F0F0F0F0)
_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_ASCII_ZEROS = np.uint64(0x3030303030303030)
_SIXES = np.uint64(0x0606060606060606)
_LOW_SEVEN_BITS = np.uint64(0x7F7F7F7F7F7F7F7F)
_HIGH_BITS = np.uint64(0x8080808080808080)


@njit(cache=True, inline="always")
def _word_at(text, i):
    """The 8 bytes from `i`, the first in the lowest byte (one load)."""
    word = np.uint64(0)
    for k in range(8):
        word |= np.uint64(_at(text, i + k)) << np.uint64(8 * k)
    return word


@njit(cache=True, inline="always")
def _leading_digits(word):
    """How many of the word's bytes, from its lowest, are ASCII digits (0 to 8)."""
    # A byte is a digit when its high nibble is 3 and stays 3 once 6 is added (low <= 9).
    other = ((word & _HIGH_NIBBLES) ^ _ASCII_ZEROS) | (((word + _SIXES) & _HIGH_NIBBLES)
                                                       ^ _ASCII_ZEROS)
    flags = (((other & _LOW_SEVEN_BITS) + _LOW_SEVEN_BITS) | other) & _HIGH_BITS
    if flags == 0:
        return 8
    return np.int64(trailing_zeros(flags)) >> 3


@njit(cache=True, inline="always")
def _digits_value(word, n):
    """The number the word's `n` (1 to 8) lowest bytes spell, ASCII digits, most
    significant first: digits paired, then pairs paired, then quads, by multiplication."""
    word = (word << np.uint64(64 - 8 * n)) & _LOW_NIBBLES
    word = (word * np.uint64(10 * 256 + 1)) >> np.uint64(8)
    word = ((word & np.uint64(0x00FF00FF00FF00FF)) * np.uint64(100 * 65536 + 1)) \
        >> np.uint64(16)
    return np.int64(((word & np.uint64(0x0000FFFF0000FFFF)) * np.uint64(10000 * 2**32 + 1))
                    >> np.uint64(32))


@njit(cache=True, inline="always")
def _parse_list(text, begin, end, ids, count):
    """Parse `text[begin:end]` as a JSON array of integers, writing in-range ids to
    `ids[count:]`. Returns (ids written, LIST_OK | LIST_OUT_OF_RANGE | LIST_NOT_PLAIN).

    Accepts exactly `ws [ ws ] ws` or `ws [ ws int (ws , ws int)* ws ] ws`, an int being
    JSON's `-?(0|[1-9][0-9]*)` (so `-0` is 0, as msgspec reads it). A fraction or an
    exponent (a float to msgspec), anything that is not a number, and any malformed text
    are LIST_NOT_PLAIN: msgspec decides and words the error.
    """
    close = end - 1
    while close >= begin and _is_space(_at(text, close)):
        close -= 1
    # Every scan below stops at this `]` at the latest: no bounds test per byte.
    if close < begin or _at(text, close) != _CLOSE:
        return 0, LIST_NOT_PLAIN
    i = _skip_space(text, begin)
    if i == close or _at(text, i) != _OPEN:
        return 0, LIST_NOT_PLAIN
    i = _skip_space(text, i + 1)
    start_count = count
    status = LIST_OK
    last_word = text.shape[0] - 8
    if _at(text, i) != _CLOSE:
        while True:
            if i <= last_word:
                # The usual item, up to 7 digits and a comma, read from one word.
                word = _word_at(text, i)
                digits = _leading_digits(word)
                if 0 < digits < 8 and (word >> np.uint64(8 * digits)) & np.uint64(255) \
                        == _COMMA and (digits == 1 or word & np.uint64(255) != _ZERO):
                    ids[count] = _digits_value(word, digits)
                    count += 1
                    i += digits + 1
                    if _at(text, i) <= _SPACE:  # `, ` (Python's json) or more
                        i = _skip_space(text, i)
                    continue
            negative = _at(text, i) == _MINUS
            if negative:
                i += 1
            first = i
            value = 0
            digit = np.int64(_at(text, i)) - _ZERO
            while 0 <= digit <= 9:
                value = value * 10 + digit  # wraps past 19 digits: out of range anyway
                i += 1
                digit = np.int64(_at(text, i)) - _ZERO
            digits = i - first
            c = _at(text, i)
            if digits == 0 or (digits > 1 and _at(text, first) == _ZERO):
                return 0, LIST_NOT_PLAIN
            if c == _DOT or c == _LOWER_E or c == _UPPER_E:
                return 0, LIST_NOT_PLAIN  # a float
            if digits > 10 or value > 0xFFFFFFFF or (negative and value != 0):
                status = LIST_OUT_OF_RANGE
            else:
                ids[count] = value
                count += 1
            if c <= _SPACE:
                i = _skip_space(text, i)
                c = _at(text, i)
            if c == _CLOSE:
                break
            if c != _COMMA:
                return 0, LIST_NOT_PLAIN
            i = _skip_space(text, i + 1)
    if i != close:
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
        commas += text[i] == _COMMA
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
