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

from blend_wire.values import LIST_NOT_PLAIN, LIST_OK, LIST_OUT_OF_RANGE, MAX_TOKEN_ID

_PAD = ord("=")
_SPACE, _TAB, _LF, _CR = 32, 9, 10, 13
_COMMA, _MINUS, _OPEN, _CLOSE = 44, 45, 91, 93
_QUOTE, _BACKSLASH, _COLON, _OPEN_OBJECT, _CLOSE_OBJECT = 34, 92, 58, 123, 125
_ZERO, _NINE, _DOT, _LOWER_E, _UPPER_E = 48, 57, 46, 101, 69


@njit(cache=True, nogil=True)
def b64_decode(text, values, pairs):
    """Strict base64 to bytes; returns (bytes, -1) or (empty, index of the first bad char).

    `values` maps a character to its 6 bits (255: not base64), `pairs` two characters (the
    first in the low byte) to their 12 bits (0xFFFF: either is not): a group of four is two
    lookups, and a bad character is looked for only once some pair had one. Runs without
    the GIL: a coordinator may decode a query on a worker thread while its loop serves.
    """
    n = text.shape[0]
    pad = 0
    if n >= 1 and text[n - 1] == _PAD:
        pad = 2 if n >= 2 and text[n - 2] == _PAD else 1
    out = np.empty(n // 4 * 3, dtype=np.uint8)
    words = text.view(np.uint16)
    groups = n // 4 - (1 if pad else 0)  # a padded last group is decoded on its own below
    bad = np.uint32(0)
    for g in range(groups):
        high = np.uint32(pairs[words[2 * g]])
        low = np.uint32(pairs[words[2 * g + 1]])
        bad |= high | low
        bits = (high << np.uint32(12)) | low
        out[3 * g] = np.uint8(bits >> np.uint32(16))
        out[3 * g + 1] = np.uint8(bits >> np.uint32(8))
        out[3 * g + 2] = np.uint8(bits)
    if pad:
        bits = np.uint32(0)
        for j in range(4):
            v = np.uint32(values[text[4 * groups + j]])
            if j >= 4 - pad:
                v = np.uint32(0)  # padding, checked to be only at the very end
            bad |= v << np.uint32(6)  # 255 sets bits above the 12 a pair has
            bits = (bits << np.uint32(6)) | (v & np.uint32(63))
        out[3 * groups] = np.uint8(bits >> np.uint32(16))
        out[3 * groups + 1] = np.uint8(bits >> np.uint32(8))
        out[3 * groups + 2] = np.uint8(bits)
    if bad >= np.uint32(4096):
        for i in range(n - pad):
            if values[text[i]] == 255:
                return out[:0], i
    return out[: out.shape[0] - pad], -1


# Bytes are read at unsigned indices (`text[np.uint64(i)]`: no negative-index wraparound
# on every byte), spaces told by a table: each small helper would be one more compilation.
_IS_SPACE = np.zeros(256, dtype=np.bool_)
_IS_SPACE[[_SPACE, _TAB, _LF, _CR]] = True


@njit(cache=True)
def _skip_space(text, i):
    """The first non-space byte from `i` on; callers know one lies ahead (a list's `]`)."""
    c = text[np.uint64(i)]
    while c <= _SPACE and _IS_SPACE[c]:
        i += 1
        c = text[np.uint64(i)]
    return i


_HIGH_NIBBLES = np.uint64(0xF0F0F0F0F0F0F0F0)
_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_ASCII_ZEROS = np.uint64(0x3030303030303030)
_SIXES = np.uint64(0x0606060606060606)
_LOW_SEVEN_BITS = np.uint64(0x7F7F7F7F7F7F7F7F)
_HIGH_BITS = np.uint64(0x8080808080808080)


@njit(cache=True)
def _word_at(text, i):
    """The 8 bytes from `i`, the first in the lowest byte (one load)."""
    word = np.uint64(0)
    for k in range(8):
        word |= np.uint64(text[np.uint64(i + k)]) << np.uint64(8 * k)
    return word


@njit(cache=True)
def _leading_digits(word):
    """How many of the word's bytes, from its lowest, are ASCII digits (0 to 8)."""
    # A byte is a digit when its high nibble is 3 and stays 3 once 6 is added (low <= 9).
    other = ((word & _HIGH_NIBBLES) ^ _ASCII_ZEROS) | (((word + _SIXES) & _HIGH_NIBBLES)
                                                       ^ _ASCII_ZEROS)
    flags = (((other & _LOW_SEVEN_BITS) + _LOW_SEVEN_BITS) | other) & _HIGH_BITS
    if flags == 0:
        return 8
    return np.int64(trailing_zeros(flags)) >> 3


@njit(cache=True)
def _digits_value(word, n):
    """The number the word's `n` (1 to 8) lowest bytes spell, ASCII digits, most
    significant first: digits paired, then pairs paired, then quads, by multiplication."""
    word = (word << np.uint64(64 - 8 * n)) & _LOW_NIBBLES
    word = (word * np.uint64(10 * 256 + 1)) >> np.uint64(8)
    word = ((word & np.uint64(0x00FF00FF00FF00FF)) * np.uint64(100 * 65536 + 1)) \
        >> np.uint64(16)
    return np.int64(((word & np.uint64(0x0000FFFF0000FFFF)) * np.uint64(10000 * 2**32 + 1))
                    >> np.uint64(32))


@njit(cache=True)
def _integer(text, i):
    """The JSON integer at `i`: (just past it, its value, LIST_OK), or LIST_OUT_OF_RANGE
    outside uint32, or LIST_NOT_PLAIN when it is not one (a float, a leading zero...)."""
    negative = text[np.uint64(i)] == _MINUS
    if negative:
        i += 1
    first = i
    value = 0
    digit = np.int64(text[np.uint64(i)]) - _ZERO
    while 0 <= digit <= 9:
        value = value * 10 + digit  # wraps past 19 digits: out of range anyway
        i += 1
        digit = np.int64(text[np.uint64(i)]) - _ZERO
    digits = i - first
    c = text[np.uint64(i)]
    if digits == 0 or (digits > 1 and text[np.uint64(first)] == _ZERO):
        return i, 0, LIST_NOT_PLAIN
    if c == _DOT or c == _LOWER_E or c == _UPPER_E:
        return i, 0, LIST_NOT_PLAIN  # a float
    if digits > 10 or value > MAX_TOKEN_ID or (negative and value != 0):
        return i, 0, LIST_OUT_OF_RANGE
    return i, value, LIST_OK


@njit(cache=True)
def _parse_array(text, i, ids, count):
    """Parse the JSON array of integers opening at `i` (a `[`), writing in-range ids to
    `ids[count:]`: (just past its `]`, ids written, LIST_OK | LIST_OUT_OF_RANGE |
    LIST_NOT_PLAIN). The caller knows a byte that is neither a digit nor a space ends the
    text (every scan stops there at the latest: no bounds test per byte).

    Accepts exactly `[ ws ]` or `[ ws int (ws , ws int)* ws ]`, an int being JSON's
    `-?(0|[1-9][0-9]*)` (so `-0` is 0, as msgspec reads it). A fraction or an exponent (a
    float to msgspec), anything that is not a number, and any malformed text are
    LIST_NOT_PLAIN: msgspec decides and words the error.
    """
    start_count = count
    status = LIST_OK
    last_word = text.shape[0] - 8
    i = _skip_space(text, i + 1)
    if text[np.uint64(i)] != _CLOSE:
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
                    if text[np.uint64(i)] <= _SPACE:  # `, ` (Python's json) or more
                        i = _skip_space(text, i)
                    continue
            i, value, item_status = _integer(text, i)
            if item_status == LIST_NOT_PLAIN:
                return i, 0, LIST_NOT_PLAIN
            if item_status == LIST_OUT_OF_RANGE:
                status = LIST_OUT_OF_RANGE
            else:
                ids[count] = value
                count += 1
            c = text[np.uint64(i)]
            if c <= _SPACE:
                i = _skip_space(text, i)
                c = text[np.uint64(i)]
            if c == _CLOSE:
                break
            if c != _COMMA:
                return i, 0, LIST_NOT_PLAIN
            i = _skip_space(text, i + 1)
    if status != LIST_OK:
        return i + 1, 0, status
    return i + 1, count - start_count, status


@njit(cache=True)
def _parse_list(text, begin, end, ids, count):
    """`text[begin:end]` as `ws array ws` (`_parse_array`): (ids written, status)."""
    close = end - 1
    while close >= begin and _IS_SPACE[text[np.uint64(close)]]:
        close -= 1
    if close < begin or text[np.uint64(close)] != _CLOSE:  # where the array's scans stop
        return 0, LIST_NOT_PLAIN
    i = _skip_space(text, begin)
    if i == close or text[np.uint64(i)] != _OPEN:
        return 0, LIST_NOT_PLAIN
    i, written, status = _parse_array(text, i, ids, count)
    if i != close + 1:
        return 0, LIST_NOT_PLAIN
    return written, status


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


_ONES = np.uint64(0x0101010101010101)
_QUOTES = np.uint64(0x2222222222222222)
_BACKSLASHES = np.uint64(0x5C5C5C5C5C5C5C5C)
_TO_HIGH_BIT = np.uint64(0x2525252525252525)  # added, sets the high bit of bytes >= `[`


@njit(cache=True)
def _has_byte(word, repeated):
    """Whether one of the word's bytes is the byte `repeated` repeats."""
    x = word ^ repeated
    return ((x - _ONES) & ~x & _HIGH_BITS) != 0


@njit(cache=True)
def _skip_space_until(text, i, n):
    while i < n and _IS_SPACE[text[np.uint64(i)]]:
        i += 1
    return i


@njit(cache=True)
def _string_end(text, i, n):
    """Just past the string whose opening quote is before `i`, or -1."""
    while i < n:
        if i + 8 <= n:
            word = _word_at(text, i)
            if not (_has_byte(word, _QUOTES) or _has_byte(word, _BACKSLASHES)):
                i += 8
                continue
        c = text[np.uint64(i)]
        i += 1
        if c == _QUOTE:
            return i
        if c == _BACKSLASH:
            i += 1
    return -1


@njit(cache=True)
def _value_end(text, i, n):
    """Just past the JSON value at `i`, by its brackets and strings only, or -1."""
    c = text[np.uint64(i)]
    if c == _QUOTE:
        return _string_end(text, i + 1, n)
    if c != _OPEN_OBJECT and c != _OPEN:
        start = i
        while i < n:
            c = text[np.uint64(i)]
            if _IS_SPACE[c] or c == _COMMA or c == _CLOSE or c == _CLOSE_OBJECT:
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
        c = text[np.uint64(i)]
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


@njit(cache=True)
def _after(text, i, n, byte):
    """Past `byte` if it comes next (after spaces), else -1."""
    i = _skip_space_until(text, i, n)
    return i + 1 if i < n and text[np.uint64(i)] == byte else -1


@njit(cache=True)
def _after_key(text, i, n, key):
    """Past `key` (its bytes) if it comes next (after spaces), else -1."""
    i = _skip_space_until(text, i, n)
    return i + key.shape[0] if _is_text(text, i, min(i + key.shape[0], n), key) else -1


@njit(cache=True, nogil=True)
def array_items(text, key):
    """Where each item of the array in `text` begins and ends (int64 pairs), when `text`
    is a JSON object of that array only, under `key` (its quoted bytes): `{ key : [ items
    ] }`, spaces around any of them. Else None.

    Items are found by their brackets and strings alone: this is no JSON check (decoding
    each item is)."""
    n = text.shape[0]
    i = _after(text, 0, n, _OPEN_OBJECT)
    i = _after_key(text, i, n, key) if i >= 0 else -1
    i = _after(text, i, n, _COLON) if i >= 0 else -1
    i = _after(text, i, n, _OPEN) if i >= 0 else -1
    if i < 0:
        return None
    bounds = np.empty(64, dtype=np.int64)
    count = 0
    i = _skip_space_until(text, i, n)
    if i < n and text[np.uint64(i)] == _CLOSE:
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
            if i < n and text[np.uint64(i)] == _CLOSE:
                i += 1
                break
            if i == n or text[np.uint64(i)] != _COMMA:
                return None
            i = _skip_space_until(text, i + 1, n)
    i = _after(text, i, n, _CLOSE_OBJECT)
    if i < 0 or _skip_space_until(text, i, n) != n:
        return None
    return bounds[:2 * count]


@njit(cache=True)
def _grown(array, needed):
    if needed <= array.shape[0]:
        return array
    more = np.empty(2 * needed, dtype=array.dtype)
    more[:array.shape[0]] = array
    return more


@njit(cache=True)
def _is_text(text, begin, end, token):
    if end - begin != token.shape[0]:
        return False
    for k in range(token.shape[0]):
        if text[np.uint64(begin + k)] != token[k]:
            return False
    return True


@njit(cache=True)
def _most_ids(text):
    """No list in `text` holds more ids than its commas, one more per list."""
    most = 1
    for i in range(text.shape[0]):
        most += (text[i] == _COMMA) | (text[i] == _OPEN)
    return most


@njit(cache=True)
def _plain_run_end(text, i, n):
    """Past the whole words from `i` holding no quote and no bracket (token ids, mostly)."""
    while i + 8 <= n:
        word = _word_at(text, i)
        if _has_byte(word, _QUOTES) or (word | (word + _TO_HIGH_BIT)) & _HIGH_BITS:
            break
        i += 8
    return i


@njit(cache=True)
def _copy(text, begin, end, out, o):
    for k in range(begin, end):
        out[o] = text[np.uint64(k)]
        o += 1
    return o


@njit(cache=True)
def _cut_member(text, colon, n, out, o, ids, count):
    """Parse the list after the `:` at `colon` and drop its member (and a comma) from
    `out`, which ends before its key: (where the text goes on, where `out` goes on, ids
    written), or (-1, ...) if it is not a plain list of uint32 ids in a plain member."""
    start = _skip_space_until(text, colon + 1, n)
    if text[np.uint64(start)] != _OPEN:
        return -1, o, 0
    end, written, status = _parse_array(text, start, ids, count)
    if status != LIST_OK:
        return -1, o, 0
    before = o - 1
    while before >= 0 and _IS_SPACE[out[before]]:
        before -= 1
    after = _skip_space_until(text, end, n)
    if before < 0 or (out[before] != _COMMA and out[before] != _OPEN_OBJECT) \
            or (text[np.uint64(after)] != _COMMA and text[np.uint64(after)] != _CLOSE_OBJECT):
        return -1, o, 0
    if out[before] == _COMMA:  # `, "token_ids": [...]` goes
        return end, before, written
    # The first member: `"token_ids": [...] ,` goes.
    return (after + 1 if text[np.uint64(after)] == _COMMA else end), before + 1, written


@njit(cache=True, nogil=True)
def cut_token_lists(text, entries_key, token_ids_key):
    """`text` (a JSON object) without the member `token_ids_key` of each object in its
    list under `entries_key`, and those members' lists parsed: (the text, ids (uint32),
    where each list's ids end (int64, cumulative), its entry (int64); in the text's order,
    so an entry's last is the one msgspec reads). None unless all are plain lists of
    uint32 ids and `entries_key` comes once. Found by brackets and strings, no JSON check
    (the cut text's decoding is: it refuses what the text would be refused for)."""
    n = text.shape[0]
    if n == 0 or text[np.uint64(n - 1)] != _CLOSE_OBJECT:  # where every scan stops
        return None
    out = np.empty(n, dtype=np.uint8)
    ids = np.empty(_most_ids(text), dtype=np.uint32)
    id_ends = np.empty(64, dtype=np.int64)
    entry_of = np.empty(64, dtype=np.int64)
    lists = count = o = i = depth = 0
    entries_at = entries_depth = entry = -1
    while i < n:
        run = _plain_run_end(text, i, n)
        if run > i:
            o = _copy(text, i, run, out, o)
            i = run
            continue
        c = text[np.uint64(i)]
        if c == _QUOTE:
            end = _string_end(text, i + 1, n)
            if end < 0:
                return None
            colon = _skip_space_until(text, end, n)
            if text[np.uint64(colon)] == _COLON and _is_text(text, i, end, entries_key) \
                    and depth == 1:
                if entries_at >= 0:
                    return None
                entries_at = _skip_space_until(text, colon + 1, n)
            elif text[np.uint64(colon)] == _COLON and _is_text(text, i, end, token_ids_key):
                if depth != 3 or entries_depth != 2:
                    return None  # not an entry's: msgspec ignores it
                i, o, written = _cut_member(text, colon, n, out, o, ids, count)
                if i < 0:
                    return None
                count += written
                id_ends, entry_of = _grown(id_ends, lists + 1), _grown(entry_of, lists + 1)
                id_ends[lists], entry_of[lists] = count, entry
                lists += 1
                continue
            o, i = _copy(text, i, end, out, o), end
            continue
        if c == _OPEN_OBJECT or c == _OPEN:
            depth += 1
            if i == entries_at and c == _OPEN:
                entries_depth = depth
            elif depth == 3 and entries_depth == 2:
                entry += 1
        elif c == _CLOSE_OBJECT or c == _CLOSE:
            if depth == entries_depth:
                entries_depth = -1
            depth -= 1
        out[o] = c
        o += 1
        i += 1
    return out[:o], ids[:count], id_ends[:lists], entry_of[:lists]


@njit(cache=True)
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
