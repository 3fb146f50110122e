"""Scoped tokens (issue 19, item 1).

Before: any emitter token spoke for any instance and any salt, and any reader looked up
any salt. With its own token, B deleted A's chunk as `inst-A`, fenced all of A's
placements with a batch as `inst-A` at `incarnation: 1` (A's next batch answered
`stale`), made A's next restart `duplicate` with `seq: 2^62`, re-registered, heartbeated
and deregistered `inst-A`, stored under A's salt and looked A's salt up. Now a token line
`ROLE TOKEN [instances=P,...] [salts=S,...]` scopes it: each of those is `403` naming
what was refused, and nothing of it is applied; a scope left out is any.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from blend_wire import BLEND_LOOKUP_PATH, BLEND_SCORE_PATH, CHUNK_SIZE_PATH, EVENTS_PATH, INSTANCES_PATH, STATS_PATH, encode, \
    encode_tokens
from coordinator_stub.scopes import ANY, AccessConfigError, Scope, tokens_from
from coordinator_stub.launch.process import launch_coordinator
from helpers import poll_lookup, wait_until
from hostile_helpers import A, B, batch, entry
from plugin import BlendPlugin, CacheEventReporter, InMemoryHost, LookupKey, PluginConfig
from plugin.registrar import InstanceRegistrar

LANE = "unit"

TOKEN_A, TOKEN_B, ADMIN, OPEN = "A" * 20, "B" * 20, "Z" * 20, "O" * 20
SCOPE_A = Scope(instances=("inst-A",), salts=frozenset({"tenant-a"}))
SCOPE_B = Scope(instances=("inst-B*",), salts=frozenset({"tenant-b", ""}))
TOKENS = (("emitter", TOKEN_A, SCOPE_A), ("reader", TOKEN_A, Scope(salts=SCOPE_A.salts)),
          ("emitter", TOKEN_B, SCOPE_B), ("reader", TOKEN_B, Scope(salts=SCOPE_B.salts)),
          ("admin", ADMIN, ANY), ("emitter", OPEN, ANY))


def _as(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


async def _post(coord, token: str, *batches: dict, expect: int):
    response = await coord.client.post(EVENTS_PATH, data=encode({"batches": list(batches)}),
                                       headers=_as(token))
    assert response.status == expect, await response.text()
    return await response.json()


async def _lookup(coord, token: str, tokens, salt: str, expect: int = 200):
    body = {"tokens_b64": encode_tokens(np.asarray(tokens, dtype=np.uint32)),
            "model_name": "m", "cache_salt": salt}
    response = await coord.client.post(BLEND_LOOKUP_PATH, data=encode(body), headers=_as(token))
    assert response.status == expect, await response.text()
    return await response.json()


async def _stats(coord) -> dict:
    return await (await coord.client.get(STATS_PATH, headers=_as(ADMIN))).json()


A_STORE = batch(entry("aa01", A, salt="tenant-a"), instance="inst-A", seq=1)


@pytest.mark.parametrize("attack", [
    # (what B posts as inst-A, what it would have done)
    batch(entry("aa01", (), salt="tenant-a"), instance="inst-A", seq=2, event_type="delete"),
    batch(entry("bb01", B, salt="tenant-b"), instance="inst-A", seq=1, incarnation=1),
    batch(entry("bb01", B, salt="tenant-b"), instance="inst-A", seq=2 ** 62),
], ids=["delete-as-A", "fence-A", "seq-2^62-as-A"])
async def test_an_emitter_cannot_speak_for_another_instance(start, attack):
    coord = await start(access_tokens=TOKENS)
    assert (await _post(coord, TOKEN_A, A_STORE, expect=200))["applied"] == 1
    refused = await _post(coord, TOKEN_B, attack, expect=403)
    assert "inst-A" in refused["detail"] and "batches[0].instance_id" in refused["detail"]
    # A is untouched: its chunk is found, its next batch (and its next restart) applies.
    assert (await _lookup(coord, TOKEN_A, A, "tenant-a"))["matches"]
    follow = batch(entry("aa02", B, salt="tenant-a"), instance="inst-A", seq=2)
    assert (await _post(coord, TOKEN_A, follow, expect=200))["applied"] == 1
    restart = batch(entry("aa03", A[::-1], salt="tenant-a"), instance="inst-A", seq=1,
                    incarnation=1)
    assert (await _post(coord, TOKEN_A, restart, expect=200))["applied"] == 1


async def test_a_body_with_one_batch_outside_the_scope_applies_nothing(start):
    coord = await start(access_tokens=TOKENS)
    own = batch(entry("bb01", B, salt="tenant-b"), instance="inst-B-1", seq=1)
    other_salt = batch(entry("bb02", A, salt="tenant-a"), instance="inst-B-1", seq=2)
    refused = await _post(coord, TOKEN_B, own, other_salt, expect=403)
    assert "tenant-a" in refused["detail"]
    assert "batches[1].entries[0].key.cache_salt" in refused["detail"]
    assert (await _stats(coord))["num_keys"] == 0
    # Within its scope (a prefix, the empty salt), the same body applies.
    empty_salt = batch(entry("bb02", A, salt=""), instance="inst-B-2", seq=1)
    assert (await _post(coord, TOKEN_B, own, empty_salt, expect=200))["applied"] == 2


async def test_a_reader_looks_up_only_its_salts(start):
    coord = await start(access_tokens=TOKENS)
    await _post(coord, TOKEN_A, A_STORE, expect=200)
    refused = await _lookup(coord, TOKEN_B, A, "tenant-a", expect=403)
    assert "tenant-a" in refused["detail"] and "cache_salt" in refused["detail"]
    assert (await _lookup(coord, TOKEN_B, A, "tenant-b"))["matches"] == []
    assert (await _lookup(coord, TOKEN_A, A, "tenant-a"))["matches"]
    # A blend score (routers, reader role) names a salt too: the same scope.
    body = {"tokens_b64": encode_tokens(np.asarray(A, dtype=np.uint32)), "model_name": "m",
            "cache_salt": "tenant-a"}
    score = await coord.client.post(BLEND_SCORE_PATH, data=encode(body), headers=_as(TOKEN_B))
    assert score.status == 403 and "tenant-a" in (await score.json())["detail"]
    score = await coord.client.post(BLEND_SCORE_PATH, data=encode(body), headers=_as(TOKEN_A))
    assert score.status == 200, await score.text()
    # A large body (parsed on the matcher thread) is held to the same scope.
    big = np.tile(np.asarray(A, dtype=np.uint32), 70_000)
    refused = await _lookup(coord, TOKEN_B, big, "tenant-a", expect=403)
    assert "tenant-a" in refused["detail"]


async def test_an_emitter_registers_heartbeats_and_deregisters_only_its_instances(start):
    coord = await start(access_tokens=TOKENS)
    body = {"instance_id": "inst-A", "ip": "10.0.0.1", "http_port": 8000}
    assert (await coord.client.post(INSTANCES_PATH, data=encode(body),
                                    headers=_as(TOKEN_A))).status == 200
    hijack = dict(body, ip="10.6.6.6")
    response = await coord.client.post(INSTANCES_PATH, data=encode(hijack), headers=_as(TOKEN_B))
    assert response.status == 403 and "inst-A" in (await response.json())["detail"]
    # An empty id would be assigned at random, outside any instance scope: say so.
    response = await coord.client.post(INSTANCES_PATH, data=encode(dict(body, instance_id="")),
                                       headers=_as(TOKEN_B))
    assert response.status == 403 and "instance_id" in (await response.json())["detail"]
    beat = await coord.client.put(f"{INSTANCES_PATH}/inst-A/heartbeat", headers=_as(TOKEN_B))
    assert beat.status == 403
    gone = await coord.client.delete(f"{INSTANCES_PATH}/inst-A", headers=_as(TOKEN_B))
    assert gone.status == 403 and "inst-A" in (await gone.json())["detail"]
    listing = await (await coord.client.get(INSTANCES_PATH, headers=_as(ADMIN))).json()
    assert [(i["instance_id"], i["ip"]) for i in listing["instances"]] == [("inst-A", "10.0.0.1")]
    # Its own: all allowed (a prefix scope).
    mine = dict(body, instance_id="inst-B-7")
    assert (await coord.client.post(INSTANCES_PATH, data=encode(mine),
                                    headers=_as(TOKEN_B))).status == 200
    assert (await coord.client.put(f"{INSTANCES_PATH}/inst-B-7/heartbeat",
                                   headers=_as(TOKEN_B))).status == 200
    assert (await coord.client.delete(f"{INSTANCES_PATH}/inst-B-7",
                                      headers=_as(TOKEN_B))).status == 204
    # A scope left out is any: today's behaviour.
    assert (await coord.client.put(f"{INSTANCES_PATH}/inst-A/heartbeat",
                                   headers=_as(OPEN))).status == 200


def test_scoped_token_lines_and_variables(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"emitter {TOKEN_A} instances=inst-A,pool-* salts=\"\",tenant-a\n"
                    f"reader {TOKEN_A} salts=tenant-a\n"
                    f"emitter {OPEN}\n")
    env = {"COORDINATOR_READER_TOKEN": f"{TOKEN_B} salts=\"\"; {'q' * 20},{'r' * 20}",
           "COORDINATOR_EMITTER_TOKEN": f"{'s' * 20}, {'t' * 20}"}
    grants = set(tokens_from(str(path), env))
    assert grants == {
        ("emitter", TOKEN_A, Scope(("inst-A", "pool-*"), frozenset({"", "tenant-a"}))),
        ("reader", TOKEN_A, Scope(None, frozenset({"tenant-a"}))),
        ("emitter", OPEN, ANY), ("reader", TOKEN_B, Scope(None, frozenset({""}))),
        ("reader", "q" * 20, ANY), ("reader", "r" * 20, ANY),
        ("emitter", "s" * 20, ANY), ("emitter", "t" * 20, ANY)}
    scope = Scope(("inst-A", "pool-*"), None)
    assert scope.allows_instance("pool-") and scope.allows_instance("pool-7")
    assert not scope.allows_instance("inst-AB") and not scope.allows_instance("poo")
    for line, message in [(f"admin {ADMIN} salts=x", "cannot be scoped"),
                          (f"reader {ADMIN} instances=a", "cannot be scoped by instances"),
                          (f"emitter {ADMIN} salts=", "empty"),
                          (f"emitter {ADMIN} tenants=a", "not a scope"),
                          (f"emitter {ADMIN} instances=a*b", "prefix ending in"),
                          (f"emitter {ADMIN} salts=a/b", "must not contain")]:
        path.write_text(line + "\n")
        with pytest.raises(AccessConfigError, match=message):
            tokens_from(str(path), {})


# --- the plugin, its registrar and reporter, against the coordinator process ---------------

C = 256


@pytest.mark.coordinator
def test_plugins_with_scoped_tokens_work_and_stay_in_their_scope(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"emitter {TOKEN_A} instances=srv-a* salts=\"\",tenant\n"
                      f"reader {TOKEN_A} salts=\"\",tenant\n"
                      f"emitter {TOKEN_B} instances=srv-b salts=tenant\n"
                      f"reader {TOKEN_B} salts=tenant\n"
                      f"admin {ADMIN}\n")
    l2: dict = {}
    doc = np.random.default_rng(19).integers(1000, 60000, 2 * C, dtype=np.uint32)
    query = np.concatenate([np.arange(5, dtype=np.uint32), doc])

    def server(name: str, token: str) -> tuple[InMemoryHost, BlendPlugin]:
        host = InMemoryHost(C, shared_l2=l2)
        config = PluginConfig(chunk_size=C, coordinator_url=running.url, event_reporting=True,
                              blend_timeout=1.0, event_flush_interval=0.05, instance_id=name,
                              coordinator_token=token)
        return host, BlendPlugin(config, host)

    with launch_coordinator("--enable-blend-lookup", "--auth-token-file", str(tokens)) as running:
        host_a, a = server("srv-a-1", TOKEN_A)
        host_b, b = server("srv-b", TOKEN_B)
        host_x, x = server("srv-a-2", TOKEN_B)  # B's token, an id outside its scope
        try:
            key = LookupKey("store", doc, "m", cache_salt="tenant")
            hashes = host_a.chunk_hashes(key)
            host_a.store(key, hashes)
            a.on_store(key, hashes)
            assert wait_until(lambda: a.flush(), timeout=10)
            found, _, _ = poll_lookup(b, LookupKey("q1", query, "m", cache_salt="tenant"))
            assert [s.hash for s in found.non_prefix_segments] == hashes
            # Outside its scope: refused (the plugin neither raises nor waits past budget).
            key_x = LookupKey("store-x", doc[::-1].copy(), "m", cache_salt="tenant")
            x.on_store(key_x, host_x.chunk_hashes(key_x))
            assert x.flush()  # a 403 is for good: dropped and counted, not retried
            assert x.stats().reporter.forbidden_batches >= 1
            other, _, _ = poll_lookup(b, LookupKey("q2", query, "m"))  # salt "" not B's
            assert other.non_prefix_segments == []
            assert b.stats().client.failed >= 1
        finally:
            for plugin in (a, b, x):
                plugin.close()
        # The registrar: its own id registers, heartbeats, deregisters; another's does not.
        mine = InstanceRegistrar(running.url, instance_id="srv-b", ip="127.0.0.1",
                                 http_port=8000, heartbeat_interval=0.05, token=TOKEN_B)
        theirs = InstanceRegistrar(running.url, instance_id="srv-a-1", ip="127.0.0.1",
                                   http_port=8001, heartbeat_interval=0.05, token=TOKEN_B)
        with httpx.Client(base_url=running.url, timeout=10, headers=_as(ADMIN)) as http:
            try:
                # Both try every beat; by the third of its own, the other was refused thrice.
                assert wait_until(lambda: mine.stats().heartbeats >= 3, timeout=10)
                listed = http.get(INSTANCES_PATH).json()["instances"]
                assert [i["instance_id"] for i in listed] == ["srv-b"]
                assert theirs.stats().registrations == 0
            finally:
                mine.close()
                theirs.close()
            assert http.get(INSTANCES_PATH).json()["instances"] == []  # deregistered
            # The reporter the LMCache adapter builds carries the same scoped token.
            config = PluginConfig(chunk_size=C, coordinator_url=running.url,
                                  event_reporting=True, instance_id="srv-a-9",
                                  coordinator_token=TOKEN_A)
            reporter = CacheEventReporter.from_config(config)
            try:
                reporter.report_store(LookupKey("s", [], "m", cache_salt="tenant").namespace,
                                      [b"\x02" * 16], [np.arange(C, dtype=np.uint32)], [0])
                assert reporter.flush() and reporter.stats().failed_flushes == 0
            finally:
                reporter.close()
            assert http.get(STATS_PATH).json()["num_keys"] == 2 * 1 + 1


async def test_servers_bind_the_chunk_size_but_not_with_a_scoped_token(start):
    # LMCache 0.5.7's servers PUT their chunk size: an emitter's call (it was admin-only, so
    # with access control on their binding failed). The size applies to every tenant, so a
    # token held to some instances or salts may not set it.
    coord = await start(access_tokens=TOKENS, chunk_size=4)
    body = encode({"chunk_size": 8})
    scoped = await coord.client.put(CHUNK_SIZE_PATH, data=body, headers=_as(TOKEN_A))
    assert scoped.status == 403 and "every tenant" in (await scoped.json())["detail"]
    bound = await coord.client.put(CHUNK_SIZE_PATH, data=body, headers=_as(OPEN))
    assert bound.status == 200, await bound.text()
    assert (await bound.json())["chunk_size"] == 8
    assert (await coord.client.put(CHUNK_SIZE_PATH, data=body)).status == 401
