"""The numba kernels of the wire package: the token codec's, and the scan that finds an
`/events` body's batches (blend_wire.tokens loads this module on first use, so
`import blend_wire` loads no numba).

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
_QUOTE, _BACKSLASH, _COLON, _OPEN_OBJECT, _CLOSE_OBJECT = 34, 92, 58, 123, 125
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
def _integer(text, i):
    """The JSON integer at `i`: (just past it, its value, LIST_OK), or LIST_OUT_OF_RANGE
    outside uint32, or LIST_NOT_PLAIN when it is not one (a float, a leading zero...)."""
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
        return i, 0, LIST_NOT_PLAIN
    if c == _DOT or c == _LOWER_E or c == _UPPER_E:
        return i, 0, LIST_NOT_PLAIN  # a float
    if digits > 10 or value > 0xFFFFFFFF or (negative and value != 0):
        return i, 0, LIST_OUT_OF_RANGE
    return i, value, LIST_OK


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
            i, value, item_status = _integer(text, i)
            if item_status == LIST_NOT_PLAIN:
                return 0, LIST_NOT_PLAIN
            if item_status == LIST_OUT_OF_RANGE:
                status = LIST_OUT_OF_RANGE
            else:
                ids[count] = value
                count += 1
            c = _at(text, i)
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


_OBJECT_OPENING = np.array([_OPEN_OBJECT], dtype=np.uint8)
_COLON_OPENING = np.array([_COLON], dtype=np.uint8)
_ARRAY_OPENING = np.array([_OPEN], dtype=np.uint8)
_OBJECT_CLOSING = np.array([_CLOSE_OBJECT], dtype=np.uint8)
_ONES = np.uint64(0x0101010101010101)
_QUOTES = np.uint64(0x2222222222222222)
_BACKSLASHES = np.uint64(0x5C5C5C5C5C5C5C5C)
_TO_HIGH_BIT = np.uint64(0x2525252525252525)  # added, sets the high bit of bytes >= `[`


@njit(cache=True, inline="always")
def _has_byte(word, repeated):
    """Whether one of the word's bytes is the byte `repeated` repeats."""
    x = word ^ repeated
    return ((x - _ONES) & ~x & _HIGH_BITS) != 0


@njit(cache=True, inline="always")
def _skip_space_until(text, i, n):
    while i < n and _is_space(_at(text, i)):
        i += 1
    return i


@njit(cache=True, inline="always")
def _string_end(text, i, n):
    """Just past the string whose opening quote is before `i`, or -1."""
    while i < n:
        if i + 8 <= n:
            word = _word_at(text, i)
            if not (_has_byte(word, _QUOTES) or _has_byte(word, _BACKSLASHES)):
                i += 8
                continue
        c = _at(text, i)
        i += 1
        if c == _QUOTE:
            return i
        if c == _BACKSLASH:
            i += 1
    return -1


@njit(cache=True, inline="always")
def _value_end(text, i, n):
    """Just past the JSON value at `i`, by its brackets and strings only, or -1."""
    c = _at(text, i)
    if c == _QUOTE:
        return _string_end(text, i + 1, n)
    if c != _OPEN_OBJECT and c != _OPEN:
        start = i
        while i < n:
            c = _at(text, i)
            if _is_space(c) or c == _COMMA or c == _CLOSE or c == _CLOSE_OBJECT:
                break
            i += 1
        return i if i > start else -1
    depth = 0
    while i < n:
        if i + 8 <= n:
            # Eight bytes at once while none is a quote or a bracket (token ids, mostly).
            word = _word_at(text, i)
            if not (_has_byte(word, _QUOTES) or (word | (word + _TO_HIGH_BIT)) & _HIGH_BITS):
                i += 8
                continue
        c = _at(text, i)
        i += 1
        if c == _QUOTE:
            i = _string_end(text, i, n)
            if i < 0:
                return -1
        elif c == _OPEN_OBJECT or c == _OPEN:
            depth += 1
        elif c == _CLOSE_OBJECT or c == _CLOSE:
            depth -= 1
            if depth == 0:
                return i
    return -1


@njit(cache=True, inline="always")
def _after(text, i, n, token):
    """Past `token` if it comes next (after spaces), else -1."""
    i = _skip_space_until(text, i, n)
    if i + token.shape[0] > n:
        return -1
    for k in range(token.shape[0]):
        if _at(text, i + k) != token[k]:
            return -1
    return i + token.shape[0]


@njit(cache=True, nogil=True)
def array_items(text, key):
    """Where each item of the array in `text` begins and ends (int64 pairs), when `text`
    is a JSON object of that array only, under `key` (its quoted bytes): `{ key : [ items
    ] }`, spaces around any of them. Else None.

    Items are found by their brackets and strings alone: this is no JSON check (decoding
    each item is)."""
    n = text.shape[0]
    i = _after(text, 0, n, _OBJECT_OPENING)
    i = _after(text, i, n, key) if i >= 0 else -1
    i = _after(text, i, n, _COLON_OPENING) if i >= 0 else -1
    i = _after(text, i, n, _ARRAY_OPENING) if i >= 0 else -1
    if i < 0:
        return None
    bounds = np.empty(64, dtype=np.int64)
    count = 0
    i = _skip_space_until(text, i, n)
    if i < n and _at(text, i) == _CLOSE:
        i += 1
    else:
        while True:
            end = _value_end(text, i, n) if i < n else -1
            if end < 0:
                return None
            if 2 * count + 2 > bounds.shape[0]:
                more = np.empty(2 * bounds.shape[0], dtype=np.int64)
                more[:bounds.shape[0]] = bounds
                bounds = more
            bounds[2 * count] = i
            bounds[2 * count + 1] = end
            count += 1
            i = _skip_space_until(text, end, n)
            if i < n and _at(text, i) == _CLOSE:
                i += 1
                break
            if i == n or _at(text, i) != _COMMA:
                return None
            i = _skip_space_until(text, i + 1, n)
    i = _after(text, i, n, _OBJECT_CLOSING)
    if i < 0 or _skip_space_until(text, i, n) != n:
        return None
    return bounds[:2 * count]


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
