"""Nothing one tenant reports for a chunk hash changes what another tenant matches, or tells
it what the other cached (issue 19, "content per namespace"), and claims on one chunk cost
O(1) each ("quadratic claims").

Chunk hashes do not include the salt (LMCache's prefix-chained blake3), so tenant B can
compute tenant A's hash X for a guessed document. Before (main at 339f0d9): B storing X
with other tokens, from its own instance under its own salt, made A's lookup of its own
tokens find nothing and A's lookup of B's tokens name X (A's engine would load A's KV into
a prompt holding B's text); B storing X at offset 999 moved A's `old_st`, at -1 it
un-indexed A's chunk; B's token-less STOREs of guessed hashes matched exactly when some
tenant had cached the document; and every claim on a chunk rewrote the offset of all its
claims (8,000 namespaces on one chunk: 6.5 s for one content change).

`--trust-shared-hashes` restores LMCache's rules on purpose (tests/coordinator/test_coordinator.py).
"""

from __future__ import annotations

from blend_wire import CacheEventBatch, CacheEventEntry, EncodedObjectKey, pack_kv_rank
from coordinator_stub.directory import KeyDirectory
from helpers import python_lines
from hostile_helpers import A, B, batch, entry

LANE = "unit"

DOCUMENT = [[31, 32, 33, 34], [41, 42, 43, 44], [51, 52, 53, 54]]
HASHES = ["d001", "d002", "d003"]


async def test_another_tenants_tokens_under_a_known_hash_change_nothing_it_matches(coord):
    await coord.post_events(batch(entry("aa01", A, offset=4, salt="a"), instance="inst-a"))
    await coord.post_events(batch(entry("aa01", B, offset=0, salt="b"), instance="inst-b"))
    assert await coord.lookup(A, salt="a") == [("aa01", 4, 0)]
    assert await coord.lookup(B, salt="a") == []  # never B's text under A's KV
    assert await coord.lookup(B, salt="b") == [("aa01", 0, 0)]  # B has its own
    assert await coord.lookup(A, salt="b") == []


async def test_another_tenants_offset_for_a_known_hash_moves_nothing(coord):
    await coord.post_events(batch(entry("aa01", A, offset=4, salt="a"), instance="inst-a"))
    await coord.post_events(batch(entry("aa01", A, offset=999, salt="b"), instance="inst-b"))
    assert await coord.lookup(A, salt="a") == [("aa01", 4, 0)]
    assert await coord.lookup(A, salt="b") == [("aa01", 999, 0)]
    await coord.post_events(batch(entry("aa01", A, offset=-1, salt="b"), instance="inst-b",
                                  seq=2))
    assert await coord.lookup(A, salt="a") == [("aa01", 4, 0)]  # still indexed for A
    assert await coord.lookup(A, salt="b") == []


async def _probe(coord, seq: int) -> list:
    """B's attack: token-less STOREs of the guessed document's hashes, a lookup, a delete."""
    await coord.post_events(batch(*(entry(h, (), offset=0, salt="b") for h in HASHES),
                                  instance="inst-b", seq=seq))
    found = await coord.lookup([t for chunk in DOCUMENT for t in chunk], salt="b")
    await coord.post_events(batch(*(entry(h, salt="b") for h in HASHES), instance="inst-b",
                                  seq=seq + 1, event_type="delete"))
    return found


async def test_a_token_less_probe_learns_nothing_of_another_tenants_cache(coord):
    nobody_cached = await _probe(coord, seq=1)
    await coord.post_events(batch(*(entry(h, tokens, offset=4 * i, salt="a")
                                    for i, (h, tokens) in enumerate(zip(HASHES, DOCUMENT))),
                                  instance="inst-a"))
    a_cached = await _probe(coord, seq=3)
    assert nobody_cached == a_cached == []
    # A's own chunks are untouched by the probe.
    assert len(await coord.lookup([t for chunk in DOCUMENT for t in chunk], salt="a")) == 3


def _claims(directory: KeyDirectory, n: int, seq: int, tokens: list[int], offset: int,
            only: int | None = None) -> None:
    entries = [CacheEventEntry(key=EncodedObjectKey(chunk_hash_hex="aa01", model_name="m",
                                                    kv_rank=pack_kv_rank(1),
                                                    cache_salt=f"s{i}"),
                               token_ids=list(tokens), token_offset=offset)
               for i in ([only] if only is not None else range(n))]
    reply = directory.ingest([CacheEventBatch(instance_id="i0", incarnation=0, seq=seq,
                                              event_type="store", tier="l1", backend="dram",
                                              entries=entries)])
    assert reply.applied == 1


def test_claims_on_one_chunk_cost_the_same_each_however_many_there_are():
    """Interpreted work (lines run) for n namespaces claiming one chunk, and for changing
    its content and its offset: linear in n (8x from 250 to 2,000; quadratic: 64x)."""
    work = {}
    for trust in (False, True):
        for n in (250, 2000):
            directory = KeyDirectory(chunk_size=4, enable_blend_lookup=True,
                                     trust_shared_hashes=trust)
            claimed = python_lines(lambda: _claims(directory, n, 1, A, 0))
            # One namespace's new content and offset: with trusted hashes LMCache's rule
            # moves every claim (O(n)); else that namespace's only (O(1)).
            changed = python_lines(lambda: _claims(directory, n, 2, B, 8, only=0))
            moved = python_lines(lambda: _claims(directory, n, 3, B, 12, only=0))
            assert directory.stats()["blend"]["num_claims"] == n
            work[trust, n] = (claimed, changed, moved)
    for trust in (False, True):
        for step in range(3):
            assert work[trust, 2000][step] < 10 * work[trust, 250][step], (trust, step, work)
    # Without trust, the first time a namespace parts ways the chunk's content becomes
    # per namespace (linear, once); from then on its changes cost the same however many
    # others claim the chunk.
    assert work[False, 2000][2] < 2 * work[False, 250][2], work
