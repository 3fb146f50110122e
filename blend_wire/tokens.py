"""The token codec: token ids as they travel (WIRE.md), and back to uint32 arrays.

Two forms, one module:
- blend lookups carry `tokens_b64`: little-endian uint32, standard base64 with padding
  (`encode_tokens` / `decode_tokens`; `WireError` saying why a text is not that). The same
  base64 (`encode_b64` / `decode_b64`, one numba pass without the GIL) carries the
  candidates' columns form (WIRE.md): its integer columns (`encode_uints` /
  `decode_uints`: a width digit, then little-endian values of that width; `uints_in`
  counts them from the text's length), its hashes and its bitmap.
- `/events` STORE entries carry `token_ids`, a JSON list of integers. Decoding one does
  not build a Python int per token: the decoder keeps each list as raw JSON
  (`msgspec.Raw`), and `token_lists_from_json` parses all the lists of a batch in one
  kernel call that runs without the GIL, so a coordinator's event loop goes on serving
  while a large batch is parsed. `decode_batch` (the coordinator's `/events` path) goes
  further: one kernel call parses the entries' lists and cuts their members out of the
  text, msgspec decodes the rest (it would otherwise walk every list's bytes to find its
  end), and each entry is given its list; a batch with a list that is not plain uint32
  ids, or that the cut text does not decode to, is decoded as sent (same result, same
  refusal). The result per list (`TokenIds`): a native uint32 array
  when every id is in `[0, 2^32)`; a `list[int]` when some id is outside it (not a
  validation error: LMCache answers 200 and treats the content as unknown, WIRE.md).
  Anything else is refused exactly as msgspec refuses it for `list[int]` (same message,
  e.g. ``Expected `int`, got `float` - at `$.token_ids[3]```): the kernel accepts only
  what msgspec accepts with the same values (tests/wire/test_token_lists.py checks it against
  msgspec on generated valid and invalid lists), and hands anything else to msgspec.
  `token_ids_of` does the same for ids given in code (a list, a tuple, an array).
  `token_lists_to_json` is the way back: uint32 arrays to the JSON lists, one kernel call
  per batch, the bytes msgspec would write.

`as_tokens` is the one conversion of token ids given in code to a uint32 array (the local
matcher's index takes its input through it too). A list whose first id is an `int` (what a
serving process hands over) is converted by the standard library's `array`, about 5x
faster than numpy (66 vs 330 µs per 4,096 ids, 2-core AMD EPYC VM of docs/BENCHMARKS.md, load ~2, 2026-12-02); whatever that refuses (an id outside uint32, a float, a string) goes
through numpy as before, so results and errors are numpy's (tests/wire/test_token_lists.py
checks them against the numpy-only conversion). One difference: an object that is not a
number but has `__index__` is taken as its index in such a list, where numpy refused it. The kernels (`blend_wire.token_kernels`,
numba) are loaded on first use: `import blend_wire` loads no numba.
"""

from __future__ import annotations

import base64
import importlib
from array import array as _ints
from typing import Sequence, Union

import msgspec
import numpy as np

from blend_wire.values import LIST_NOT_PLAIN, LIST_OK, LIST_OUT_OF_RANGE, MAX_TOKEN_ID, WireError

#: A list of token ids once decoded: uint32 ids, or the ints as given when one is
#: outside uint32 (such a list can only be recorded, never indexed).
TokenIds = Union[np.ndarray, list]
#: `token_ids` of an entry that carries none (read-only: shared by every such entry).
NO_TOKEN_IDS = np.zeros(0, dtype=np.uint32)
NO_TOKEN_IDS.flags.writeable = False
#: The `array` type code of a 4-byte unsigned int (None where there is none).
_UINT32_CODE = next((code for code in "IL" if _ints(code).itemsize == 4), None)


def as_tokens(values) -> np.ndarray:
    """A contiguous uint32 array of token ids; ValueError for ids outside uint32."""
    if type(values) is list and values and type(values[0]) is int and _UINT32_CODE:
        # What a serving process hands over: a list of ints. `array` converts it in C,
        # several times faster than numpy; any id it refuses (outside uint32, not an
        # integer) goes the general way below, which says why, as before.
        try:
            return np.frombuffer(_ints(_UINT32_CODE, values), dtype=np.uint32)
        except (OverflowError, TypeError):
            pass
    array_ = np.asarray(values)
    if array_.dtype == np.uint32:
        return np.ascontiguousarray(array_)
    if array_.size == 0:
        return np.zeros(array_.shape, dtype=np.uint32)
    if array_.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, not {array_.dtype}")
    if array_.min() < 0 or array_.max() > MAX_TOKEN_ID:
        raise ValueError("token ids must fit in uint32 (0 .. 2**32-1)")
    return array_.astype(np.uint32)


def kernels():
    """blend_wire.token_kernels, imported on the first decode (numba is not needed before:
    a process that only encodes, a router, never loads it)."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = importlib.import_module("blend_wire.token_kernels")
    return _KERNELS


_KERNELS = None


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
# Two characters at once (the first in the low byte, as a little-endian uint16 reads them):
# their 12 bits, or 0xFFFF when either is not base64.
_B64_PAIRS = np.where((_B64_VALUES[:, None] == 255) | (_B64_VALUES[None, :] == 255), 0xFFFF,
                      (_B64_VALUES[None, :].astype(np.uint16) << 6)
                      | _B64_VALUES[:, None].astype(np.uint16)).astype(np.uint16).ravel()


def _bad_b64(message: str, text: str, field: str) -> WireError:
    return WireError(message, loc=("body", field), input=text[:64])


def decode_b64(text: str, field: str = "tokens_b64") -> np.ndarray:
    """Standard base64 with padding to a uint8 array (one numba pass, no GIL), or
    `WireError` naming `field` and saying why the text is not that."""
    try:
        raw = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    except UnicodeEncodeError:
        raise _bad_b64(f"{field} is not valid base64: it has non-ASCII characters",
                       text, field) from None
    if raw.size % 4:
        raise _bad_b64(f"{field} is not valid base64: its length {raw.size} is not a "
                       "multiple of 4 (padding missing?)", text, field)
    decoded, bad_at = kernels().b64_decode(raw, _B64_VALUES, _B64_PAIRS)
    if bad_at >= 0:
        raise _bad_b64(f"{field} is not valid base64: character {chr(raw[bad_at])!r} "
                       f"at position {bad_at}", text, field)
    return decoded


def decode_tokens(text: str) -> np.ndarray:
    """Inverse of `encode_tokens`: a native uint32 array, or `WireError` saying why not."""
    decoded = decode_b64(text, "tokens_b64")
    if decoded.size % 4:
        raise _bad_b64(f"tokens_b64 decodes to {decoded.size} bytes, not a multiple of 4",
                       text, "tokens_b64")
    return decoded.view("<u4").astype(np.uint32, copy=False)


# --- unsigned integer columns (the candidates' columns form) ---------------------------------

#: The widths an integer column may have, by its leading digit (bytes per value).
_UINT_WIDTHS = {"1": "<u1", "2": "<u2", "4": "<u4", "8": "<u8"}


def encode_b64(data) -> str:
    """Bytes (or an array's bytes) as standard base64 with padding."""
    return base64.b64encode(data).decode("ascii")


def encode_uints(values: np.ndarray) -> str:
    """Non-negative integers as a column: one digit, the narrowest width in bytes (1, 2,
    4 or 8) that holds the largest, then the values little-endian in base64 (WIRE.md)."""
    top = int(values.max()) if values.size else 0
    if values.size and values.dtype.kind != "u" and int(values.min()) < 0:
        raise WireError("an unsigned integer column cannot hold a negative value")
    width = "1" if top < 1 << 8 else "2" if top < 1 << 16 else "4" if top < 1 << 32 else "8"
    return width + encode_b64(np.ascontiguousarray(values, dtype=_UINT_WIDTHS[width]))


def decode_uints(text: str, field: str) -> np.ndarray:
    """Inverse of `encode_uints`: the values as an unsigned array of the column's width
    (native byte order; any value the width holds), or `WireError` saying why not."""
    dtype = _UINT_WIDTHS.get(text[:1])
    if dtype is None:
        raise _bad_b64(f"{field} is not an integer column: it must start with its width "
                       "in bytes, 1, 2, 4 or 8", text, field)
    decoded = decode_b64(text[1:], field)
    width = int(text[0])
    if decoded.size % width:
        raise _bad_b64(f"{field} decodes to {decoded.size} bytes, not a multiple of its "
                       f"width {width}", text, field)
    return decoded.view(dtype).astype(dtype[1:], copy=False)


def uints_in(text: str) -> int:
    """How many values an `encode_uints` column holds, from its length alone (no decoding:
    for counting what a reply holds)."""
    if text[:1] not in _UINT_WIDTHS or len(text) < 5:
        return 0
    size = (len(text) - 1) // 4 * 3 - text.endswith("=") - text.endswith("==")
    return size // int(text[0])


# --- token_ids (event entries): JSON lists of integers ---------------------------------------

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
    text = np.frombuffer(b"".join(lists), dtype=np.uint8)
    ids, id_ends, status = kernels().parse_lists(text, ends)
    bounds = [0, *id_ends.tolist()]
    if not status.any():  # the usual case: every list plain and in range
        return [ids[bounds[k]:bounds[k + 1]] for k in range(len(lists))]
    out: list[TokenIds] = []
    for k, list_status in enumerate(status.tolist()):
        if list_status == LIST_OK:
            out.append(ids[bounds[k]:bounds[k + 1]])
        else:  # rare: an id outside uint32, or not a list of integers at all
            try:
                out.append(_from_ints(_INT_LIST.decode(lists[k])))
            except msgspec.ValidationError as exc:
                raise BadTokenList(_under_token_ids(str(exc)), k) from None
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
    list_ends = kernels().write_lists(tokens, ends, out, _DIGIT_PAIRS)
    # One bytes object for the batch; each list a view of it (no copy per list).
    text = memoryview(out[:list_ends[-1]].tobytes())
    bounds = [0, *list_ends.tolist()]
    return [msgspec.Raw(text[bounds[k]:bounds[k + 1]]) for k in range(len(arrays))]


#: "00" .. "99": two digits per lookup.
_DIGIT_PAIRS = np.frombuffer(b"".join(b"%02d" % i for i in range(100)), dtype=np.uint8).copy()


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
    if all(0 <= value <= MAX_TOKEN_ID for value in values):
        return np.array(values, dtype=np.uint32)
    return values


def _under_token_ids(message: str) -> str:
    """msgspec's message for a `list[int]`, its path moved under `$.token_ids`."""
    if " - at `$" in message:
        return message.replace(" - at `$", " - at `$.token_ids", 1)
    return f"{message} - at `$.token_ids`"

