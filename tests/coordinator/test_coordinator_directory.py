"""The blend index stays exactly the derived view of the key directory, under any history.

Random store / delete / restart histories (small pools of hashes, contents, namespaces,
instances and tiers, so every collision the lifecycle table covers happens) are applied
to a `KeyDirectory` and to a plain reference model; after every batch, what each
namespace can match, and the counts in stats, must agree.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from coordinator_stub.directory import KeyDirectory
from helpers import python_lines
from blend_wire import (
    BlendNamespace,
    CacheEventBatch,
    CacheEventEntry,
    EncodedObjectKey,
    pack_kv_rank,
)

LANE = "unit"

C = 4
HASHES = ["a1", "a2", "a3", "a4", "a5", "a6"]
CONTENTS = [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)]
SPACES = [("m", "t0", 1, 0), ("m", "t1", 1, 0), ("m", "t0", 2, 0), ("m", "t0", 2, 1)]
INSTANCES = ["i0", "i1"]
TIERS = [("l1", "dram"), ("l2", "disk")]
GROUPS = [0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]


class Reference:
    """The lifecycle table, written the obvious way. `trust`: LMCache's shared rules (one
    content and offset per hash, whoever stored it); else each namespace's own, and while
    another instance holds a chunk in the namespace, its content and offset stand."""

    def __init__(self, blend_on: bool, trust: bool) -> None:
        self.blend_on = blend_on
        self.trust = trust
        self.places: dict[tuple, set] = {}  # (hash, model, salt, ws, rank) -> {(inst, tier)}
        # Per owner: the hash with `trust`, else (hash, namespace).
        self.content: dict = {}
        self.offset: dict = {}

    def _owner(self, h, space):
        return h if self.trust else (h, BlendNamespace(space[0], space[1], space[2]))

    def store(self, inst, tier, h, space, tokens, offset):
        # Only a STORE with usable tokens sets content and offset (-1 included); one
        # without (none, the wrong length, an id outside uint32) leaves both as they were.
        usable = self.blend_on and len(tokens) == C and all(0 <= t < 2**32 for t in tokens)
        owner = self._owner(h, space)
        if usable and not self.trust and self.content.get(owner) is not None and any(
                p[0] != inst for k, held in self.places.items()
                if self._owner(k[0], k[1:]) == owner for p in held):
            # Another instance holds the chunk in this namespace: its content stands.
            if self.content[owner] != tokens:
                return  # refused: nothing of the STORE is recorded
            if self.offset[owner] >= 0 and offset != self.offset[owner]:
                usable = False  # the same tokens elsewhere: as a STORE without tokens
        self.places.setdefault((h, *space), set()).add((inst, tier))
        if usable:
            self.content[owner] = tokens
            self.offset[owner] = offset

    def delete(self, inst, tier, h, space):
        held = self.places.get((h, *space), set())
        held.discard((inst, tier))
        self._forget_empty()

    def fence(self, inst):
        for held in self.places.values():
            for place in [p for p in held if p[0] == inst]:
                held.discard(place)
        self._forget_empty()

    def _forget_empty(self):
        self.places = {k: v for k, v in self.places.items() if v}
        live = {self._owner(k[0], k[1:]) for k in self.places}
        self.content = {o: c for o, c in self.content.items() if o in live}
        self.offset = {o: v for o, v in self.offset.items() if o in live}

    def claims_held(self) -> set:
        """(hash, namespace, content, offset) of every claim that is indexed."""
        found = set()
        for k in self.places:
            owner = self._owner(k[0], k[1:])
            if self.content.get(owner) is not None and self.offset.get(owner, -1) >= 0:
                found.add((k[0], BlendNamespace(k[1], k[2], k[3]), self.content[owner],
                           self.offset[owner]))
        return found

    def visible(self, namespace: BlendNamespace, tokens: tuple) -> set:
        return {(bytes.fromhex(h), offset) for h, ns, content, offset in self.claims_held()
                if ns == namespace and content == tokens}

    def occupants(self) -> set:
        return {(h, content) for h, _, content, _ in self.claims_held()}

    def claims(self) -> int:
        return len({(h, ns) for h, ns, _, _ in self.claims_held()})


def _batch(inst, incarnation, seq, kind, tier, entries) -> CacheEventBatch:
    return CacheEventBatch(instance_id=inst, incarnation=incarnation, seq=seq,
                           event_type=kind, tier=tier[0], backend=tier[1], entries=entries)


def _entry(h, space, tokens=(), offset=-1) -> CacheEventEntry:
    model, salt, ws, rank, *group = space
    key = EncodedObjectKey(chunk_hash_hex=h, model_name=model, cache_salt=salt,
                           kv_rank=pack_kv_rank(ws, rank), object_group_id=sum(group))
    return CacheEventEntry(key=key, token_ids=list(tokens), token_offset=offset)


@pytest.mark.parametrize("trust", [False, True], ids=["own-content", "trust-shared-hashes"])
@pytest.mark.parametrize("enable_at", [0, 60], ids=["on-from-start", "enabled-mid-life"])
@pytest.mark.parametrize("seed", range(8))
def test_index_is_the_derived_view_of_the_directory(seed, enable_at, trust):
    rng = random.Random(seed)
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=enable_at == 0,
                             trust_shared_hashes=trust)
    reference = Reference(blend_on=enable_at == 0, trust=trust)
    cursors = {inst: [0, 0] for inst in INSTANCES}  # incarnation, seq
    for step in range(400):
        if step == enable_at and step:
            directory.enable_blend_lookup()
            reference.blend_on = True
        inst = rng.choice(INSTANCES)
        cursor = cursors[inst]
        roll = rng.random()
        if roll < 0.05:  # restart: the next batch carries a higher incarnation
            cursor[0] += 1
            cursor[1] = 0
            reference.fence(inst)
        cursor[1] += 1
        tier = rng.choice(TIERS)
        # Object groups make keys of one hash many: past a few placements the directory
        # changes representation, and back again as they go.
        h, space = rng.choice(HASHES), rng.choice(SPACES) + (rng.choice(GROUPS),)
        if roll < 0.65:
            tokens = rng.choice([(), (), rng.choice(CONTENTS), rng.choice(CONTENTS)[:3],
                                 (1, 2, 3, 2**32)])
            offset = rng.choice([-1, 0, 4, 8])
            entries = [_entry(h, space, tokens, offset)]
            reference.store(inst, tier[0], h, space, tokens, offset)
            kind = "store"
        else:
            entries = [_entry(h, space)]
            reference.delete(inst, tier[0], h, space)
            kind = "delete"
        reply = directory.ingest([_batch(inst, cursor[0], cursor[1], kind, tier, entries)])
        assert reply.applied == 1
        _assert_agree(directory, reference, step)


def _assert_agree(directory: KeyDirectory, reference: Reference, step: int) -> None:
    for model, salt, ws, _ in SPACES:
        namespace = BlendNamespace(model, salt, ws)
        for tokens in CONTENTS:
            # The content once per hash: each occurrence names another of its chunks.
            query = np.array(tokens * len(HASHES), dtype=np.uint32)
            found = [(m.chunk_hash, m.old_st) for m in directory.match(query, namespace)]
            assert len(set(found)) == len(found), (step, namespace, tokens)
            assert set(found) == reference.visible(namespace, tokens), (step, namespace, tokens)
    stats = directory.stats()
    assert stats["num_keys"] == len(reference.places), step
    assert stats["num_placements"] == sum(map(len, reference.places.values())), step
    assert stats["blend"]["num_chunks"] == len(reference.occupants()), step
    assert stats["blend"]["num_claims"] == reference.claims(), step
    assert stats["blend"]["num_contents"] == len(
        {content for _, content in reference.occupants()}), step


def test_indexed_tokens_are_kept_once_and_fetched_back_when_claiming():
    # A token-less STORE claims another namespace's content only with shared hashes trusted.
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True, trust_shared_hashes=True)
    t0, t1 = SPACES[0], SPACES[1]
    directory.ingest([_batch("i0", 0, 1, "store", TIERS[0], [_entry("a1", t0, CONTENTS[0], 0)])])
    # The directory keeps a digest, not a second copy of the tokens the index holds.
    assert all(type(b[0]) is int for b in directory._bindings.table.values())
    directory.ingest([_batch("i0", 0, 2, "store", TIERS[0], [_entry("a1", t1, (), 0)])])
    found = directory.match(np.array(CONTENTS[0], dtype=np.uint32), BlendNamespace("m", "t1", 1))
    assert [(m.chunk_hash, m.old_st) for m in found] == [(bytes.fromhex("a1"), 0)]


def test_bindings_share_one_int_per_offset_value_and_the_sharing_is_bounded(monkeypatch):
    # A decoded offset is an int object of its own (28 B a chunk past 256); bindings keep
    # the one shared int of its value instead, within a bound.
    from coordinator_stub.directory import new_chunks

    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    offset = 1000
    for seq, tokens in enumerate(CONTENTS[:2], start=1):
        entries = [_entry(f"b{seq}", SPACES[0], tokens, offset + 0)]
        directory.ingest([_batch("i0", 0, seq, "store", TIERS[0], entries)])
    offsets = [binding[1] for binding in directory._bindings.table.values()]
    assert offsets == [1000, 1000] and offsets[0] is offsets[1]
    monkeypatch.setattr(new_chunks, "_MAX_SHARED_OFFSETS", 8)
    for value in range(100):
        new_chunks.shared_offset(10**6 + value)
        new_chunks.shared_offsets([2 * 10**6 + value])
    assert len(new_chunks._SHARED_OFFSETS) <= 9


# --- one chunk hash, many keys ---------------------------------------------------------------


def _store_groups(directory, groups, seq, salt="t0", tokens=CONTENTS[0], inst="i0",
                  kind="store"):
    entries = [_entry("a1", ("m", salt, 1, 0, g), tokens if kind == "store" else (), 0)
               for g in groups]
    reply = directory.ingest([_batch(inst, 0, seq, kind, TIERS[0], entries)])
    assert reply.applied == 1


def test_a_chunk_hash_with_many_keys_matches_until_its_namespaces_last_key_goes():
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    query = np.array(CONTENTS[0], dtype=np.uint32)
    t0, t1 = BlendNamespace("m", "t0", 1), BlendNamespace("m", "t1", 1)
    _store_groups(directory, range(100), seq=1, salt="t0")
    _store_groups(directory, range(50), seq=2, salt="t1")
    stats = directory.stats()
    assert (stats["num_keys"], stats["num_placements"]) == (150, 150)
    assert (stats["blend"]["num_chunks"], stats["blend"]["num_claims"]) == (1, 2)
    _store_groups(directory, range(99), seq=3, salt="t0", kind="delete")
    assert [m.old_st for m in directory.match(query, t0)] == [0]
    _store_groups(directory, [99], seq=4, salt="t0", kind="delete")
    assert directory.match(query, t0) == []
    assert [m.old_st for m in directory.match(query, t1)] == [0]
    _store_groups(directory, range(50), seq=5, salt="t1", kind="delete")
    stats = directory.stats()
    assert (stats["num_keys"], stats["num_placements"], stats["num_bindings"]) == (0, 0, 0)
    assert stats["blend"]["num_chunks"] == 0


def test_fencing_an_instance_drops_its_many_keys_of_one_hash_and_keeps_the_others():
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    _store_groups(directory, range(40), seq=1, inst="i0")
    _store_groups(directory, range(30, 60), seq=1, inst="i1")
    restart = _entry("a2", SPACES[0], CONTENTS[1], 0)
    directory.ingest([_batch("i0", 1, 1, "store", TIERS[0], [restart])])
    stats = directory.stats()
    assert (stats["num_keys"], stats["num_placements"]) == (31, 31)
    found = directory.match(np.array(CONTENTS[0], dtype=np.uint32), BlendNamespace("m", "t0", 1))
    assert [m.chunk_hash for m in found] == [bytes.fromhex("a1")]




@pytest.mark.parametrize("blend", [True, False], ids=["blend-on", "blend-off"])
def test_storing_accessing_and_deleting_n_keys_of_one_hash_is_linear_work(blend):
    work = {}
    for n in (250, 2000):
        directory = KeyDirectory(chunk_size=C, enable_blend_lookup=blend)
        stored = python_lines(lambda: _store_groups(directory, range(n), seq=1))
        accessed = python_lines(lambda: _store_groups(directory, range(n), seq=2,
                                                       kind="access"))
        deleted = python_lines(lambda: _store_groups(directory, range(n), seq=3,
                                                      kind="delete"))
        assert directory.stats()["num_keys"] == 0
        work[n] = (stored, accessed, deleted)
    for step in range(3):  # linear: 8x; quadratic: 64x
        assert work[2000][step] < 9 * work[250][step], (step, work)


def test_access_counts_of_many_keys_of_one_hash_survive_until_their_key_goes():
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    _store_groups(directory, range(30), seq=1)
    _store_groups(directory, range(30), seq=2, kind="access")
    _store_groups(directory, range(0, 30, 3), seq=3, kind="access")
    _store_groups(directory, range(0, 30, 2), seq=4, kind="delete")

    def counts() -> list[int]:
        keys = [(bytes.fromhex("a1"), ("m", "t0", pack_kv_rank(1, 0), g)) for g in range(30)]
        return [count for _, _, count in directory.placements_of(keys)]

    assert counts() == [0 if g % 2 == 0 else 1 + (g % 3 == 0) for g in range(30)]
    _store_groups(directory, range(0, 30, 2), seq=5)  # stored again: counting anew
    assert counts() == [0 if g % 2 == 0 else 1 + (g % 3 == 0) for g in range(30)]
    _store_groups(directory, range(1, 30, 2), seq=6, kind="delete")
    _store_groups(directory, [2], seq=7, kind="access")
    assert counts() == [int(g == 2) for g in range(30)]
