"""Within one salt, what one instance reports cannot rewrite another's (issue 32, item 3).

Before: with a token scoped to `instances=inst-A` (and the tenant's salt), re-storing
inst-C's chunk hash with other tokens X made lookups of X name inst-C's chunk (`l1:
[inst-A, inst-C]`; a score would send X to inst-C, whose KV is of the original text), and
inst-C's own text no longer found it; inst-A could also delete inst-C's shared-tier
placement. Now the first content bound while a placement holds a chunk hash stands (the
conflicting STORE is refused, nothing of it recorded, counted), and a scoped emitter
changes only its own instances' shared placements (counted). `--trust-shared-hashes`
keeps LMCache's rule: the latest report wins, whoever made it.
"""

from __future__ import annotations

import numpy as np
import pytest

from blend_wire import (BLEND_LOOKUP_PATH, DIRECTORY_LOOKUP_PATH, EVENTS_PATH, METRICS_PATH,
                        STATS_PATH, EventsRequest, decode, encode, encode_tokens)
from coordinator_client import key
from coordinator_stub import CoordinatorConfig
from coordinator_stub.durability.eventlog import LogRecord
from coordinator_stub.scopes import ANY, Scope
from coordinator_stub.service.coordinator import Coordinator
from coordinator_stub.writes.liveness import Liveness
from coordinator_stub.writes.validation import validated_batches
from coordinator_stub.writes.records import EVENTS, RecordApplier, payloads
from hostile_helpers import A, B, batch, entry

LANE = "unit"

TOKEN_A, TOKEN_C, OPEN, ADMIN = "a" * 20, "c" * 20, "o" * 20, "z" * 20
SALT = "tenant"
TOKENS = (("emitter", TOKEN_A, Scope(("inst-A",), frozenset({SALT}))),
          ("emitter", TOKEN_C, Scope(("inst-C",), frozenset({SALT}))),
          ("emitter", OPEN, ANY), ("admin", ADMIN, ANY))


def _as(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


async def _post(coord, token: str, *batches: dict) -> dict:
    response = await coord.client.post(EVENTS_PATH, data=encode({"batches": list(batches)}),
                                       headers=_as(token))
    assert response.status == 200, await response.text()
    return await response.json()


async def _found(coord, tokens) -> list[tuple[str, int, list, bool]]:
    """The candidates form of a lookup of `tokens`: (chunk, old_st, l1, shared) each."""
    body = {"tokens_b64": encode_tokens(np.asarray(tokens, dtype=np.uint32)),
            "model_name": "m", "cache_salt": SALT, "candidates": True}
    response = await coord.client.post(BLEND_LOOKUP_PATH, data=encode(body), headers=_as(ADMIN))
    return [(c["chunk_hash"], c["old_st"], c.get("l1", []), c.get("shared", False))
            for found in (await response.json())["candidates"] for c in found["chunks"]]


async def _placements(coord, chunk_hash: str) -> list[tuple[str, str]]:
    response = await coord.client.post(DIRECTORY_LOOKUP_PATH, headers=_as(ADMIN),
                                       data=encode({"keys": [key(chunk_hash, salt=SALT)]}))
    [result] = (await response.json())["results"]
    return [(p["instance_id"], p["tier"]) for p in result["placements"]]


async def _counters(coord) -> dict:
    stats = await (await coord.client.get(STATS_PATH, headers=_as(ADMIN))).json()
    return stats["counters"]


def _store(chunk_hash: str, tokens, offset: int, instance: str, seq: int, **where) -> dict:
    return batch(entry(chunk_hash, tokens, offset=offset, salt=SALT), instance=instance,
                 seq=seq, **where)


async def test_another_instances_chunk_keeps_its_content(start):
    coord = await start(access_tokens=TOKENS)
    await _post(coord, TOKEN_C, _store("cc01", A, 0, "inst-C", 1))
    assert await _found(coord, A) == [("cc01", 0, ["inst-C"], False)]
    # inst-A re-stores inst-C's hash with other tokens: refused, nothing recorded.
    reply = await _post(coord, TOKEN_A, _store("cc01", B, 0, "inst-A", 1))
    assert reply["applied"] == 1  # the batch applies; the entry does not
    assert await _found(coord, B) == []
    assert await _found(coord, A) == [("cc01", 0, ["inst-C"], False)]
    assert await _placements(coord, "cc01") == [("inst-C", "l1")]
    assert (await _counters(coord))["stores_conflicting"] == 1
    # The same tokens elsewhere: its placement counts, the position stands.
    await _post(coord, TOKEN_A, _store("cc01", A, 8, "inst-A", 2))
    assert await _found(coord, A) == [("cc01", 0, ["inst-A", "inst-C"], False)]
    # Its own chunk, alone: an instance may still change what it reported.
    await _post(coord, TOKEN_A, _store("aa01", A, 0, "inst-A", 3),
                _store("aa01", B, 4, "inst-A", 4))
    assert ("aa01", 4, ["inst-A"], False) in await _found(coord, B)
    metrics = await (await coord.client.get(METRICS_PATH, headers=_as(ADMIN))).text()
    assert "blend_coordinator_conflicting_stores_total 1.0" in metrics
    # Once inst-C lets it go, the hash is free again.
    await _post(coord, TOKEN_C, _store("cc01", (), -1, "inst-C", 2, event_type="delete"))
    await _post(coord, TOKEN_A, _store("cc01", (), -1, "inst-A", 5, event_type="delete"))
    await _post(coord, TOKEN_A, _store("cc01", B, 0, "inst-A", 6))
    assert ("cc01", 0, ["inst-A"], False) in await _found(coord, B)


async def test_a_scoped_emitter_leaves_another_instances_shared_placement(start):
    coord = await start(access_tokens=TOKENS)
    shared = dict(tier="l2", backend="nfs", shared=True)
    await _post(coord, TOKEN_C, _store("cc01", A, 0, "inst-C", 1, **shared))
    assert await _found(coord, A) == [("cc01", 0, [], True)]
    await _post(coord, TOKEN_A, _store("cc01", (), -1, "inst-A", 1, event_type="delete",
                                       **shared))
    await _post(coord, TOKEN_A, _store("cc01", A, 0, "inst-A", 2, **shared))  # take it over
    await _post(coord, TOKEN_A, _store("cc01", (), -1, "inst-A", 3, event_type="delete",
                                       **shared))
    assert await _found(coord, A) == [("cc01", 0, [], True)]
    assert await _placements(coord, "cc01") == [("inst-C", "l2")]
    assert (await _counters(coord))["foreign_placement_changes"] == 3
    # An unscoped emitter keeps LMCache's rule: any reporter deletes the pool's copy.
    await _post(coord, OPEN, _store("cc01", (), -1, "inst-X", 1, event_type="delete",
                                    **shared))
    assert await _found(coord, A) == [] and await _placements(coord, "cc01") == []


@pytest.mark.parametrize("trust", [False, True], ids=["own-content", "trust-shared-hashes"])
async def test_lmcaches_rule_stays_behind_trust_shared_hashes(start, trust):
    coord = await start(access_tokens=TOKENS, trust_shared_hashes=trust)
    shared = dict(tier="l2", backend="nfs", shared=True)
    await _post(coord, TOKEN_C, _store("cc01", A, 0, "inst-C", 1),
                _store("cc02", A[::-1], 0, "inst-C", 2, **shared))
    await _post(coord, TOKEN_A, _store("cc01", B, 0, "inst-A", 1),
                _store("cc02", (), -1, "inst-A", 2, event_type="delete", **shared))
    if trust:  # the latest STORE wins, and any reporter deletes the pool's copy
        assert await _found(coord, B) == [("cc01", 0, ["inst-A", "inst-C"], False)]
        assert await _found(coord, A) == [] and await _placements(coord, "cc02") == []
    else:
        assert await _found(coord, B) == []
        assert await _found(coord, A) == [("cc01", 0, ["inst-C"], False)]
        assert await _placements(coord, "cc02") == [("inst-C", "l2")]


def test_replicas_apply_a_records_scope_alike():
    """Over the event log, a record carries the poster's instance scope (and is still an
    `/events` body), so replicas applying it leave a foreign shared placement alike."""
    shared = dict(tier="l2", backend="nfs", shared=True)
    stored = encode({"batches": [_store("cc01", A, 0, "inst-C", 1, **shared)]})
    deleted = encode({"batches": [_store("cc01", (), -1, "inst-A", 1, event_type="delete",
                                         **shared)]})
    replicas = [Coordinator(CoordinatorConfig(chunk_size=4)) for _ in range(2)]
    records = []
    for seq, (body, speaks_for) in enumerate([(stored, ("inst-C",)), (deleted, ("inst-A",))]):
        raws, batches = validated_batches(body)
        [(payload, _)] = payloads(raws, batches, 1 << 20, speaks_for)
        assert decode(payload, EventsRequest).batches  # still an `/events` body
        records.append(LogRecord(seq + 1, EVENTS, f"r{seq}", payload))
    for replica in replicas:
        RecordApplier(replica, Liveness(30.0)).apply(records)
        assert replica.directory.stats()["counters"]["foreign_placement_changes"] == 1
        assert replica.directory.stats()["l2_count"] == 1
