"""The candidates' columns form (docs/WIRE.md, "The columns form"): its integer codec, the
plugin reading it exactly as strictly as the objects form, malformed replies failing
without raising into the serving path, and the client against coordinators that answer
either form or LMCache's default."""

from __future__ import annotations

import json
import logging

import msgspec
import numpy as np
import pytest

from blend_wire import (MAX_TOKEN_OFFSET, WireError, decode_uints, encode, encode_b64,
                        encode_uints, uints_in)
from helpers import LoopbackServer, Reply, take_when_done
from plugin import BlendCoordinatorClient, BlendNamespace, FleetReply, MatchState
from plugin.http import Verdict
from plugin.replies import QueryFailed, found_in

LANE = "unit"

C = 16
NUM_TOKENS = 8 * C
ME = "me"
NS = BlendNamespace("model", "", 1)
TOKENS = np.arange(NUM_TOKENS, dtype=np.uint32)


# --- the codec --------------------------------------------------------------------------


@pytest.mark.parametrize("values, width", [
    ([], "1"), ([0, 255], "1"), ([256, 3], "2"), ([65536], "4"), ([2**32], "8"),
    ([2**64 - 1, 0], "8")])
def test_an_integer_column_round_trips_in_the_narrowest_width(values, width):
    text = encode_uints(np.array(values, dtype=np.uint64))
    assert text[0] == width
    assert decode_uints(text, "x").tolist() == values
    assert uints_in(text) == len(values)


@pytest.mark.parametrize("text, says", [
    ("", "must start with its width"), ("3AAAA", "must start with its width"),
    ("2AAA", "multiple of 4"), ("2AA==", "not a multiple of its width"),
    ("1A*==", "character '*'"), ("1\u00e9AAA", "non-ASCII")])
def test_a_bad_integer_column_is_refused_saying_why(text, says):
    with pytest.raises(WireError, match=says):
        decode_uints(text, "positions")


def test_a_negative_value_is_not_encoded():
    with pytest.raises(WireError):
        encode_uints(np.array([3, -1]))


# --- the plugin reads both forms alike ------------------------------------------------------


def columns_of_objects(candidates: list[dict], hash_bytes: int) -> dict:
    """An objects-form `candidates` list as the columns form says it (WIRE.md's layout,
    written here independently of the coordinator's encoder)."""
    instances: list[str] = []
    chunks = [chunk for content in candidates for chunk in content["chunks"]]
    holders = [instances.index(name) if name in instances else instances.append(name)
               or len(instances) - 1 for chunk in chunks for name in chunk.get("l1", ())]
    ints = lambda values: encode_uints(np.array(values, dtype=np.uint64))  # noqa: E731
    return {"position_counts": ints([len(c["positions"]) for c in candidates]),
            "positions": ints([p for c in candidates for p in c["positions"]]),
            "chunk_counts": ints([len(c["chunks"]) for c in candidates]),
            "hash_bytes": hash_bytes,
            "chunk_hashes": encode_b64(b"".join(bytes.fromhex(c["chunk_hash"])
                                                for c in chunks)),
            "old_st": ints([c["old_st"] for c in chunks]),
            "holder_counts": ints([len(c.get("l1", ())) for c in chunks]),
            "holders": ints(holders), "instances": instances,
            "shared": encode_b64(np.packbits(np.array([c.get("shared", False) for c in chunks],
                                                      dtype=bool), bitorder="little"))}


def both_forms(candidates: list[dict], hash_bytes: int = 2):
    """What the plugin takes from the same reply in either form."""
    objects = encode({"chunk_size": C, "candidates": candidates})
    columns = encode({"chunk_size": C, "columns": columns_of_objects(candidates, hash_bytes)})
    return [found_in(body, "http://c", chunk_size=C, instance_id=ME, num_tokens=NUM_TOKENS)
            for body in (objects, columns)]


def chunk(n: int, old_st: int = 0, l1=(), shared=False) -> dict:
    return {"chunk_hash": f"{n:04x}", "old_st": old_st, "l1": list(l1), "shared": shared}


def assert_same(objects, columns):
    assert columns.contents == objects.contents
    assert (columns.dropped, columns.first_reason) == (objects.dropped, objects.first_reason)
    assert not columns.default_form and not columns.objects_form and objects.objects_form


def test_every_drop_rule_of_the_objects_form_holds_in_columns():
    last = NUM_TOKENS - C
    candidates = [
        {"positions": [0, 40], "chunks": [chunk(1, l1=[ME, "peer"]), chunk(2, shared=True)]},
        {"positions": [5, 5], "chunks": [chunk(3)]},                    # not ascending
        {"positions": [last + 1], "chunks": [chunk(4)]},                # outside the query
        {"positions": [], "chunks": [chunk(5)]},                        # no position
        {"positions": [20], "chunks": [chunk(1), chunk(6, MAX_TOKEN_OFFSET + 1),
                                       chunk(7, MAX_TOKEN_OFFSET, l1=["peer"])]},
        {"positions": [30], "chunks": [chunk(2)]},       # every chunk named before: omitted
        {"positions": [last], "chunks": [chunk(3), chunk(8, 3, shared=True, l1=[ME])]},  # 3: ok
        {"positions": [60], "chunks": []},                              # no chunk: omitted
    ]
    objects, columns = both_forms(candidates)
    assert objects.dropped == 6 and objects.first_reason.startswith("positions (5, 5)")
    assert_same(objects, columns)


def test_only_the_first_64_chunks_of_a_content_are_read_in_both_forms():
    candidates = [{"positions": [0], "chunks": [chunk(n) for n in range(70)]},
                  {"positions": [C], "chunks": [chunk(65), chunk(3)]}]
    objects, columns = both_forms(candidates)
    assert len(objects.contents.old_st) == 65  # chunk 65 read in the second content only
    assert_same(objects, columns)


def test_the_first_reason_is_the_first_dropped_in_reply_order():
    candidates = [{"positions": [0], "chunks": [chunk(1), chunk(1)]},
                  {"positions": [9, 3], "chunks": [chunk(2)]}]
    objects, columns = both_forms(candidates)
    assert objects.first_reason == "chunk reported twice"
    assert_same(objects, columns)


@pytest.mark.parametrize("seed", range(40))
def test_random_replies_read_alike_in_both_forms(seed):
    rng = np.random.default_rng(seed)
    candidates = []
    for _ in range(int(rng.integers(0, 12))):
        count = int(rng.integers(0, 4))
        positions = sorted(rng.choice(NUM_TOKENS, count, replace=False).tolist())
        if rng.random() < 0.2 and positions:
            positions.reverse()
        chunks = [chunk(int(rng.integers(0, 30)),
                        int(rng.choice([0, 7, MAX_TOKEN_OFFSET, MAX_TOKEN_OFFSET + 1, 2**63])),
                        l1=sorted({str(name) for name in
                                    rng.choice([ME, "a", "b"], int(rng.integers(0, 3)))}),
                        shared=bool(rng.random() < 0.3))
                  for _ in range(int(rng.integers(0, 6)))]
        candidates.append({"positions": positions, "chunks": chunks})
    assert_same(*both_forms(candidates, hash_bytes=2))


def test_a_reply_without_my_instance_places_chunks_shared_or_at_a_peer():
    objects, columns = both_forms([{"positions": [0], "chunks": [
        chunk(1, l1=["x"]), chunk(2, shared=True), chunk(3, l1=["x"], shared=True)]}])
    assert columns.contents.chunk_place.tolist() == [2, 1, 1]
    assert_same(objects, columns)


# --- a malformed columns reply fails, nothing else -------------------------------------------

GOOD = columns_of_objects([{"positions": [0, 20], "chunks": [chunk(1, l1=[ME]), chunk(2)]}], 2)


@pytest.mark.parametrize("change", [
    {"positions": encode_uints(np.array([0]))},              # counts say 2 positions
    {"position_counts": encode_uints(np.array([2, 0]))},     # a content without chunk counts
    {"chunk_hashes": encode_b64(b"\x00\x01\x00")},            # not a multiple of hash_bytes
    {"old_st": encode_uints(np.array([0]))},                  # one offset for two chunks
    {"holder_counts": encode_uints(np.array([1, 1]))},       # one holder for two counted
    {"holders": encode_uints(np.array([5]))},                # no instance 5
    {"shared": ""},                                          # no bitmap for two chunks
    {"chunk_counts": encode_uints(np.array([2**64 - 1], dtype=np.uint64))},  # would wrap
    {"position_counts": "9AAAA"},                            # not an integer column
    {"positions": "1A==="},                                  # not base64
    {"hash_bytes": 0}, {"hash_bytes": 513}, {"instances": "me"},
])
def test_a_malformed_columns_reply_fails_the_lookup(change):
    body = encode({"chunk_size": C, "columns": {**GOOD, **change}})
    with pytest.raises(QueryFailed) as failed:
        found_in(body, "http://c", chunk_size=C, instance_id=ME, num_tokens=NUM_TOKENS)
    assert failed.value.verdict is Verdict.ANSWERED  # the reply, not the replica: no fail-over


def test_a_columns_reply_of_another_chunk_size_fails():
    body = encode({"chunk_size": 2 * C, "columns": GOOD})
    with pytest.raises(QueryFailed, match="chunk size"):
        found_in(body, "http://c", chunk_size=C, instance_id=ME, num_tokens=NUM_TOKENS)


# --- the client and the three forms ---------------------------------------------------------


@pytest.fixture
def client_factory():
    made = []

    def factory(url):
        made.append(BlendCoordinatorClient(url, chunk_size=C, timeout=2.0,
                                            instance_id=ME))
        return made[-1]

    yield factory
    for client in made:
        client.close()


def asked(server: LoopbackServer) -> list[dict]:
    return [json.loads(body) for _, body in server.requests]


def test_the_client_asks_for_columns_and_reads_them(client_factory):
    reply = Reply(200, encode({"chunk_size": C, "columns": GOOD}))
    with LoopbackServer(lambda path, body: reply) as server:
        client = client_factory(server.url)
        client.submit("r1", TOKENS, NS)
        got = take_when_done(client, "r1")
        assert got.state is MatchState.DONE
        assert got.found.positions.tolist() == [0, 20]
        assert got.found.chunk_hashes == [b"\x00\x01", b"\x00\x02"]
        assert got.found.chunk_place.tolist() == [0, 2]
        assert asked(server)[0]["candidates"] is True and asked(server)[0]["columns"] is True


def test_against_an_objects_coordinator_the_client_reads_objects_and_keeps_asking(
        client_factory, caplog):
    caplog.set_level(logging.INFO, logger="plugin.client")
    reply = Reply(200, encode({"chunk_size": C, "candidates": [
        {"positions": [0], "chunks": [chunk(1)]}]}))
    with LoopbackServer(lambda path, body: reply) as server:
        client = client_factory(server.url)
        for i in range(3):
            client.submit(f"r{i}", TOKENS, NS)
            assert take_when_done(client, f"r{i}").found.chunk_hashes == [b"\x00\x01"]
        # One coordinator may answer objects for one reply (hashes of different lengths).
        assert all(body["columns"] for body in asked(server))
    said = [r for r in caplog.records if "as objects" in r.getMessage()]
    assert len(said) == 1


def test_against_lmcache_the_client_falls_back_to_its_default_form(client_factory):
    reply = Reply(200, {"matches": [{"chunk_hash": "aa", "old_st": 0, "cur_st": 16}]})
    with LoopbackServer(lambda path, body: reply) as server:
        client = client_factory(server.url)
        for i in range(2):
            client.submit(f"r{i}", TOKENS, NS)
            got = take_when_done(client, f"r{i}")
            assert got.found.positions.tolist() == [16]
        first, second = asked(server)
        assert first["candidates"] and first["columns"]
        assert "candidates" not in second and "columns" not in second  # LMCache's own body


def test_a_malformed_columns_reply_is_a_failed_lookup_not_an_exception(client_factory):
    bad = Reply(200, encode({"chunk_size": C, "columns": {**GOOD, "holders": "1/w=="}}))
    with LoopbackServer(lambda path, body: bad) as server:
        client = client_factory(server.url)
        assert client.submit("r1", TOKENS, NS)
        assert take_when_done(client, "r1") == FleetReply(MatchState.FAILED)
        assert client.stats().failed == 1 and client.breaker_state == "closed"


def test_the_request_field_is_decoded_and_defaults_off():
    from blend_wire import BlendLookupRequest, decode
    request = decode(b'{"tokens_b64": "AQAAAA==", "model_name": "m", "candidates": true, '
                     b'"columns": true}', BlendLookupRequest)
    assert request.columns and request.candidates
    assert b"columns" not in msgspec.json.encode(BlendLookupRequest(model_name="m"))


# --- the coordinator's columns, in process ----------------------------------------------------


def test_the_coordinator_answers_columns_that_say_what_its_objects_say_cut_or_not():
    from blend_wire import (BlendCandidatesReply, EventsRequest, MAX_CANDIDATE_POSITIONS,
                            decode, encode_tokens, pack_kv_rank)
    from coordinator_stub.config import CoordinatorConfig
    from coordinator_stub.service.coordinator import Coordinator

    coordinator = Coordinator(CoordinatorConfig(enable_blend_lookup=True, chunk_size=C))
    rng = np.random.default_rng(7)
    texts = [rng.integers(1000, 60000, C, dtype=np.uint32) for _ in range(3)]
    entries = [{"key": {"chunk_hash_hex": f"{n:064x}", "model_name": "m",
                        "kv_rank": pack_kv_rank(1)},
                "size_bytes": 1, "token_ids": text.tolist(), "token_offset": n * C}
               for n, text in enumerate(texts, 1)]
    batch = {"instance_id": ME, "incarnation": 0, "seq": 1, "event_type": "store",
             "tier": "l1", "backend": "dram", "entries": entries}
    coordinator.directory.ingest(decode(encode({"batches": [batch]}), EventsRequest).batches)
    for query in (np.concatenate([texts[1], texts[0], texts[2][:5], texts[1]]),
                  np.tile(texts[0], MAX_CANDIDATE_POSITIONS + 2)):  # cut: too many positions
        body = {"tokens_b64": encode_tokens(query), "model_name": "m", "candidates": True}
        read = [found_in(encode(coordinator.lookup(encode(request))), "in-process",
                         chunk_size=C, instance_id=ME, num_tokens=len(query))
                for request in (body, {**body, "columns": True})]
        assert read[0].objects_form and not read[1].objects_form
        assert read[1].contents == read[0].contents and read[1].dropped == 0
        replies = [decode(encode(coordinator.lookup(encode(request))), BlendCandidatesReply)
                   for request in (body, {**body, "columns": True})]
        assert replies[1].columns is not None
        assert replies[0].truncated == replies[1].truncated == (len(query) > 4 * C)
