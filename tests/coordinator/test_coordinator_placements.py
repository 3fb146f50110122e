"""What the directory reports about placements, under any history, against LMCache's rules
written the obvious way: per key, its placements (identity `(instance, tier, backend)`, or
`(tier, backend)` for a shared pool; a new report replaces size, incarnation and, for a
shared pool, reporter), its access count; the running totals by tier; L1 keys per
instance; fencing on restart (every placement) and on departure (L1 only, cursor gone).

Histories use many keys per chunk hash (object groups x ranks), so chunks cross from the
flat representation to the many-keys one and back.
"""

from __future__ import annotations

import random

import pytest

from blend_wire import CacheEventBatch, CacheEventEntry, EncodedObjectKey, pack_kv_rank
from helpers import python_lines
from coordinator_stub.directory import KeyDirectory

LANE = "unit"

C = 4
HASHES = ["a1", "a2", "a3"]
KEYS = [(salt, rank, group) for salt in ("", "t1") for rank in (0, 1) for group in range(4)]
INSTANCES = ["i0", "i1", "i2"]
PLACES = [("l1", "dram", False), ("l1", "cxl", False), ("l2", "disk", False),
          ("l2", "nfs", True)]
SIZES = [10, 20, 30]
# A hash's tokens, when a STORE carries any: one per hash, as honest servers report them
# (other tokens under a hash another instance holds are refused: test_coordinator_directory).
TOKENS_OF = {"a1": (1, 2, 3, 4), "a2": (5, 6, 7, 8), "a3": (1, 2, 3, 4)}


def _key(h: str, salt: str, rank: int, group: int) -> EncodedObjectKey:
    return EncodedObjectKey(chunk_hash_hex=h, model_name="m", cache_salt=salt,
                            kv_rank=pack_kv_rank(2, rank), object_group_id=group)


class Reference:
    def __init__(self) -> None:
        self.records: dict[tuple, dict] = {}
        self.cursors: set[str] = set()

    def _find(self, placements, inst, tier, backend, shared):
        for i, p in enumerate(placements):
            if (p[2], p[3], p[4]) == (tier, backend, shared) and (shared or p[0] == inst):
                return i
        return None

    def store(self, key, inst, inc, tier, backend, shared, size):
        record = self.records.setdefault(key, {"placements": [], "accesses": 0})
        placement = (inst, inc, tier, backend, shared, size)
        at = self._find(record["placements"], inst, tier, backend, shared)
        if at is None:
            record["placements"].append(placement)
        else:
            record["placements"][at] = placement

    def delete(self, key, inst, tier, backend, shared):
        record = self.records.get(key)
        if record is None:
            return
        at = self._find(record["placements"], inst, tier, backend, shared)
        if at is not None:
            del record["placements"][at]
        if not record["placements"]:
            del self.records[key]

    def access(self, key):
        if key in self.records:
            self.records[key]["accesses"] += 1

    def fence(self, inst, l1_only):
        for key in list(self.records):
            placements = [p for p in self.records[key]["placements"]
                          if not (p[0] == inst and (not l1_only or p[2] == "l1"))]
            if placements:
                self.records[key]["placements"] = placements
            else:
                del self.records[key]

    def totals(self) -> dict:
        every = [p for r in self.records.values() for p in r["placements"]]
        return {"num_keys": len(self.records), "num_placements": len(every),
                **{f"{t}_count": sum(p[2] == t for p in every) for t in ("l1", "l2")},
                **{f"{t}_size_bytes": sum(p[5] for p in every if p[2] == t)
                   for t in ("l1", "l2")}}

    def l1_keys_by_instance(self) -> dict:
        every = [p for r in self.records.values() for p in r["placements"]]
        return {inst: sum(p[0] == inst and p[2] == "l1" for p in every)
                for inst in self.cursors}


@pytest.mark.parametrize("seed", range(6))
def test_placements_totals_and_access_counts_follow_lmcaches_rules(seed):
    rng = random.Random(seed)
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=seed % 2 == 0)
    reference = Reference()
    streams = {inst: [0, 0] for inst in INSTANCES}  # incarnation, last seq
    for step in range(400):
        inst = rng.choice(INSTANCES)
        stream = streams[inst]
        roll = rng.random()
        if roll < 0.03:  # the instance departs: L1 fenced, its cursor forgotten
            directory.drop_instance(inst)
            directory.readmit(inst)  # and registers again (its L1 batches count again)
            reference.fence(inst, l1_only=True)
            reference.cursors.discard(inst)
            stream[1] = 0
            _assert_agree(directory, reference, step)
            continue
        if roll < 0.06:  # it restarts: its next batch fences every placement it reported
            stream[0] += 1
            stream[1] = 0
            if inst in reference.cursors:
                reference.fence(inst, l1_only=False)
        stream[1] += 1
        tier, backend, shared = rng.choice(PLACES)
        chosen = [(rng.choice(HASHES), *rng.choice(KEYS)) for _ in range(rng.randint(1, 6))]
        kind = rng.choices(["store", "delete", "access"], [6, 3, 2])[0]
        entries = []
        for h, salt, rank, group in chosen:
            key = (h, salt, rank, group)
            size = rng.choice(SIZES)
            tokens = rng.choice([(), (), TOKENS_OF[h]])
            entries.append(CacheEventEntry(key=_key(*key), size_bytes=size,
                                           token_ids=list(tokens) if kind == "store" else [],
                                           token_offset=0 if tokens else -1))
            if kind == "store":
                reference.store(key, inst, stream[0], tier, backend, shared, size)
            elif kind == "delete":
                reference.delete(key, inst, tier, backend, shared)
            else:
                reference.access(key)
        reference.cursors.add(inst)
        reply = directory.ingest([CacheEventBatch(
            instance_id=inst, incarnation=stream[0], seq=stream[1], event_type=kind,
            tier=tier, backend=backend, shared=shared, entries=entries)])
        assert reply.applied == 1
        _assert_agree(directory, reference, step)


def _assert_agree(directory: KeyDirectory, reference: Reference, step: int) -> None:
    stats = directory.stats()
    assert {k: stats[k] for k in reference.totals()} == reference.totals(), step
    assert {k: v for k, v in directory.totals().items()
            if k in reference.totals()} == reference.totals(), step
    assert stats["l1_keys_by_instance"] == reference.l1_keys_by_instance(), step
    keys = [(bytes.fromhex(h), ("m", salt, pack_kv_rank(2, rank), group))
            for h in HASHES for salt, rank, group in KEYS]
    for (chunk_hash, raw), (places, _, accesses) in zip(keys, directory.placements_of(keys)):
        record = reference.records.get(
            (chunk_hash.hex(), raw[1], (raw[2] >> 16) & 0xFF, raw[3]), {"placements": [],
                                                                 "accesses": 0})
        assert places == sorted(record["placements"], key=lambda p: (p[0], p[2], p[3])), \
            (step, chunk_hash.hex(), raw)
        assert accesses == record["accesses"], (step, chunk_hash.hex(), raw)
    total, page = directory.list_keys("all", "", "", 0, 10_000)
    assert total == len(reference.records) == len(page), step
    total, _ = directory.list_keys("l2", "", "nfs", 0, 1)
    assert total == sum(any(p[2:4] == ("l2", "nfs") for p in r["placements"])
                        for r in reference.records.values()), step


def test_querying_n_keys_of_one_hash_is_linear_work():
    """A chunk held under many keys (object groups x ranks, the CacheBlend case of one
    chunk hash stored many ways): resolving, looking up and listing all of them costs
    O(n), not O(n^2)."""
    work = {}
    for n in (250, 2000):
        directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
        entries = [CacheEventEntry(key=_key("a1", "", 0, group), size_bytes=8,
                                   token_ids=[1, 2, 3, 4], token_offset=0)
                   for group in range(n)]
        directory.ingest([CacheEventBatch(instance_id="i0", seq=1, event_type="store",
                                          tier="l1", backend="dram", entries=entries)])
        group_0 = [(bytes.fromhex("a1"), ("m", "", pack_kv_rank(2, 0), 0))]
        keys = [(bytes.fromhex("a1"), ("m", "", pack_kv_rank(2, 0), g)) for g in range(n)]
        expanded = python_lines(lambda: directory.with_other_groups(group_0 * 4))
        looked_up = python_lines(lambda: directory.placements_of(keys))
        listed = python_lines(lambda: directory.list_keys("all", "", "", 0, 10_000))
        assert len(directory.with_other_groups(group_0)) == n
        assert all(places for places, _, _ in directory.placements_of(keys))
        work[n] = (expanded, looked_up, listed)
    for step in range(3):  # linear: 8x; quadratic: 64x
        assert work[2000][step] < 9 * work[250][step], (step, work)


def test_a_restart_after_a_shared_placement_moved_on_and_went_applies():
    """A shared pool's placement names its latest reporter; once that one lets the chunk
    go, the first reporter's restart still applies (it failed, and with it every retry,
    while the first still listed the chunk as its own)."""
    directory = KeyDirectory(chunk_size=C)

    def batch(instance: str, incarnation: int, entries: list) -> CacheEventBatch:
        return CacheEventBatch(instance_id=instance, incarnation=incarnation, seq=1,
                               event_type="store", tier="l2", backend="nfs", shared=True,
                               entries=entries)

    stored = [CacheEventEntry(key=_key("a1", "", 0, 0), size_bytes=8)]
    directory.ingest([batch("i1", 0, stored)])
    directory.ingest([batch("i0", 0, stored)])  # the pool's one placement: i0's now
    directory.ingest([batch("i0", 1, [])])  # i0 restarts: the chunk goes
    assert directory.ingest([batch("i1", 1, [])]).applied == 1  # i1 restarts
    assert directory.stats()["num_keys"] == 0
    directory.drop_instance("i1")


def test_a_listing_while_batches_free_and_reuse_numbers_names_what_it_copied():
    """`list_keys` walks its copied rows without the directory lock. Batches free the
    place and key numbers nobody holds any more and later ones reuse them: the walk read
    them from the live tables (issue 32, item 8), so a row could name a place set to None
    (TypeError) or another instance's place. Now the tables are copied with the rows."""
    import sys
    import threading
    import time

    directory = KeyDirectory(chunk_size=C)
    steady = [CacheEventEntry(key=_key(f"{i:04x}", "", 0, 0), size_bytes=1)
              for i in range(3000)]
    directory.ingest([CacheEventBatch(instance_id="steady", seq=1, event_type="store",
                                      tier="l1", backend="dram", entries=steady)])
    stop, failures = threading.Event(), []

    def churn() -> None:
        for n in range(1, 10**6):
            if stop.is_set():
                return
            # A new instance and salt each round: its places and keys are freed when it
            # goes, and reused by the next round's.
            entries = [CacheEventEntry(key=_key(f"{i:04x}", f"s{n}", 0, 0), size_bytes=n)
                       for i in range(n % 7, 3000, 7)]
            directory.ingest([CacheEventBatch(instance_id=f"churn-{n}", seq=1,
                                              event_type="store", tier="l1",
                                              backend="dram", entries=entries)])
            directory.drop_instance(f"churn-{n}")

    writer = threading.Thread(target=churn)
    switching = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads take turns often: the walk meets the churn
    writer.start()
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not failures:
            try:
                _, page = directory.list_keys("all", "", "", 0, 10_000)
            except Exception as exc:  # noqa: BLE001 - what the walk raised is the finding
                failures.append(repr(exc))
                break
            for _, raw, places, _, _ in page:
                for place in places:
                    instance = place[0]
                    salt_round = raw[1][1:] if raw[1] else None
                    if instance != "steady" and instance != f"churn-{salt_round}":
                        failures.append(f"key {raw} listed at {place}")
    finally:
        stop.set()
        writer.join()
        sys.setswitchinterval(switching)
    assert not failures, failures[:3]


def test_a_listing_names_what_it_copied_when_a_batch_frees_numbers_before_its_walk(
        monkeypatch):
    """The race above, made certain: a batch frees (and the next reuses) numbers between
    the copy under the lock and the walk."""
    from coordinator_stub.directory import queries

    directory = KeyDirectory(chunk_size=C)

    def store(instance: str, salt: str, seq: int = 1) -> None:
        directory.ingest([CacheEventBatch(
            instance_id=instance, seq=seq, event_type="store", tier="l1", backend="dram",
            entries=[CacheEventEntry(key=_key("a1", salt, 0, 0), size_bytes=8)])])

    store("i0", "t0")
    real_walk = queries.key_page

    def walk_after_churn(*args):
        directory.drop_instance("i0")  # its place and key numbers are freed ...
        store("i9", "t9")  # ... and reused
        return real_walk(*args)

    monkeypatch.setattr(queries, "key_page", walk_after_churn)
    total, page = directory.list_keys("all", "", "", 0, 10)
    assert (total, [(raw[1], [p[0] for p in places]) for _, raw, places, _, _ in page]) \
        == (1, [("t0", ["i0"])])
