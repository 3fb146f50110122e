"""The directory's frozen bindings (coordinator_stub/directory/binding_table.py): the common
binding costs no Python object per chunk, yet the table answers as the dict it replaces,
in the same order, through thaws, rollbacks, reused index slots and snapshots."""

from __future__ import annotations

import pickle
import random
import threading
from unittest import mock

import numpy as np
import pytest

from blend_wire import BlendNamespace, CacheEventBatch, CacheEventEntry, EncodedObjectKey, \
    pack_kv_rank
from coordinator_stub.directory import KeyDirectory, binding_table

LANE = "unit"

C = 4
NS = BlendNamespace("m", "", 1)


def _entry(hex_hash: str, tokens, offset: int = 0, salt: str = "") -> CacheEventEntry:
    key = EncodedObjectKey(chunk_hash_hex=hex_hash, model_name="m", cache_salt=salt,
                           kv_rank=pack_kv_rank(1, 0, 0), object_group_id=0)
    return CacheEventEntry(key=key, token_ids=list(tokens), token_offset=offset,
                           size_bytes=0)


def _store(directory: KeyDirectory, seq: int, entries, instance: str = "i0", kind="store",
           tier: str = "l1"):
    batch = CacheEventBatch(instance_id=instance, incarnation=0, seq=seq, event_type=kind,
                            tier=tier, backend="dram", entries=entries)
    return directory.ingest([batch])


def _chunks(count: int, first: int = 0) -> list[CacheEventEntry]:
    return [_entry(f"{i:064x}", range(C * i + 1, C * i + C + 1), offset=C * (i % 8))
            for i in range(first, first + count)]


def _as_dict(directory: KeyDirectory) -> list:
    return [(h, directory._bindings.table[h]) for h in directory._bindings.table]


def test_a_stored_run_leaves_no_python_record_per_chunk_and_reads_as_before():
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    _store(directory, 1, _chunks(1000))
    table = directory._bindings.table
    assert len(table.hot) == 0 and len(table.order) == 0 and table.num_frozen == 1000
    assert len(table) == 1000
    binding = table[bytes.fromhex(f"{7:064x}")]
    assert binding[1:] == (C * 7, (0, 0), (), None) and type(binding[0]) is int
    query = np.arange(1, C * 5 + 1, dtype=np.uint32)
    assert [m.chunk_hash for m in directory.match(query, NS)] == [
        bytes.fromhex(f"{i:064x}") for i in range(5)]
    assert directory.places_of([bytes.fromhex(f"{3:064x}")], NS) == [(["i0"], False)]


def test_order_is_creation_order_through_freezes_thaws_and_deletes():
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    _store(directory, 1, _chunks(6))
    # A second key on chunk 2 thaws it (two placements); chunk 4 is deleted and stored
    # again: it goes last, as in a dict.
    _store(directory, 2, [_chunks(6)[2]], tier="l2")
    _store(directory, 3, [_chunks(6)[4]], kind="delete")
    _store(directory, 4, [_chunks(6)[4]])
    order = [h for h, _ in _as_dict(directory)]
    assert order == [bytes.fromhex(f"{i:064x}") for i in (0, 1, 2, 3, 5, 4)]
    total, page = directory.list_keys("all", "", "", 0, 100)
    assert [row[0] for row in page] == order and len(page[2][2]) == 2


def test_a_failed_batch_leaves_the_bindings_it_thawed_as_they_were(monkeypatch):
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    _store(directory, 1, _chunks(20))
    before = _as_dict(directory)
    writer = directory._bindings.writer

    def fail():
        raise RuntimeError("injected")

    monkeypatch.setattr(writer, "flush", fail)
    # Moves five chunks elsewhere (thawing them), then fails: nothing of it stays.
    moved = [_entry(f"{i:064x}", range(C * i + 1, C * i + C + 1), offset=999)
             for i in range(5)]
    with pytest.raises(RuntimeError):
        _store(directory, 2, moved)
    monkeypatch.undo()
    assert _as_dict(directory) == before
    _store(directory, 2, moved)  # and the batch applies when it works
    assert directory._bindings.table[bytes.fromhex(f"{0:064x}")][1] == 999


def test_a_slot_the_index_gave_to_another_chunk_is_not_read_as_frozen():
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    _store(directory, 1, _chunks(3))
    table = directory._bindings.table
    gone = bytes.fromhex(f"{1:064x}")
    slot = directory._index.only_claim_slots([gone])[0]
    _store(directory, 2, [_chunks(3)[1]], kind="delete")
    assert gone not in table and table.num_frozen == 2
    # The freed slot goes to the next new claim, which is not frozen until its batch
    # commits; what the old chunk left in the columns is never its.
    _store(directory, 3, _chunks(1, first=10))
    new = bytes.fromhex(f"{10:064x}")
    assert directory._index.only_claim_slots([new])[0] == slot
    assert gone not in table and table[new][1] == C * 2


def test_readers_without_the_lock_never_miss_a_binding_moving_between_places():
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    entries = _chunks(200)
    _store(directory, 1, entries)
    hashes = [bytes.fromhex(e.key.chunk_hash_hex) for e in entries]
    misses, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            misses.extend(h for h, (l1, _) in zip(hashes, directory.places_of(hashes, NS))
                          if not l1)

    reader = threading.Thread(target=read)
    reader.start()
    try:  # each batch thaws what it re-stores; each commit freezes it again
        for seq in range(2, 40):
            _store(directory, seq, entries[seq % 5::5])
    finally:
        stop.set()
        reader.join()
    assert misses == []


def test_a_snapshot_keeps_frozen_bindings_and_a_new_index_thaws_them():
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    _store(directory, 1, _chunks(50))
    loaded = pickle.loads(pickle.dumps(directory))
    assert loaded._bindings.table.num_frozen == 50
    assert _as_dict(loaded) == _as_dict(directory)
    assert loaded._bindings.table.index is loaded._index
    # Another chunk size: every binding leaves the index (and the columns keyed by it).
    assert loaded.bind_chunk_size(2 * C)
    table = loaded._bindings.table
    assert table.num_frozen == 0 and len(table) == 50
    assert all(binding[0] is None for _, binding in _as_dict(loaded))


def test_a_run_chunk_left_in_the_dict_keeps_its_place_and_one_stored_again_goes_last():
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    _store(directory, 1, _chunks(2))
    # One batch: chunks 2..4 as a run; chunk 5 without a position (stays in the dict).
    entries = _chunks(3, first=2) + [_entry(f"{5:064x}", range(100, 100 + C), offset=-1)]
    _store(directory, 2, entries)
    _store(directory, 3, [_chunks(1, first=3)[0]], kind="delete")
    _store(directory, 4, _chunks(1, first=3))
    table = directory._bindings.table
    assert table.num_frozen == 5 and len(table.hot) == 1
    assert [h for h, _ in _as_dict(directory)] == [
        bytes.fromhex(f"{i:064x}") for i in (0, 1, 2, 4, 5, 3)]
    assert table[bytes.fromhex(f"{5:064x}")][1] == -1


def test_accesses_count_in_the_columns_and_a_failed_batch_takes_its_counts_back(monkeypatch):
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    _store(directory, 1, _chunks(10))
    table = directory._bindings.table
    for seq in (2, 3):
        _store(directory, seq, _chunks(10)[:4], kind="access")
    assert table.num_frozen == 10 and len(table.hot) == 0  # counted where they are
    assert table[bytes.fromhex(f"{1:064x}")][3] == (0, 2)
    assert table[bytes.fromhex(f"{7:064x}")][3] == ()
    keys = [(bytes.fromhex(f"{i:064x}"), ("m", "", pack_kv_rank(1, 0, 0), 0)) for i in (1, 7)]
    assert [count for _, _, count in directory.placements_of(keys)] == [2, 0]
    before = _as_dict(directory)

    def fail():
        raise RuntimeError("injected")

    monkeypatch.setattr(directory._bindings.writer, "flush", fail)
    with pytest.raises(RuntimeError):
        _store(directory, 4, _chunks(10), kind="access")
    monkeypatch.undo()
    assert _as_dict(directory) == before


def test_a_lookup_naming_slots_past_the_columns_reads_the_dict():
    # Frozen bindings size the columns; chunks two tenants claim stay in the dict, at
    # claim slots past the columns' end: a lookup finding both kinds reads each right.
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    tenant = BlendNamespace("m", "t", 1)
    own = [_entry(e.key.chunk_hash_hex, e.token_ids, e.token_offset, salt="t")
           for e in _chunks(10)]
    _store(directory, 1, own)
    shared = _chunks(1200, first=100)
    _store(directory, 2, shared)
    _store(directory, 3, [_entry(e.key.chunk_hash_hex, e.token_ids, e.token_offset, salt="t")
                          for e in shared])
    table = directory._bindings.table
    assert table.num_frozen == 10
    query = np.array([t for e in own[:5] + shared[-20:] for t in e.token_ids],
                     dtype=np.uint32)
    found = directory.candidate_columns(query, tenant)
    assert len(found.chunk_hashes) == 25
    assert int(found.slots.max()) >= len(table.f_frozen)  # the tenant's later claims
    places = directory.place_columns(found.chunk_hashes, tenant, found.slots)
    assert all(places.l1_of(i) == ["i0"] for i in range(25))
    assert directory.places_of(list(found.chunk_hashes), tenant) == [(["i0"], False)] * 25


def test_frozen_chunks_cost_their_instance_no_set_entry_and_a_fence_still_drops_them():
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    _store(directory, 1, _chunks(300))
    bindings = directory._bindings
    assert bindings.held_by["i0"] == set() and bindings.table.frozen_of == {"i0": 300}
    assert directory.tracks("i0")
    _store(directory, 2, [_chunks(300)[5]], kind="delete")  # a frozen chunk's DELETE
    assert bytes.fromhex(f"{5:064x}") not in bindings.table
    assert bindings.table.frozen_of == {"i0": 299} and not bindings.held_by.get("i0")
    assert directory.tracks("i0")  # it holds frozen ones
    # A restart (the next incarnation's first batch) fences everything the last one held.
    batch = CacheEventBatch(instance_id="i0", incarnation=1, seq=1, event_type="store",
                            tier="l1", backend="dram", entries=_chunks(1, first=1000))
    directory.ingest([batch])
    assert len(bindings.table) == 1 and bindings.table.frozen_of == {"i0": 1}
    query = np.arange(1, C * 5 + 1, dtype=np.uint32)
    assert directory.match(query, NS) == []


def test_a_frozen_bindings_offset_is_its_claims_and_may_pass_2_31():
    # The columns keep no offset: a frozen binding reads its claim's, any size it has.
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    far = [_entry(f"{i:064x}", range(C * i + 1, C * i + C + 1), offset=2**40 + C * i)
           for i in range(3)]
    _store(directory, 1, far)
    table = directory._bindings.table
    assert table.num_frozen == 3 and not hasattr(table, "f_offset")
    assert [binding[1] for _, binding in _as_dict(directory)] == [2**40 + C * i
                                                                   for i in range(3)]
    query = np.arange(1, C * 3 + 1, dtype=np.uint32)
    assert [m.old_st for m in directory.match(query, NS)] == [2**40 + C * i for i in range(3)]


def test_a_binding_whose_claim_is_elsewhere_stays_in_the_dict():
    # Only an index out of step with the directory (a failed repair) holds a claim at
    # another offset than its binding says: that binding is not frozen, and reads as it is.
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    entries = _chunks(3)
    _store(directory, 1, entries)
    _store(directory, 2, [entries[1]], tier="l2")  # a second place: in the dict
    table, chunk = directory._bindings.table, bytes.fromhex(f"{1:064x}")
    assert chunk in table.hot
    directory._index.add(np.array(entries[1].token_ids, dtype=np.uint32), chunk, 999, NS)
    _store(directory, 3, [entries[1]], kind="delete", tier="l2")  # one place again
    assert chunk in table.hot and table.num_frozen == 2
    assert table[chunk][1] == C and [h for h, _ in _as_dict(directory)] == [
        bytes.fromhex(f"{i:064x}") for i in range(3)]
    assert directory._bindings.held_by["i0"] == {chunk}


def test_a_run_chunk_whose_claim_is_elsewhere_stays_in_the_dict_in_its_place(monkeypatch):
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    index = directory._index
    real = index.claim_offsets

    def claim_offsets(slots):  # slot 2's claim reads as elsewhere
        offsets = real(slots)
        offsets[slots == 2] += 1
        return offsets

    monkeypatch.setattr(index, "claim_offsets", claim_offsets)
    _store(directory, 1, _chunks(4))  # one run: slots 0..3
    table, odd = directory._bindings.table, bytes.fromhex(f"{2:064x}")
    assert index.only_claim_slots([odd]) == [2]
    assert table.num_frozen == 3 and list(table.hot) == [odd] and table.order[odd] == 2
    assert directory._bindings.held_by["i0"] == {odd}
    _store(directory, 2, _chunks(2, first=4))
    assert [h for h, _ in _as_dict(directory)] == [bytes.fromhex(f"{i:064x}")
                                                   for i in range(6)]
    assert table[odd][1] == C * 2


def _history(seed: int, count: int) -> list[tuple]:
    """Random batches over 24 chunks, mostly one instance, tier and tenant (so chunks come
    and go): runs of new chunks (frozen), chunks stored again elsewhere or by a second
    tenant or tier (hot), deletes, accesses, and batches whose index flush fails (rolled
    back)."""
    rng = random.Random(seed)
    batches = []
    for _ in range(count):
        kind = rng.choices(["store", "delete", "access"], weights=[5, 4, 1])[0]
        entries = []
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(24)
            offset = rng.choice([C * (i % 8)] * 4 + [C * rng.randrange(8), -1])
            entries.append(_entry(f"{i:064x}", range(C * i + 1, C * i + C + 1), offset,
                                  salt="t" if rng.random() < 0.1 else ""))
        batches.append(("i1" if rng.random() < 0.15 else "i0",
                        "l2" if rng.random() < 0.1 else "l1", kind, entries,
                        rng.random() < 0.15))
    return batches


def _run_history(history: list[tuple]) -> tuple[list, int, int]:
    """What the table says after each batch (its bindings in order, the key listing, how
    many are frozen); how many batches began with a renumbering, and how many of those
    then failed."""
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    table = directory._bindings.table
    seen, renumbered, failed = [], 0, 0
    for seq, (instance, tier, kind, entries, fail) in enumerate(history, 1):
        before = table.next_order
        if fail:
            with mock.patch.object(directory._bindings.writer, "flush",
                                   side_effect=RuntimeError("injected")):
                with pytest.raises(RuntimeError):
                    _store(directory, seq, entries, instance, kind, tier)
        else:
            _store(directory, seq, entries, instance, kind, tier)
        assert table.next_order <= binding_table._MAX_ORDER
        renumbered += table.next_order < before
        failed += fail and table.next_order < before
        seen.append((_as_dict(directory), directory.list_keys("all", "", "", 0, 1000),
                     table.num_frozen))
    return seen, renumbered, failed


def test_renumbering_creation_numbers_changes_no_order_through_rollbacks(monkeypatch):
    for seed in range(3):
        history = _history(seed, 300)
        plain, none, _ = _run_history(history)
        # At most 24 bindings and 8 entries a batch: room is left after each renumbering.
        monkeypatch.setattr(binding_table, "_MAX_ORDER", 32)
        wrapped, renumbered, failed = _run_history(history)
        monkeypatch.undo()
        # Renumbered often, once at least as a batch began that was then rolled back.
        assert none == 0 and renumbered >= 5 and failed >= 1
        assert any(frozen and len(bindings) > frozen for bindings, _, frozen in plain)
        for step, (expected, got) in enumerate(zip(plain, wrapped)):
            assert got == expected, (seed, step)
