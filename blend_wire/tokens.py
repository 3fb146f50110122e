"""The token codec: token ids as they travel (WIRE.md), and back to uint32 arrays.

Two forms, one module:
- blend lookups carry `tokens_b64`: little-endian uint32, standard base64 with padding
  (`encode_tokens` / `decode_tokens`; `WireError` saying why a text is not that).
- `/events` STORE entries carry `token_ids`, a JSON list of integers. Decoding one does
  not build a Python int per token: the decoder keeps each list as raw JSON
  (`msgspec.Raw`), and `token_lists_from_json` parses all the lists of a batch in one
  kernel call that runs without the GIL, so a coordinator's event loop goes on serving
  while a large batch is parsed. The result per list (`TokenIds`): a native uint32 array
  when every id is in `[0, 2^32)`; a `list[int]` when some id is outside it (not a
  validation error: LMCache answers 200 and treats the content as unknown, WIRE.md).
  Anything else is refused exactly as msgspec refuses it for `list[int]` (same message,
  e.g. ``Expected `int`, got `float` - at `$.token_ids[3]```): the kernel accepts only
  what msgspec accepts with the same values (tests/test_token_lists.py checks it against
  msgspec on generated valid and invalid lists), and hands anything else to msgspec.
  `token_ids_of` does the same for ids given in code (a list, a tuple, an array).
  `token_lists_to_json` is the way back: uint32 arrays to the JSON lists, one kernel call
  per batch, the bytes msgspec would write.

Kernels: plain array signatures, ``cache=True``, ``nogil=True`` (each is one call per
query or per batch, never per token or per entry: releasing and re-taking the GIL per
small call would make threads queue behind each other).
"""

from __future__ import annotations

import base64
from typing import Sequence, Union

import msgspec
import numpy as np
from numba import njit

from blend_wire import WireError  # defined before the package imports this module
from local_matcher.index import as_tokens

#: A list of token ids once decoded: uint32 ids, or the ints as given when one is
#: outside uint32 (such a list can only be recorded, never indexed).
TokenIds = Union[np.ndarray, list]
#: `token_ids` of an entry that carries none (read-only: shared by every such entry).
NO_TOKEN_IDS = np.zeros(0, dtype=np.uint32)
NO_TOKEN_IDS.flags.writeable = False


# --- tokens_b64 (blend lookups) -------------------------------------------------------------


def encode_tokens(tokens) -> str:
    """Pack token ids as little-endian uint32, then standard base64 with padding."""
    try:
        array = as_tokens(tokens)
    except ValueError as exc:
        raise WireError(str(exc)) from None
    return base64.b64encode(array.astype("<u4", copy=False).tobytes()).decode("ascii")


_B64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_B64_VALUES = np.full(256, 255, dtype=np.uint8)
_B64_VALUES[np.frombuffer(_B64_ALPHABET, dtype=np.uint8)] = np.arange(64, dtype=np.uint8)
_PAD = ord("=")


@njit(cache=True, nogil=True)
def _b64_decode(text, values):
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


def _bad_tokens(message: str, text: str) -> WireError:
    return WireError(message, loc=("body", "tokens_b64"), input=text[:64])


def decode_tokens(text: str) -> np.ndarray:
    """Inverse of `encode_tokens`: a native uint32 array, or `WireError` saying why not."""
    try:
        raw = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    except UnicodeEncodeError:
        raise _bad_tokens("tokens_b64 is not valid base64: it has non-ASCII characters",
                          text) from None
    if raw.size % 4:
        raise _bad_tokens(f"tokens_b64 is not valid base64: its length {raw.size} is not a "
                          "multiple of 4 (padding missing?)", text)
    decoded, bad_at = _b64_decode(raw, _B64_VALUES)
    if bad_at >= 0:
        raise _bad_tokens(f"tokens_b64 is not valid base64: character {chr(raw[bad_at])!r} "
                          f"at position {bad_at}", text)
    if decoded.size % 4:
        raise _bad_tokens(f"tokens_b64 decodes to {decoded.size} bytes, not a multiple of 4",
                          text)
    return decoded.view("<u4").astype(np.uint32, copy=False)


# --- token_ids (event entries): JSON lists of integers ---------------------------------------

_SPACE, _TAB, _LF, _CR = 32, 9, 10, 13
_COMMA, _MINUS, _OPEN, _CLOSE = 44, 45, 91, 93
_ZERO, _NINE, _DOT, _LOWER_E, _UPPER_E = 48, 57, 46, 101, 69
#: What the kernel says of one list.
LIST_OK, LIST_OUT_OF_RANGE, LIST_NOT_PLAIN = 0, 1, -1


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
def _parse_lists(text, ends):
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


_INT_LIST = msgspec.json.Decoder(list[int])


class BadTokenList(ValueError):
    """Token ids that are not a list of integers. The message is msgspec's for
    `list[int]`, its path under `$.token_ids`; `index` says which of the lists given."""

    def __init__(self, message: str, index: int = 0) -> None:
        super().__init__(message)
        self.index = index


def token_lists_from_json(lists: Sequence[msgspec.Raw]) -> list[TokenIds]:
    """Each raw JSON list as `TokenIds`, all parsed in one kernel call, or `BadTokenList`
    for the first that is not a list of integers."""
    if not lists:
        return []
    ends = np.cumsum(np.fromiter(map(len, lists), dtype=np.int64, count=len(lists)))
    ids, id_ends, status = _parse_lists(np.frombuffer(b"".join(lists), dtype=np.uint8), ends)
    out: list[TokenIds] = []
    begin = 0
    for k, end in enumerate(id_ends.tolist()):
        if status[k] == LIST_OK:
            out.append(ids[begin:end])
        else:  # rare: an id outside uint32, or not a list of integers at all
            try:
                out.append(_from_ints(_INT_LIST.decode(lists[k])))
            except msgspec.ValidationError as exc:
                raise BadTokenList(_under_token_ids(str(exc)), k) from None
        begin = end
    return out


def token_lists_to_json(arrays: Sequence[np.ndarray]) -> list[msgspec.Raw]:
    """Each uint32 array as the JSON list msgspec writes for its ids (``[1,22,333]``, no
    spaces), all written in one kernel call: no Python int per token. An entry holding
    the result as its `token_ids` encodes to the same bytes as one holding the array."""
    if not arrays:
        return []
    ends = np.cumsum(np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays)))
    tokens = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
    out = np.empty(11 * tokens.size + 2 * len(arrays), dtype=np.uint8)  # ids of <= 10 digits
    list_ends = _write_lists(tokens, ends, out, _DIGIT_PAIRS)
    # One bytes object for the batch; each list a view of it (no copy per list).
    text = memoryview(out[:list_ends[-1]].tobytes())
    bounds = [0, *list_ends.tolist()]
    return [msgspec.Raw(text[bounds[k]:bounds[k + 1]]) for k in range(len(arrays))]


#: "00" .. "99": two digits per lookup.
_DIGIT_PAIRS = np.frombuffer(b"".join(b"%02d" % i for i in range(100)), dtype=np.uint8).copy()


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
def _write_lists(tokens, ends, out, pairs):
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


def token_ids_of(values) -> TokenIds:
    """Token ids given in code (list, tuple, 1-D array; raw JSON too) as `TokenIds`;
    `BadTokenList` for what the wire would refuse (a float, a bool, a nested list)."""
    if type(values) is np.ndarray and values.dtype == np.uint32 and values.ndim == 1:
        return values
    if isinstance(values, msgspec.Raw):
        return token_lists_from_json([values])[0]
    try:
        array = as_tokens(values)
    except ValueError:
        pass  # an id outside uint32, or not integers: decided below, as on the wire
    else:
        if array.ndim != 1:
            raise BadTokenList(f"token_ids must be a flat list, not of shape {array.shape}")
        return array
    listed = values.tolist() if isinstance(values, np.ndarray) else list(values)
    try:
        return _from_ints(msgspec.convert(listed, list[int], strict=True))
    except msgspec.ValidationError as exc:
        raise BadTokenList(_under_token_ids(str(exc))) from None


def _from_ints(values: list[int]) -> TokenIds:
    """Python ints as `TokenIds`: uint32 when all fit, else the list itself."""
    if all(0 <= value <= 0xFFFFFFFF for value in values):
        return np.array(values, dtype=np.uint32)
    return values


def _under_token_ids(message: str) -> str:
    """msgspec's message for a `list[int]`, its path moved under `$.token_ids`."""
    if " - at `$" in message:
        return message.replace(" - at `$", " - at `$.token_ids", 1)
    return f"{message} - at `$.token_ids`"

