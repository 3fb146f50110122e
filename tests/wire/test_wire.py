"""The token codec and wire shapes of blend_wire, against WIRE.md and the stdlib."""

from __future__ import annotations

import base64
import binascii
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from blend_wire import (BlendLookupRequest, CacheEventBatch, EventsRequest, WireError, decode,
                         decode_tokens, encode_tokens, pack_kv_rank, world_size_of)

LANE = "unit"


def test_wire_md_example():
    assert encode_tokens([1, 2]) == "AQAAAAIAAAA="
    assert decode_tokens("AQAAAAIAAAA=").tolist() == [1, 2]
    assert decode_tokens("AQAAAAIAAAA=").dtype == np.uint32


@given(st.lists(st.integers(0, 2**32 - 1), max_size=300))
def test_round_trip(tokens):
    assert decode_tokens(encode_tokens(tokens)).tolist() == tokens


def _stdlib_accepts(text: str) -> bool:
    try:
        return len(binascii.a2b_base64(text, strict_mode=True)) % 4 == 0
    except binascii.Error:
        return False


@given(st.text(alphabet="AQIg+/=x!\n ", max_size=24))
def test_accepts_exactly_what_strict_stdlib_base64_accepts(text):
    try:
        decoded = decode_tokens(text)
    except WireError:
        assert not _stdlib_accepts(text), text
    else:
        assert _stdlib_accepts(text), text
        assert decoded.tobytes() == binascii.a2b_base64(text, strict_mode=True)


@pytest.mark.parametrize("text, reason", [
    ("AQAAAAIAAAA", "multiple of 4"),       # padding missing
    ("A!AAAAAA", "'!' at position 1"),
    ("AQ==AAAA", "'=' at position 2"),      # data after padding
    ("AAAAAAA=", "5 bytes"),                # valid base64, not whole uint32s
    ("AQAAAA é", "non-ASCII"),
])
def test_invalid_tokens_say_why(text, reason):
    with pytest.raises(WireError, match=reason):
        decode_tokens(text)


def test_encode_rejects_tokens_outside_uint32():
    with pytest.raises(WireError):
        encode_tokens([2**32])
    with pytest.raises(WireError):
        encode_tokens([-1])


def test_kv_rank_packs_world_size_in_the_top_byte():
    rank = pack_kv_rank(world_size=4, global_rank=3, local_world_size=2, local_rank=1)
    assert rank == (4 << 24) | (3 << 16) | (2 << 8) | 1
    assert world_size_of(rank) == 4


def test_lookup_request_defaults_and_model_name_rule():
    assert decode(b"{}", BlendLookupRequest) == BlendLookupRequest()
    with pytest.raises(WireError, match="model_name"):
        decode(b'{"tokens_b64": "AQAAAA=="}', BlendLookupRequest)


def _events_body(batch: dict) -> bytes:
    return json.dumps({"batches": [batch]}).encode()


@pytest.mark.parametrize("field, value, where", [
    ("seq", 0, "seq"),
    ("tier", "all", "tier"),
    ("instance_id", "", "instance_id"),
    ("incarnation", -1, "incarnation"),
    ("seq", True, "seq"),
])
def test_event_batch_validation_names_the_field(field, value, where):
    batch = {"instance_id": "i", "seq": 1, "event_type": "store", "tier": "l1",
             "backend": "dram", "entries": []}
    batch[field] = value
    with pytest.raises(WireError, match=where):
        decode(_events_body(batch), EventsRequest)


def test_store_batch_needs_a_backend():
    batch = {"instance_id": "i", "seq": 1, "event_type": "store", "tier": "l1", "entries": []}
    with pytest.raises(WireError, match="backend"):
        decode(_events_body(batch), EventsRequest)


def test_base64_of_stdlib_decodes():
    tokens = np.arange(1000, dtype="<u4")
    assert decode_tokens(base64.b64encode(tokens.tobytes()).decode()).tolist() == tokens.tolist()


def test_an_access_batch_needs_no_backend_and_takes_the_defaults():
    batch = decode(b'{"instance_id":"i","seq":1,"event_type":"access","tier":"l2"}',
                   CacheEventBatch)
    assert (batch.event_type, batch.tier, batch.backend, batch.entries) == ("access", "l2", "", [])
    assert (batch.incarnation, batch.shared, batch.ts, batch.capacity_bytes) == (0, False, 0.0, 0)


def test_one_hex_rule_and_one_lookup_namespace_rule():
    from blend_wire import (BlendNamespace, check_chunk_hash_hex, check_lookup_namespace,
                            chunk_hash_of_hex)

    assert chunk_hash_of_hex("abCD") == b"\xab\xcd"
    for text in ("", "a", "abc", "ab cd", " abcd", "zz", "ab\u00e9c", "a" * 1026):
        assert chunk_hash_of_hex(text) is None, text
        with pytest.raises(ValueError, match="not valid hex"):
            check_chunk_hash_hex(text)
    check_lookup_namespace(BlendNamespace("m", "", 1))
    for namespace, why in ((BlendNamespace("", "", 1), "model_name"),
                           (BlendNamespace("m", "", 0), "world_size"),
                           (BlendNamespace("m", "a/b", 1), "cache_salt")):
        with pytest.raises(ValueError, match=why):
            check_lookup_namespace(namespace)
