"""`/events` body validation (coordinator_stub/writes/validation.py), one rule for both
write paths: batches found and token lists cut out by byte scans, yet every body gets the
answer msgspec alone would give it, checked whole first.
"""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blend_wire import CacheEventBatch, WireError, decode, encode
from coordinator_stub.writes import validation
from coordinator_stub.writes.validation import _Outline, validated_batches

LANE = "unit"


def _refusal_or_batches(validate, body: bytes):
    try:
        raws, batches = validate(body)
    except WireError as exc:
        return str(exc), exc.detail
    return [bytes(raw) for raw in raws], [encode(b) for b in batches]


def _whole_body_first(body: bytes):
    """The reference: msgspec alone, the body's outline first, then each batch."""
    raws = decode(body, _Outline).batches
    with mock.patch.object(validation, "decode_batch", lambda raw: decode(raw, CacheEventBatch)):
        return raws, [validation.decode_raw_batch(raw, i) for i, raw in enumerate(raws)]


_GOOD_BODY = b"".join([
    b'{"batches": [{"instance_id": "i", "seq": 1, "event_type": "store", "tier": "l1", ',
    b'"backend": "dram", "entries": [{"token_ids": [1,22,333], "key": {"chunk_hash_hex": ',
    b'"aa01", "model_name": "m", "kv_rank": 0}, "token_offset": 0}, {"key": {',
    b'"chunk_hash_hex": "bb02", "model_name": "m", "kv_rank": 0}, "token_ids": [], ',
    b'"size_bytes": 4}, {"key": {"chunk_hash_hex": "cc03", "model_name": "m", "kv_rank": ',
    b'0}, "token_ids":[4000000000 , 5]}]}, {"entries": [], "seq": 2, "instance_id": "i", ',
    b'"event_type": "access", "tier": "l2"}]}'])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_GOOD_BODY)), st.integers(0, 3),
                          st.sampled_from(list(b'{}[]",:\\ -.0123456789abdentrsux\x00\xe9'))),
                min_size=1, max_size=3))
def test_a_body_is_refused_as_if_its_json_were_checked_whole_first(edits):
    # The batches are found, and their token lists cut out, by byte scans that check no
    # JSON: whatever a body's faults, it gets the answer msgspec alone gave it.
    body = bytearray(_GOOD_BODY)
    for at, how, byte in edits:
        at = min(at, len(body) - 1)
        if how == 0:
            del body[at]
        elif how == 1:
            body.insert(at, byte)
        else:
            body[at] = byte
    body = bytes(body)
    assert _refusal_or_batches(validated_batches, body) == \
        _refusal_or_batches(_whole_body_first, body), body


@pytest.mark.parametrize("old, new", [
    (b"[1,22,333], ", b"[1,22,333] "),                   # a comma missing after a list
    (b'0}, "token_ids": [], ', b'0} "token_ids": [], '),    # ... before one
    (b'"token_ids": [], ', b'"token_ids": [], "token_ids": [7], '),  # a key twice
    (b'"token_ids": [], ', b'"token_ids": [] '),
    (b'"kv_rank": 0}, "token_offset"', b'"kv_rank": 0, "token_ids": [9]}, "token_offset"'),
    (b'"backend": "dram", ', b'"backend": "dram", "token_ids": [1], '),
    (b'"backend": "dram", ', b'"backend": "dram", "entries": [], '),  # entries twice
    (b'"backend": "dram", ', b'"backend": "dram", "x": [{"token_ids": [1]}], '),
    (b'{"token_ids": [1,22,333]', b'{"token_\\u0069ds": [1,22,333]'),   # an escaped key
    (b'"token_ids": [], ', b'"token_ids": {"a": []}, '),
    (b'"token_ids": [], ', b'"token_ids": [1.5], '),
    (b'"token_ids": [], ', b'"token_ids": [-1], '),
    (b'"token_ids": [], ', b'"token_ids": [1,], '),
    (b'"token_ids": [], ', b'"token_ids": "[]", '),
    (b'"token_ids": [], ', b'"token_ids"  :  [ 1 , 2 ] , '),
    (b'"event_type": "access"', b'"token_ids": [1], "event_type": "access"'),
    (b'0}, "token_ids":[4000000000 , 5]}', b'0, "token_ids": [8]}}'),  # in a key
    (b'"backend": "dram", ', b'"backend": "dram", "entries": [{"token_ids": [5], "key": '
                            b'{"chunk_hash_hex": "dd", "model_name": "m", "kv_rank": 0}}], '),
    (b'"entries": [{', b'"entries": [[], {'),
    (b'"entries": [{', b'"entries": {"a": [{'),
])
def test_token_lists_cut_out_of_a_batch_are_what_msgspec_reads(old, new):
    assert old in _GOOD_BODY
    body = _GOOD_BODY.replace(old, new, 1)
    assert _refusal_or_batches(validated_batches, body) == \
        _refusal_or_batches(_whole_body_first, body), body
