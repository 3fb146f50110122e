"""Encoding and validated decoding: `decode(body, Shape)` returns a fully checked value or
raises `WireError` naming the field, in FastAPI's 422 shape too (`WireError.detail`).
docs/WIRE.md.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec
import numpy as np

from blend_wire.values import WireError


T = TypeVar("T")
_decoders: dict[type, msgspec.json.Decoder] = {}


def _encode_more(value: Any) -> Any:
    """What msgspec cannot encode itself: token ids held as an array."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


encode = msgspec.json.Encoder(enc_hook=_encode_more).encode


def decode(body: bytes | str, shape: type[T]) -> T:
    """Decode and validate a JSON body as `shape`, or raise `WireError` naming the field."""
    decoder = _decoders.get(shape)
    if decoder is None:
        decoder = _decoders[shape] = msgspec.json.Decoder(shape)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise _validation_error(exc, "body", body) from None
    except msgspec.DecodeError as exc:
        raise WireError(f"body is not valid JSON: {exc}", kind="json_invalid") from None
    except RecursionError:
        # msgspec skips unknown fields recursively: a value nested ~100k deep runs out of
        # stack. No wire shape nests more than a few levels, so such a body is malformed.
        raise WireError("body is nested too deeply to be any wire shape",
                        kind="json_invalid") from None


def convert_query(params: dict[str, str], shape: type[T]) -> T:
    """Validate URL query parameters as `shape` (numbers given as text are converted)."""
    try:
        return msgspec.convert(params, shape, strict=False)
    except msgspec.ValidationError as exc:
        raise _validation_error(exc, "query", params) from None


# --- validation errors in FastAPI's shape (cold path: only a rejected request gets here) ---

_AT = re.compile(r" - at `\$(.*)`$")
_NESTED_AT = re.compile(r" - at `\$([^`]*)` - at `\$([^`]*)`$")
_STEP = re.compile(r"\.([^.\[]+)|\[(-?\d+)\]|\[([^\]]*)\]")
_TYPE_NAMES = {"int": "int_type", "str": "string_type", "float": "float_type",
               "bool": "bool_type", "array": "list_type", "object": "dict_type"}


def _validation_error(exc: msgspec.ValidationError, where: str, raw: Any) -> WireError:
    # A rule that names a field inside its struct (`$.entries[2].token_ids[3]`) is reported
    # by msgspec at the struct (`... - at `$.batches[0]``): one path, outer then inner.
    message = _NESTED_AT.sub(r" - at `$\2\1`", str(exc))
    path: list = []
    at = _AT.search(message)
    if at:
        for name, index, other in _STEP.findall(at.group(1)):
            path.append(name if name else int(index) if index else other)
    missing = re.match(r"Object missing required field `([^`]+)`", message)
    if missing:
        kind = "missing"
        path.append(missing.group(1))
    elif message.startswith("Invalid enum value"):
        kind = "literal_error"
    elif re.match(r"Expected `\w+` >=", message):
        kind = "greater_than_equal"
    elif re.match(r"Expected `\w+` <=", message):
        kind = "less_than_equal"
    elif re.match(r"Expected `str` of length", message):
        kind = "string_too_short" if ">=" in message else "string_too_long"
    elif re.match(r"Expected `str` matching regex", message):
        kind = "string_pattern_mismatch"
    elif (typed := re.match(r"Expected `(\w+)`(?: \| `\w+`)*, got", message)):
        kind = _TYPE_NAMES.get(typed.group(1), "type_error")
    else:
        kind = "value_error"  # a rule of the shape (`__post_init__`)
    return WireError(message, loc=(where, *path), kind=kind,
                     input=_value_at(raw, path, missing is not None))


def _value_at(raw: Any, path: list, parent: bool) -> Any:
    """The offending value, found by walking the request again (None if not found)."""
    try:
        value = (msgspec.json.decode(raw) if isinstance(raw, (bytes, str, msgspec.Raw))
                 else raw)
        for step in path[:-1] if parent else path:
            value = value[step]
    except Exception:  # the input is illustration only: never fail the error path
        return None
    if isinstance(value, str) and len(value) > 256:
        return value[:256]
    if isinstance(value, (list, dict)) and len(value) > 16:
        return None  # FastAPI echoes it; we spare the reply a copy of a huge body
    return value

