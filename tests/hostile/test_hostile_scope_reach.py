"""What a scoped token could still do to others (issue 32, items 1, 2, 4 and 6).

Before:
1. `PUT /config/chunk-size` was refused to an emitter scoped `instances=inst-A
   salts=tenant-a`, but `POST /instances` with `"chunk_size": 8` from the same token
   bound 8: every tenant's chunks of the real size stopped being indexed.
2. Binding 1,000,000 answered 500 while allocating ~61 GiB, after the blend index was
   dropped and the size read 1,000,000, without the binding being recorded.
4. The match workers' turns were keyed on the raw `Authorization` header: `Bearer T`
   and `bearer  T` were two readers.
6. In a token file, `admin 0123456789abcdefSECRET#more` became the token
   `0123456789abcdefSECRET`.
"""

from __future__ import annotations

import numpy as np
import pytest

import local_matcher
from blend_wire import (BLEND_LOOKUP_PATH, CHUNK_SIZE_PATH, INSTANCES_PATH, MAX_CHUNK_SIZE,
                        STATS_PATH, encode, encode_tokens)
from coordinator_stub import CoordinatorConfig
from coordinator_stub.directory.bindings import Bindings
from coordinator_stub.http.app import _MATCH_POOL
from coordinator_stub.scopes import ANY, Scope, tokens_from
from hostile_helpers import A, batch, entry

LANE = "unit"

SCOPED, OPEN, ADMIN = "S" * 20, "O" * 20, "Z" * 20
TOKENS = (("emitter", SCOPED, Scope(("inst-A",), frozenset({"tenant-a"}))),
          ("emitter", OPEN, ANY), ("admin", ADMIN, ANY))


def _as(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


async def _register(coord, token: str, instance_id: str, chunk_size: int | None,
                    expect: int) -> dict:
    body = {"instance_id": instance_id, "ip": "10.0.0.1", "http_port": 8000,
            "chunk_size": chunk_size}
    response = await coord.client.post(INSTANCES_PATH, data=encode(body), headers=_as(token))
    assert response.status == expect, await response.text()
    return await response.json()


async def _chunk_size(coord) -> int:
    return (await (await coord.client.get(STATS_PATH, headers=_as(ADMIN))).json())["chunk_size"]


async def _finds_a(coord) -> bool:
    body = {"tokens_b64": encode_tokens(np.asarray(A, dtype=np.uint32)), "model_name": "m"}
    response = await coord.client.post(BLEND_LOOKUP_PATH, data=encode(body), headers=_as(ADMIN))
    return bool((await response.json())["matches"])


async def _listed(coord) -> list[str]:
    listing = await (await coord.client.get(INSTANCES_PATH, headers=_as(ADMIN))).json()
    return [i["instance_id"] for i in listing["instances"]]


async def _store_a(coord) -> None:
    body = encode({"batches": [batch(entry("aa01", A))]})
    response = await coord.client.post("/events", data=body, headers=_as(OPEN))
    assert response.status == 200, await response.text()


# --- item 1: a registration binds only with the scope binding needs ------------------------


async def test_a_scoped_registration_does_not_bind_the_fleets_chunk_size(start):
    coord = await start(access_tokens=TOKENS, chunk_size=4)
    await _store_a(coord)
    refused = await _register(coord, SCOPED, "inst-A", 8, expect=409)
    assert "--chunk-size 8" in refused["detail"] and "scoped" in refused["detail"]
    assert await _chunk_size(coord) == 4 and await _finds_a(coord)
    assert await _listed(coord) == []  # nothing registered
    # Its size equal to the coordinator's: registered, and nothing bound by it ...
    await _register(coord, SCOPED, "inst-A", 4, expect=200)
    assert await _listed(coord) == ["inst-A"]
    # ... so a first-comer with an unscoped token still binds (LMCache 0.5.7's servers).
    await _register(coord, OPEN, "inst-B", 8, expect=200)
    assert await _chunk_size(coord) == 8
    # Bound: the scoped server's size must be the bound one.
    await _register(coord, SCOPED, "inst-A", 8, expect=200)
    refused = await _register(coord, SCOPED, "inst-A", 4, expect=409)
    assert "8" in refused["detail"]
    await _register(coord, OPEN, "inst-B", 4, expect=409)  # as before: bound is bound


# --- item 2: a bound on the size, and a bind is all or nothing -----------------------------


async def test_a_chunk_size_beyond_the_bound_is_refused_and_changes_nothing(start):
    coord = await start(access_tokens=TOKENS, chunk_size=4)
    await _store_a(coord)
    for size in (MAX_CHUNK_SIZE + 1, 1_000_000):
        response = await coord.client.put(CHUNK_SIZE_PATH, data=encode({"chunk_size": size}),
                                          headers=_as(OPEN))
        assert response.status == 422 and "chunk_size" in await response.text()
        await _register(coord, OPEN, "inst-B", size, expect=422)
    assert await _chunk_size(coord) == 4 and await _finds_a(coord)
    with pytest.raises(ValueError, match="at most 65536"):
        CoordinatorConfig(chunk_size=MAX_CHUNK_SIZE + 1)
    # The bound itself binds (its index's storage is mapped only as it is written).
    response = await coord.client.put(CHUNK_SIZE_PATH, data=encode({"chunk_size": MAX_CHUNK_SIZE}),
                                      headers=_as(OPEN))
    assert response.status == 200, await response.text()


@pytest.mark.parametrize("failing", ["new-index", "unindexing"])
async def test_a_bind_that_fails_changes_nothing_and_records_nothing(start, monkeypatch,
                                                                     failing):
    coord = await start(access_tokens=TOKENS, chunk_size=4)
    await _store_a(coord)
    if failing == "new-index":  # what a size of 10^6 did: its index could not be allocated
        def no_memory(*args, **kwargs):
            raise MemoryError("injected: the new index cannot be allocated")
        monkeypatch.setattr(local_matcher, "ContentIndex", no_memory)
    else:  # part-way through taking the chunks out of the old index
        real = Bindings.unindex_all

        def unindex_then_fail(self):
            real(self)
            raise MemoryError("injected: after every binding was un-indexed")
        monkeypatch.setattr(Bindings, "unindex_all", unindex_then_fail)
    response = await coord.client.put(CHUNK_SIZE_PATH, data=encode({"chunk_size": 8}),
                                      headers=_as(OPEN))
    assert response.status == 500
    assert await _chunk_size(coord) == 4 and await _finds_a(coord)
    monkeypatch.undo()
    # The bindings still say what the index holds: a DELETE takes the chunk out of it.
    gone = encode({"batches": [batch(entry("aa01", ()), seq=2, event_type="delete")]})
    response = await coord.client.post("/events", data=gone, headers=_as(OPEN))
    assert response.status == 200 and not await _finds_a(coord)
    # Nothing was recorded: the size is still free, and the next bind is a real one.
    response = await coord.client.put(CHUNK_SIZE_PATH, data=encode({"chunk_size": 4}),
                                      headers=_as(OPEN))
    assert response.status == 200
    response = await coord.client.put(CHUNK_SIZE_PATH, data=encode({"chunk_size": 8}),
                                      headers=_as(OPEN))
    assert response.status == 409  # 4 is bound now


# --- item 4: one token, one reader, however the header spells it ---------------------------


async def test_a_readers_turns_are_keyed_on_its_token_not_the_headers_spelling(start):
    reader, other = "R" * 20, "Q" * 20
    coord = await start(access_tokens=(("reader", reader), ("reader", other)))
    pool = coord.app[_MATCH_POOL]
    flows = []
    submit = pool.submit_async

    def recording(flow, *args, **options):
        flows.append(flow)
        return submit(flow, *args, **options)

    pool.submit_async = recording
    # Large enough (over 96 KiB) to be matched on the pool, not on the loop.
    tokens = encode_tokens(np.arange(30_000, dtype=np.uint32))
    body = encode({"tokens_b64": tokens, "model_name": "m"})
    for header in (f"Bearer {reader}", f"bearer  {reader}", f"BEARER\t{reader} ",
                   f"Bearer {other}"):
        response = await coord.client.post(BLEND_LOOKUP_PATH, data=body,
                                           headers={"Authorization": header})
        assert response.status == 200, (header, await response.text())
    assert len(flows) == 4
    assert flows[0] == flows[1] == flows[2] != flows[3], flows
    response = await coord.client.post(BLEND_LOOKUP_PATH, data=body,
                                       headers={"Authorization": f"Basic {reader}"})
    assert response.status == 401


# --- item 6: `#` inside a token ------------------------------------------------------------


def test_a_hash_sign_inside_a_token_is_part_of_it(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# the fleet's tokens\n"
                    "admin 0123456789abcdefSECRET#more\n"
                    "emitter 0123456789abcdefEMIT # a comment after whitespace\n"
                    "reader 0123456789abcdefREAD\t#tab, then a comment\n"
                    "  # an indented comment line\n")
    assert set(tokens_from(str(path), {})) == {
        ("admin", "0123456789abcdefSECRET#more", ANY),
        ("emitter", "0123456789abcdefEMIT", ANY),
        ("reader", "0123456789abcdefREAD", ANY)}
