"""`place_columns` (where each chunk a candidates lookup names is held) says what the stores
said: per chunk the L1 holders of the asking namespace's keys, sorted, and whether a shared
tier holds one; instances numbered in order of first mention; chunks held only by another
namespace, or not at all, held nowhere; a chunk with many placements (a many-keys record)
read as well as a flat one. In process, against the coordinator's real directory."""

from __future__ import annotations

import numpy as np

from blend_wire import BlendNamespace, EventsRequest, decode, encode, pack_kv_rank
from coordinator_stub.config import CoordinatorConfig
from coordinator_stub.directory.placements import FEW
from coordinator_stub.service.coordinator import Coordinator

LANE = "unit"

C = 16
NS = BlendNamespace("m", "", 1)
MANY = [f"i{k:02d}" for k in range(FEW + 3)]  # past FEW placements: a many-keys record
# (instance, tier, shared, model, chunk numbers stored)
STORES = [("a", "l1", False, "m", [0, 1, 6]), ("b", "l1", False, "m", [1, 2, 6]),
          ("c", "l2", True, "m", [2, 3]), ("d", "l2", False, "m", [6]),
          ("z", "l1", False, "other", [4, 1])] + [(name, "l1", False, "m", [3])
                                                  for name in MANY]


def hash_of(n: int) -> bytes:
    return n.to_bytes(32, "big")


def test_place_columns_say_what_the_stores_said():
    coordinator = Coordinator(CoordinatorConfig(enable_blend_lookup=True, chunk_size=C))
    batches = [{"instance_id": name, "incarnation": 0, "seq": 1, "event_type": "store",
                "tier": tier, "backend": "dram", "shared": shared,
                "entries": [{"key": {"chunk_hash_hex": hash_of(n).hex(), "model_name": model,
                                     "kv_rank": pack_kv_rank(1)},
                             "size_bytes": 1, "token_ids": list(range(n * C, n * C + C)),
                             "token_offset": 0} for n in chunks]}
               for name, tier, shared, model, chunks in STORES]
    coordinator.directory.ingest(decode(encode({"batches": batches}), EventsRequest).batches)
    asked = [2, 5, 0, 3, 1, 4, 6, 2, 0]  # 5: never stored; 4: another namespace's only
    got = coordinator.directory.place_columns([hash_of(n) for n in asked], NS)

    expected_l1, expected_shared, numbers = [], [], {}
    for n in asked:  # the plain reading, chunk by chunk
        held = [s for s in STORES if n in s[4] and s[3] == "m"]
        l1 = sorted(s[0] for s in held if s[1] == "l1" and not s[2])
        expected_l1.append(l1)
        expected_shared.append(any(s[2] for s in held))
        for name in l1:
            numbers.setdefault(name, len(numbers))
    assert got.instances == list(numbers)
    assert [got.l1_of(i) for i in range(len(asked))] == expected_l1
    assert got.shared.tolist() == [int(s) for s in expected_shared]
    assert got.holder_start.tolist() == np.cumsum([0] + [len(h) for h in expected_l1]).tolist()
    assert coordinator.directory.places_of([hash_of(n) for n in asked], NS) == list(
        zip(expected_l1, expected_shared))


def test_no_chunks_asked_no_places():
    coordinator = Coordinator(CoordinatorConfig(enable_blend_lookup=True, chunk_size=C))
    got = coordinator.directory.place_columns([], NS)
    assert got.instances == [] and got.holder_start.tolist() == [0]
    assert got.holders.size == 0 and got.shared.size == 0
