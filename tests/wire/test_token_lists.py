"""`token_ids` of event entries (blend_wire.tokens): JSON lists of integers parsed by a
kernel, checked against msgspec's own `list[int]` decoding, which the wire contract was
written for: the same lists accepted with the same values, the same ones refused with the
same message, an id outside uint32 kept (a miss, not an error: WIRE.md)."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blend_wire import (CacheEventEntry, EncodedObjectKey, EventsRequest,
                        WireError, decode, encode, token_ids_of, token_lists_from_json,
                        token_lists_to_json)
from blend_wire.token_kernels import parse_lists
from blend_wire.tokens import LIST_NOT_PLAIN, LIST_OK, LIST_OUT_OF_RANGE, BadTokenList

LANE = "unit"

_REFERENCE = msgspec.json.Decoder(list[int])

# --- generated lists ---------------------------------------------------------------------

_SPACE = st.sampled_from(["", "", " ", "\t", "\n", "\r", " \n\t "])
_NUMBER = st.one_of(
    st.integers(0, 2**32 + 8).map(str),                        # around the uint32 edge
    st.integers(-2**70, 2**70).map(str),                       # negative and huge
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.from_regex(r"-?(0|[1-9][0-9]{0,24})(\.[0-9]{1,3})?([eE][+-]?[0-9]{1,3})?",
                  fullmatch=True),                             # fractions, exponents
    st.from_regex(r"[-+]?0[0-9]{1,3}|-|\+1|0x1|1_0|Infinity|NaN", fullmatch=True),
)
_NOT_A_NUMBER = st.sampled_from(["true", "false", "null", '"1"', '"a,b"', "[]", "[1]",
                                 "[[2]]", "{}", '{"a": 1}', ""])


@st.composite
def _list_texts(draw) -> bytes:
    """Mostly JSON lists of numbers, with every way of being something else mixed in."""
    items = draw(st.lists(st.tuples(_SPACE, st.one_of(_NUMBER, _NUMBER, _NOT_A_NUMBER),
                                    _SPACE), max_size=10))
    body = ",".join(before + item + after for before, item, after in items)
    if items and draw(st.integers(0, 4)) == 0:
        body += draw(st.sampled_from([",", " , ", "]", "x", " 7"]))
    opening = draw(st.sampled_from(["[", "[", "[", "[", "", "{", "[[", '"']))
    closing = draw(st.sampled_from(["]", "]", "]", "]", "", "]]", "}", '"']))
    return (draw(_SPACE) + opening + draw(_SPACE) + body + draw(_SPACE) + closing
            + draw(_SPACE)).encode()


_SOUP = st.text(alphabet='[]{}-+.,eE0123456789 \t\n\r"tnulfas:', max_size=32).map(str.encode)
_VALID = st.tuples(st.lists(st.integers(-2**66, 2**66), max_size=50),
                   _SPACE).map(lambda t: ("[" + ("," + t[1]).join(map(str, t[0])) + "]").encode())


def _reference(text: bytes):
    try:
        return _REFERENCE.decode(text), None
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return None, exc


def _kernel(text: bytes) -> tuple[np.ndarray, int]:
    ids, _, status = parse_lists(np.frombuffer(text, dtype=np.uint8),
                                  np.array([len(text)], dtype=np.int64))
    return ids, int(status[0])


def _check_kernel(text: bytes) -> None:
    ids, status = _kernel(text)
    values, _ = _reference(text)
    if status == LIST_OK:
        assert values is not None and ids.tolist() == values, (text, ids, values)
    elif status == LIST_OUT_OF_RANGE:
        assert values is not None and not all(0 <= v < 2**32 for v in values), text
    else:  # never accepts what msgspec refuses; what it gives up on, msgspec decides
        assert status == LIST_NOT_PLAIN
        if values is not None:
            pytest.fail(f"kernel gave up on a plain list of integers: {text!r}")


@settings(max_examples=300, deadline=None)
@given(_list_texts())
def test_the_kernel_agrees_with_msgspec_on_generated_lists(text):
    _check_kernel(text)


@settings(max_examples=300, deadline=None)
@given(_SOUP)
def test_the_kernel_agrees_with_msgspec_on_character_soup(text):
    _check_kernel(text)


@settings(max_examples=200, deadline=None)
@given(_VALID)
def test_every_list_of_integers_takes_the_kernel_path(text):
    ids, status = _kernel(text)
    values = json.loads(text)
    expected = LIST_OK if all(0 <= v < 2**32 for v in values) else LIST_OUT_OF_RANGE
    assert status == expected, text
    if status == LIST_OK:
        assert ids.dtype == np.uint32 and ids.tolist() == values


# Long lists of ids of every width (the kernel reads up to 7 digits and a comma as one
# word), sometimes with one item in the way: a leading zero, a sign, a fraction.
_WIDE_ID = st.one_of(st.integers(0, 10**12), st.integers(0, 10**7), st.integers(-9, 9)).map(str)
_ODD_ITEM = st.from_regex(r"-?0[0-9]{1,8}|-[0-9]{1,9}|[0-9]{1,8}\.[0-9]|[0-9]{1,8}e1",
                          fullmatch=True)


@st.composite
def _long_lists(draw) -> bytes:
    items = draw(st.lists(_WIDE_ID, max_size=40))
    if items and draw(st.booleans()):
        items[draw(st.integers(0, len(items) - 1))] = draw(_ODD_ITEM)
    separators = [draw(st.sampled_from([",", ",", ", ", " ,", ",\n "])) for _ in items]
    body = "".join(sep + item for sep, item in zip(separators, items))[len(separators[0]):] \
        if items else ""
    return ("[" + body + draw(st.sampled_from(["", " "])) + "]").encode()


@settings(max_examples=400, deadline=None)
@given(_long_lists())
def test_the_kernel_agrees_with_msgspec_on_long_lists_of_every_width(text):
    _check_kernel(text)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(_list_texts(), _VALID), min_size=1, max_size=6))
def test_lists_parsed_together_are_each_what_they_are_alone(texts):
    # One kernel call per batch: a list must not run into the next one.
    raws = [msgspec.Raw(text) for text in texts]
    try:
        together = token_lists_from_json(raws)
    except (BadTokenList, msgspec.DecodeError) as exc:
        index = exc.index if isinstance(exc, BadTokenList) else None
        for k, text in enumerate(texts):
            values, error = _reference(text)
            if error is not None:  # the first bad one is the one named
                assert index in (k, None), (k, index, texts)
                return
        pytest.fail(f"refused {texts!r}, which msgspec accepts")
    for text, got in zip(texts, together):
        values, error = _reference(text)
        assert error is None, text
        _assert_token_ids(got, values)


def _assert_token_ids(got, values: list[int]) -> None:
    if all(0 <= v < 2**32 for v in values):
        assert isinstance(got, np.ndarray) and got.dtype == np.uint32
        assert got.tolist() == values
    else:  # kept as given: recorded as unknown content, never indexed
        assert got == values and type(got) is list


@settings(max_examples=200, deadline=None)
@given(_list_texts())
def test_refusals_are_msgspecs_own_messages_under_token_ids(text):
    values, error = _reference(text)
    if isinstance(error, msgspec.DecodeError):
        return  # malformed JSON never reaches this parser: the body's decoder refuses it
    if error is None:
        _assert_token_ids(token_lists_from_json([msgspec.Raw(text)])[0], values)
        return
    with pytest.raises(BadTokenList) as refused:
        token_lists_from_json([msgspec.Raw(text)])
    message = str(error)
    where = message.replace(" - at `$", " - at `$.token_ids", 1) if " - at `$" in message \
        else f"{message} - at `$.token_ids`"
    assert str(refused.value) == where


@pytest.mark.parametrize("text, expected", [
    (b"[]", []), (b" [ ] ", []), (b"[-0]", [0]), (b"[0,4294967295]", [0, 2**32 - 1]),
    (b"[\t1\r\n,\n2 ]", [1, 2]), (b"[4294967296]", [2**32]), (b"[-1]", [-1]),
    (b"[1, 100000000000000000000000000000]", [1, 10**29]),
])
def test_edges(text, expected):
    _assert_token_ids(token_lists_from_json([msgspec.Raw(text)])[0], expected)


# --- where they enter: an /events body ------------------------------------------------------

def _entry(tokens: str) -> str:
    return ('{"key": {"chunk_hash_hex": "aa01", "model_name": "m", "kv_rank": 0}, '
            f'"size_bytes": 8, "token_ids": {tokens}, "token_offset": 0}}')


def _body(*batches: list[str]) -> bytes:
    return ('{"batches": [' + ", ".join(
        '{"instance_id": "i", "seq": %d, "event_type": "store", "tier": "l1", '
        '"backend": "dram", "entries": [%s]}' % (seq + 1, ", ".join(entries))
        for seq, entries in enumerate(batches)) + "]}").encode()


@pytest.mark.parametrize("bad, kind, message", [
    ("[1, 2, 2.5, 4]", "int_type", "Expected `int`, got `float` - at "
                                   "`$.batches[1].entries[2].token_ids[2]`"),
    ("[1, 2, true, 4]", "int_type", "Expected `int`, got `bool` - at "
                                    "`$.batches[1].entries[2].token_ids[2]`"),
    ("[1, 2, 1e3, 4]", "int_type", "Expected `int`, got `float` - at "
                                   "`$.batches[1].entries[2].token_ids[2]`"),
    ("[1, 2, [3], 4]", "int_type", "Expected `int`, got `array` - at "
                                   "`$.batches[1].entries[2].token_ids[2]`"),
    ('"1,2,3,4"', "list_type", "Expected `array`, got `str` - at "
                               "`$.batches[1].entries[2].token_ids`"),
    ("null", "list_type", "Expected `array`, got `null` - at "
                          "`$.batches[1].entries[2].token_ids`"),
])
def test_a_bad_token_list_is_named_in_the_body(bad, kind, message):
    good = _entry("[1, 2, 3, 4]")
    body = _body([good], [good, good, _entry(bad), good])
    with pytest.raises(WireError) as refused:
        decode(body, EventsRequest)
    assert str(refused.value) == message
    [detail] = refused.value.detail
    assert detail["type"] == kind
    assert detail["loc"] == ["body", "batches", 1, "entries", 2, "token_ids"] + (
        [2] if kind == "int_type" else [])
    assert detail["input"] == (json.loads(bad)[2] if kind == "int_type" else json.loads(bad))


def test_decoded_entries_hold_uint32_arrays_or_the_ints_outside_uint32():
    body = _body([_entry("[1, 2, 3, 4]"), _entry("[]"), _entry("[1, -1]"),
                  _entry("[7, 4294967296]")])
    entries = decode(body, EventsRequest).batches[0].entries
    _assert_token_ids(entries[0].token_ids, [1, 2, 3, 4])
    _assert_token_ids(entries[1].token_ids, [])
    _assert_token_ids(entries[2].token_ids, [1, -1])
    _assert_token_ids(entries[3].token_ids, [7, 2**32])
    # And they encode back to the same lists.
    again = json.loads(encode(decode(body, EventsRequest)))
    assert [e["token_ids"] for e in again["batches"][0]["entries"]] == \
        [[1, 2, 3, 4], [], [1, -1], [7, 2**32]]


def test_an_entry_built_in_code_takes_its_tokens_as_the_wire_would():
    key = EncodedObjectKey(chunk_hash_hex="aa01", model_name="m", kv_rank=0)
    for given_ids, expected in [([1, 2], [1, 2]), ((3, 4), [3, 4]),
                                (np.array([5, 6], dtype=np.int64), [5, 6]),
                                ([1, 2**32], [1, 2**32]), ([10**30], [10**30]), ([], [])]:
        _assert_token_ids(CacheEventEntry(key=key, token_ids=given_ids).token_ids, expected)
    assert len(CacheEventEntry(key=key).token_ids) == 0
    for bad in ([1.5], [True], [[1]], np.array([1.0]), np.zeros((2, 2), dtype=np.uint32)):
        with pytest.raises(ValueError, match="token_ids"):
            CacheEventEntry(key=key, token_ids=bad)
    ids = np.arange(4, dtype=np.uint32)
    assert token_ids_of(ids) is ids  # already what it should be: no copy


def test_a_batch_parses_all_its_lists_in_one_kernel_call_without_the_gil(monkeypatch):
    import blend_wire.events
    calls = []
    real = blend_wire.events.token_lists_from_json
    monkeypatch.setattr(blend_wire.events, "token_lists_from_json",
                        lambda lists: calls.append(len(lists)) or real(lists))
    decode(_body([_entry(f"[{i}, 1, 2, 3]") for i in range(50)]), EventsRequest)
    assert calls == [50]
    assert parse_lists.targetoptions.get("nogil") is True


# --- token_lists_to_json: the way back, byte for byte -------------------------------------

_ID_LISTS = st.lists(
    st.lists(st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 130_000),
                       st.sampled_from([0, 9, 10, 99, 100, 99999, 100000, 10**9 - 1, 10**9,
                                        2**32 - 1])), max_size=40),
    max_size=12)


@settings(max_examples=300, deadline=None)
@given(_ID_LISTS)
def test_token_lists_to_json_writes_what_msgspec_writes_for_the_ints(lists):
    arrays = [np.array(ids, dtype=np.uint32) for ids in lists]
    raws = token_lists_to_json(arrays)
    assert msgspec.json.encode(raws) == msgspec.json.encode(lists)
    # And an entry holding it encodes as one holding the array does.
    key = EncodedObjectKey(chunk_hash_hex="ab", model_name="m", kv_rank=0, cache_salt="")
    for array, raw in zip(arrays, raws):
        with_array = CacheEventEntry(key=key, token_ids=array, token_offset=0)
        with_raw = CacheEventEntry(key=key, token_ids=array, token_offset=0)
        with_raw.token_ids = raw
        assert encode(with_raw) == encode(with_array)


# --- as_tokens: lists of ints take a faster conversion, with the same results and errors ----


def _as_tokens_by_numpy(values) -> np.ndarray:
    """as_tokens as it was before its fast path for lists: everything through np.asarray."""
    array = np.asarray(values)
    if array.dtype == np.uint32:
        return np.ascontiguousarray(array)
    if array.size == 0:
        return np.zeros(array.shape, dtype=np.uint32)
    if array.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, not {array.dtype}")
    if array.min() < 0 or array.max() > 2**32 - 1:
        raise ValueError("token ids must fit in uint32 (0 .. 2**32-1)")
    return array.astype(np.uint32)


_ELEMENT = st.one_of(
    st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
    st.integers(-2**70, 2**70), st.booleans(), st.floats(allow_nan=False), st.none(),
    st.text(max_size=2), st.integers(0, 2**40).map(np.int64), st.integers(0, 9).map(np.uint8),
    st.lists(st.integers(0, 9), max_size=2))


def _outcome(convert, values):
    try:
        result = convert(values)
    except (ValueError, TypeError, OverflowError) as exc:
        return type(exc), str(exc)
    assert result.flags.c_contiguous
    return result.dtype, result.shape, result.tolist()


@settings(max_examples=400, deadline=None)
@given(values=st.one_of(st.lists(st.integers(0, 2**32 - 1)),
                        st.lists(_ELEMENT, max_size=6),
                        st.tuples(st.integers(0, 2**32 - 1), st.lists(_ELEMENT, max_size=4))
                        .map(lambda parts: [parts[0], *parts[1]])))
def test_as_tokens_gives_a_list_the_result_or_error_numpy_gave(values):
    from blend_wire.tokens import as_tokens
    assert _outcome(as_tokens, values) == _outcome(_as_tokens_by_numpy, values)
