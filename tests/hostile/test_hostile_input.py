"""Strict input (issue 11, points 1 and 5): everything the directory cannot hold is refused
at the door, 422 naming the field, and nothing of the body is applied; bodies that cannot
even be read are 4xx, never 500.

Each case here was accepted (or answered 500) before: whitespace in `chunk_hash_hex` made
"ab cd" and "abcd" one chunk and "  " an empty hash; NUL in `cache_salt` and 40-digit
`seq`s were stored; `token_offset` >= 2^63 passed validation, failed half-way through
the batch (500) and left the gate advanced with a good chunk lost for good.
"""

from __future__ import annotations

import gzip

import pytest

from blend_wire import BLEND_LOOKUP_PATH, EVENTS_PATH, encode, encode_tokens
from hostile_helpers import A, B, batch, entry

LANE = "unit"

BAD_EVENTS = {
    "hex with a space": (entry("ab cd"), "chunk_hash_hex"),
    "hex of spaces only": (entry("  "), "chunk_hash_hex"),
    "hex with a trailing newline": (entry("abcd\n"), "chunk_hash_hex"),
    "hex with a leading 0x": (entry("0xabcd"), "chunk_hash_hex"),
    "empty hex": (entry(""), "chunk_hash_hex"),
    "salt with NUL": (entry(salt="t\x00"), "cache_salt"),
    "salt with @": (entry(salt="a@b"), "cache_salt"),
    "salt with /": (entry(salt="a/b"), "cache_salt"),
    "salt with backslash": (entry(salt="a\\b"), "cache_salt"),
    "salt of 129 characters": (entry(salt="s" * 129), "cache_salt"),
    "model name with @": (entry(model="m@x"), "model_name"),
    "kv_rank of 2^64": (entry(kv_rank=2**64), "kv_rank"),
    "kv_rank of 2^32": (entry(kv_rank=2**32), "kv_rank"),
    "negative kv_rank": (entry(kv_rank=-1), "kv_rank"),
    "negative object group": (entry(group=-1), "object_group_id"),
    "token_offset of 2^63": (entry(offset=2**63), "token_offset"),
    "token_offset of 2^53": (entry(offset=2**53), "token_offset"),
    "size_bytes of 2^63": (entry(size_bytes=2**63), "size_bytes"),
}

BAD_BATCHES = {
    "seq of 10^40": (batch(entry(), seq=10**40), "seq"),
    "seq of 2^63": (batch(entry(), seq=2**63), "seq"),
    "incarnation of 2^63": (batch(entry(), incarnation=2**63), "incarnation"),
    "instance id of 2 KB": (batch(entry(), instance="i" * 2048), "instance_id"),
}


async def _refused_and_nothing_changed(coord, body: bytes, field: str) -> None:
    await coord.post_events(batch(entry("ee04", B, offset=0), instance="seed"))
    before = await coord.stats()
    response = await coord.client.post(EVENTS_PATH, data=body)
    text = await response.text()
    assert response.status == 422, text
    assert field in text
    assert await coord.stats() == before
    # Nothing moved the gate: seq 1 of i0 is still fresh, and the good chunk is findable.
    assert (await coord.post_events(batch(entry("aa01", A, offset=0))))["applied"] == 1
    assert await coord.lookup(A) == [("aa01", 0, 0)]


@pytest.mark.parametrize("bad,field", BAD_EVENTS.values(), ids=BAD_EVENTS.keys())
async def test_an_entry_out_of_range_is_422_naming_it_and_applies_nothing(coord, bad, field):
    # The bad entry travels behind a good one in the same batch: neither is applied.
    body = encode({"batches": [batch(entry("aa01", A, offset=0), bad)]})
    await _refused_and_nothing_changed(coord, body, field)


@pytest.mark.parametrize("bad,field", BAD_BATCHES.values(), ids=BAD_BATCHES.keys())
async def test_a_batch_field_out_of_range_is_422_naming_it(coord, bad, field):
    await _refused_and_nothing_changed(coord, encode({"batches": [bad]}), field)


async def test_largest_accepted_values_are_stored_and_found(coord):
    # The bounds are inclusive and what an emitter really sends fits well inside them.
    big = batch(entry("aa01", A, offset=2**53 - 1, size_bytes=2**63 - 1, kv_rank=2**32 - 1,
                      group=2**32 - 1, salt="s" * 128),
                seq=2**63 - 1, incarnation=2**63 - 1)
    assert (await coord.post_events(big))["applied"] == 1
    assert (await coord.stats())["num_keys"] == 1


async def test_hex_differing_only_in_case_is_one_chunk(coord):
    await coord.post_events(batch(entry("ABCD", A, offset=0), entry("abcd", A, offset=0)))
    assert (await coord.stats())["num_bindings"] == 1


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("path,body", [
    (EVENTS_PATH, b'{"x": ' + _deep(100_000) + b', "batches": []}'),
    (EVENTS_PATH, b'{"batches": [' + _deep(100_000) + b']}'),
    (BLEND_LOOKUP_PATH, b'{"x": ' + _deep(100_000) + b'}'),
    (BLEND_LOOKUP_PATH, b'{"x": ' + b'{"a": ' * 100_000 + b'1' + b'}' * 100_000 + b'}'),
], ids=["events unknown field", "events batch", "lookup unknown field", "lookup objects"])
async def test_json_nested_100k_deep_is_422_not_500(coord, path, body):
    response = await coord.client.post(path, data=body)
    assert response.status == 422, await response.text()
    assert (await coord.stats())["num_keys"] == 0


@pytest.mark.parametrize("encoding,body", [
    ("gzip", b"\x1f\x8b\x08\x00" + b"not really gzip" * 10),
    ("gzip", gzip.compress(encode({"batches": [batch(entry())]}))[:-12]),  # truncated
    ("deflate", b"\x00\x01\x02garbage"),
    ("br", b"abc"),
    ("x-unknown", b"abc"),
], ids=["corrupt gzip", "truncated gzip", "corrupt deflate", "brotli", "unknown"])
async def test_body_that_cannot_be_decoded_is_4xx_not_500(coord, encoding, body):
    response = await coord.client.post(EVENTS_PATH, data=body, headers={
        "Content-Encoding": encoding, "Connection": "close"})
    assert 400 <= response.status < 500, await response.text()
    assert (await coord.stats())["num_keys"] == 0


async def test_a_well_formed_gzip_body_is_accepted(coord):
    body = gzip.compress(encode({"batches": [batch(entry("aa01", A, offset=0))]}))
    response = await coord.client.post(EVENTS_PATH, data=body,
                                       headers={"Content-Encoding": "gzip"})
    assert response.status == 200, await response.text()
    assert await coord.lookup(A) == [("aa01", 0, 0)]


async def test_a_gzip_bomb_stops_at_the_body_limit(start):
    coord = await start(max_body_bytes=1 << 20)
    body = gzip.compress(b" " * (64 << 20), 9)
    assert len(body) < 1 << 20
    response = await coord.client.post(EVENTS_PATH, data=body, headers={
        "Content-Encoding": "gzip", "Connection": "close"})
    assert response.status == 413, await response.text()


@pytest.mark.parametrize("salt", ["t\x00", "a@b", "a/b", "s" * 129])
async def test_lookup_with_a_salt_nothing_can_be_stored_under_is_422(coord, salt):
    body = {"tokens_b64": encode_tokens(A), "model_name": "m", "cache_salt": salt}
    response = await coord.client.post(BLEND_LOOKUP_PATH, data=encode(body))
    assert response.status == 422
    assert "cache_salt" in await response.text()
