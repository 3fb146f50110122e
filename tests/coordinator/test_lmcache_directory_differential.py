"""With `--trust-shared-hashes`, our directory answers blend lookups exactly as LMCache
0.5.6's own `KeyDirectory` does, under random multi-namespace histories.

Both are fed the same admitted batches in-process (STOREs with or without tokens, DELETEs,
departures) across tenants, world sizes, object groups, instances and tiers, a few chunk
hashes and contents, chunk size 4; after every batch each namespace's matches (names, offsets,
positions, order) and the blend index counts must be LMCache's. Offsets are always known and
token lists one chunk long: where LMCache differs on purpose there (an unknown offset keeps
LMCache's stale position; a list of another length becomes LMCache's binding content),
WIRE.md documents our rule and tests/coordinator/test_coordinator.py tests it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from lmcache.v1.distributed.api import EncodedObjectKey as LMKey
from lmcache.v1.distributed.api import Tier
from lmcache.v1.mp_coordinator.api import BlendNamespace as LMNamespace
from lmcache.v1.mp_coordinator.api import CacheEventBatch as LMBatch
from lmcache.v1.mp_coordinator.api import CacheEventEntry as LMEntry
from lmcache.v1.mp_coordinator.api import CacheEventType
from lmcache.v1.mp_coordinator.views.key_directory import KeyDirectory as LMDirectory

from blend_wire import (
    BlendNamespace,
    CacheEventBatch,
    CacheEventEntry,
    EncodedObjectKey,
    pack_kv_rank,
)
from coordinator_stub.directory import KeyDirectory

LANE = "lmcache"

C = 4
HASHES = ["a1", "a2", "a3", "a4", "a5"]
CONTENTS = [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)]
SPACES = [("m", "t0", 1, 0), ("m", "t1", 1, 0), ("m", "t2", 1, 0), ("m", "t0", 2, 1)]
GROUPS = [0, 0, 0, 1]
INSTANCES = ["i0", "i1"]
TIERS = [("l1", "dram"), ("l2", "disk")]
QUERIES = [np.array(c * 6, dtype=np.uint32) for c in CONTENTS] + [
    np.array([t for c in CONTENTS for t in c] * 3, dtype=np.uint32)]


def _both_entries(h, space, group, tokens, offset):
    model, salt, ws, rank = space
    fields = dict(chunk_hash_hex=h, model_name=model, kv_rank=pack_kv_rank(ws, rank),
                  object_group_id=group, cache_salt=salt)
    ours = CacheEventEntry(key=EncodedObjectKey(**fields), token_ids=list(tokens),
                           token_offset=offset, size_bytes=64)
    theirs = LMEntry(key=LMKey(**fields), token_ids=list(tokens), token_offset=offset,
                     size_bytes=64)
    return ours, theirs


def _assert_same(ours: KeyDirectory, theirs: LMDirectory, step: int) -> None:
    for model, salt, ws, _ in SPACES:
        for query in QUERIES:
            got = [(m.chunk_hash, m.old_st, m.cur_st)
                   for m in ours.match(query, BlendNamespace(model, salt, ws))]
            want = [(m.chunk_hash, m.old_st, m.cur_st)
                    for m in theirs.blend_match(query, LMNamespace(model, salt, ws))]
            assert got == want, (step, salt, ws, query.tolist())
    blend, reference = ours.blend_stats(), theirs.blend_stats()
    assert (blend["num_contents"], blend["num_chunks"], blend["num_claims"],
            blend["num_namespaces"]) == (reference.num_contents, reference.num_chunks,
                                         reference.num_claims, reference.num_namespaces), step


@pytest.mark.parametrize("seed", range(12))
def test_trusted_hashes_answer_as_lmcaches_directory(seed):
    rng = random.Random(seed)
    ours = KeyDirectory(chunk_size=C, enable_blend_lookup=True, trust_shared_hashes=True)
    theirs = LMDirectory()
    theirs.enable_blend_lookup(chunk_size=C, probe_stride=1)
    seqs = dict.fromkeys(INSTANCES, 0)
    for step in range(300):
        inst = rng.choice(INSTANCES)
        if rng.random() < 0.03:  # the instance leaves: its L1 placements go, on both
            ours.drop_instance(inst)
            ours.readmit(inst)  # and registers again (ours then takes its L1 batches again)
            theirs.fence_instance(inst)
            seqs[inst] = 0
            _assert_same(ours, theirs, step)
            continue
        seqs[inst] += 1
        tier, backend = rng.choice(TIERS)
        kind = "store" if rng.random() < 0.7 else "delete"
        entries = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            tokens = rng.choice([(), rng.choice(CONTENTS), rng.choice(CONTENTS)]) \
                if kind == "store" else ()
            entries.append(_both_entries(rng.choice(HASHES), rng.choice(SPACES),
                                         rng.choice(GROUPS), tokens,
                                         rng.choice([0, 4, 8])))
        reply = ours.ingest([CacheEventBatch(
            instance_id=inst, incarnation=0, seq=seqs[inst], event_type=kind, tier=tier,
            backend=backend, entries=[e[0] for e in entries])])
        assert reply.applied == 1
        theirs.consume(LMBatch(instance_id=inst, incarnation=0, seq=seqs[inst],
                               event_type=CacheEventType(kind), tier=Tier(tier),
                               backend=backend, entries=[e[1] for e in entries]))
        _assert_same(ours, theirs, step)
