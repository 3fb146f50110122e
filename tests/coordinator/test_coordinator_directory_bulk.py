"""Runs of a STORE batch's entries that name chunks new to the directory are recorded in bulk
(`new_chunks.py`), and the index claims new chunk hashes in bulk (`ClaimLists.claim_new`);
the rest goes entry by entry (`Bindings._store`) and chunk by chunk (`claim_all`). The two
must agree exactly: random histories (batches mixing keys, sizes, token lengths, known and
repeated hashes, content known under new hashes) are applied to a directory as it runs and
to one that takes every entry and every claim one by one, and after each batch everything
either reports, and everything it holds, must be the same. A failure while a bulk batch is
applied leaves nothing of it.
"""

from __future__ import annotations

import pickle
import random

import msgspec
import numpy as np
import pytest

from blend_wire import (
    BlendNamespace,
    CacheEventBatch,
    CacheEventEntry,
    EncodedObjectKey,
    decode,
    encode,
    pack_kv_rank,
)
from coordinator_stub.directory import KeyDirectory, bindings, new_chunks
from coordinator_stub.directory.writer import IndexWriter
from local_matcher import ContentIndex
from helpers import claim_one_by_one, held_view, slot_chunks
from local_matcher.claims import ClaimLists

LANE = "unit"

C = 4
CONTENTS = [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12), (1, 2, 3, 4)]
SPACES = [("m", "t0", 1, 0, 0), ("m", "t1", 1, 0, 0), ("m", "t0", 2, 1, 0),
          ("m", "t0", 1, 0, 3)]
INSTANCES = ["i0", "i1"]
TIERS = [("l1", "dram", False), ("l2", "disk", False), ("l2", "s3", True)]
NAMESPACES = sorted({BlendNamespace(m, s, ws) for m, s, ws, _, _ in SPACES})


class _EntryByEntry:
    """While in use, every batch takes the entry-by-entry path, and the index claims chunk
    by chunk."""

    def __enter__(self):
        self.runs, self.claim_new = new_chunks.store_runs, ClaimLists.claim_new
        new_chunks.store_runs = lambda entries, *args: [(0, len(entries), False)]
        ClaimLists.claim_new = claim_one_by_one

    def __exit__(self, *exc):
        new_chunks.store_runs, ClaimLists.claim_new = self.runs, self.claim_new


class _Counted:
    """While in use, counts the batches split into several runs, the runs the bulk path
    took, and the bulk claims in the index on content held before."""

    def __init__(self):
        self.mixed = self.runs = self.joined = 0

    def __enter__(self):
        self.split, self.claim_new = split, claim_new = new_chunks.store_runs, \
            ClaimLists.claim_new

        def counted(*args):
            runs = split(*args)
            self.mixed += len(runs) > 1
            self.runs += sum(bulk for _, _, bulk in runs)
            return runs

        def claimed(claims, hashes, cids, offsets, namespaces, fresh):
            self.joined += not fresh.all()
            return claim_new(claims, hashes, cids, offsets, namespaces, fresh)

        new_chunks.store_runs, ClaimLists.claim_new = counted, claimed
        return self

    def __exit__(self, *exc):
        new_chunks.store_runs, ClaimLists.claim_new = self.split, self.claim_new


def _entry(rng: random.Random, h: str, space, length: int, offset: int) -> CacheEventEntry:
    model, salt, ws, rank, group = space
    key = EncodedObjectKey(chunk_hash_hex=h, model_name=model, cache_salt=salt,
                           kv_rank=pack_kv_rank(ws, rank), object_group_id=group)
    if length == C:
        tokens = list(rng.choice(CONTENTS)) if rng.random() < 0.5 else [
            rng.randrange(6) for _ in range(C)]
    else:
        tokens = [rng.randrange(2**32 + 2) for _ in range(length)]  # may be outside uint32
    return CacheEventEntry(key=key, token_ids=tokens, token_offset=offset,
                           size_bytes=rng.choice([0, 100, 100, 100, 7]))


def _store_entries(rng: random.Random, fresh: list[str], known: list[str]) -> list:
    """What a reporter sends: runs of entries of one key, size and token length (a request's
    chunks), mostly new hashes, some known or repeated in the batch, with one thing in a
    run now and then that takes it off the bulk path."""
    entries: list[CacheEventEntry] = []
    for _ in range(rng.choice([1, 1, 2, 3, 4])):
        entries += _run(rng, fresh, known + [e.key.chunk_hash_hex for e in entries])
    for entry in entries:
        known.append(entry.key.chunk_hash_hex)
    return entries


def _run(rng: random.Random, fresh: list[str], known: list[str]) -> list:
    space = rng.choice(SPACES)
    length = rng.choice([C, C, C, C, 0, 3])
    size = rng.choice([0, 100])
    entries = []
    for _ in range(rng.randint(1, 6)):
        h = fresh.pop() if rng.random() < 0.8 or not known else rng.choice(known)
        entry = _entry(rng, h, space, length, rng.choice([0, 4, 8, 8, 12, -1]))
        entry.size_bytes = size
        entries.append(entry)
    spoil = rng.random()
    if spoil < 0.06:
        entries[-1].key = EncodedObjectKey(**{**msgspec.structs.asdict(entries[-1].key),
                                              "cache_salt": "t9"})
    elif spoil < 0.12:
        entries[-1].size_bytes += 1
    elif spoil < 0.18 and len(entries) > 1:
        entries[-1].key = entries[0].key  # a hash twice in the batch
    elif spoil < 0.22 and length == C:
        entries[-1].token_ids = [2**32] * C  # an id outside uint32
    return entries


def _history(seed: int, steps: int):
    """Random batches: (batch, before) where `before` names an act between batches."""
    rng = random.Random(seed)
    fresh = [f"{i:0{rng.choice([4, 4, 6])}x}" for i in range(1, 4000)]
    rng.shuffle(fresh)
    known: list[str] = []
    cursors = {inst: [0, 0] for inst in INSTANCES}
    for _ in range(steps):
        inst = rng.choice(INSTANCES)
        cursor = cursors[inst]
        roll = rng.random()
        if roll < 0.04:  # a restart: fenced by its next batch
            cursor[0], cursor[1] = cursor[0] + 1, 0
        cursor[1] += 1
        act = "drop" if roll > 0.98 else None
        tier, backend, shared = rng.choice(TIERS)
        if roll < 0.7 or not known:
            kind, entries = "store", _store_entries(rng, fresh, known)
        else:
            kind = "delete" if roll < 0.88 else "access"
            entries = [_entry(rng, h, rng.choice(SPACES), 0, -1)
                       for h in rng.sample(known, min(len(known), rng.randint(1, 4)))]
        batch = CacheEventBatch(instance_id=inst, incarnation=cursor[0], seq=cursor[1],
                                event_type=kind, tier=tier, backend=backend, shared=shared,
                                entries=entries)
        if rng.random() < 0.5:  # as decoded from a body: token lists are views of one array
            batch = decode(encode(batch), CacheEventBatch)
        yield batch, act


def _plain(binding: tuple) -> tuple:
    content, offset, holds = binding[:3]
    if isinstance(content, dict):
        content = dict(content)
    if type(holds) is not tuple:
        holds = (dict(holds.places), dict(holds.keys_in), dict(holds.placements_of),
                 holds.count)
    accesses = binding[3] if type(binding[3]) is tuple else dict(binding[3])
    return (content, offset, holds, accesses, binding[4])


def _copied(value):
    """A copy of a value made of dicts, lists and sets (a state taken now stays as it is)."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    return set(value) if isinstance(value, set) else value


def _state(directory: KeyDirectory, ordered: bool = True) -> dict:
    """Everything the directory reports, and everything it holds, comparably; not
    `ordered`: whatever the order chunks were stored in (a rolled-back batch puts the
    chunks it removed back last)."""
    stats = directory.stats()
    for stream in stats["ingest_streams"].values():
        del stream["last_event_time"]  # the clock's, when each applied its batch
    del stats["blend_bytes"]  # an estimate: what lists over-allocated differs by how grown
    placements = directory._placements
    held = {name: _copied(value) for name, value in vars(placements).items()
            if name != "_journal"}
    table = directory._bindings.table
    if not ordered:
        table = dict(sorted(table.items()))
    keys = [(h, raw) for h, b in table.items()
            for raw in {placements.key_raw[k] for k in (b[2][0::2] if type(b[2]) is tuple
                                                         else b[2].places)}]
    query = np.array([t for content in CONTENTS for t in content] * 3, dtype=np.uint32)
    found = {}
    for namespace in NAMESPACES:
        found[namespace] = ([tuple(m) for m in directory.match(query, namespace)],
                            [tuple(c) for c in directory.candidates(query, namespace)],
                            directory.places_of(list(table), namespace))
    state = {"stats": stats, "placements": held, "found": found,
             "bindings": {h: _plain(b) for h, b in table.items()},
             "held_by": held_view(directory),
             "placements_of": directory.placements_of(keys),
             "list_keys": directory.list_keys("all", "", "", 0, 10_000)}
    if not ordered:
        state["list_keys"] = (state["list_keys"][0], sorted(state["list_keys"][1]))
    index = directory._index
    if index is not None:
        claims = index._claims
        state["claims"] = (claims.chunks.items(), slot_chunks(claims),
                           *(bytes(a) for a in (claims.slot_ns, claims.slot_cid,
                                                claims.slot_offset, claims._slot_order,
                                                claims.next_slot, claims._prev, claims.head,
                                                claims.num_chunks, claims._free_slots)),
                           dict(claims.other_heads.items()), dict(claims.ns_ids),
                           claims.num_occupants, claims._next_order,
                           index._store.ns_mask.tobytes())
    return state


@pytest.mark.parametrize("trust", [False, True], ids=["own-content", "trust-shared-hashes"])
@pytest.mark.parametrize("blend", [True, False], ids=["blend-on", "blend-off"])
@pytest.mark.parametrize("seed", range(6))
def test_bulk_and_entry_by_entry_agree(seed, blend, trust):
    bulk = KeyDirectory(chunk_size=C, enable_blend_lookup=blend, trust_shared_hashes=trust)
    each = KeyDirectory(chunk_size=C, enable_blend_lookup=blend, trust_shared_hashes=trust)
    with _Counted() as counted:
        for step, (batch, act) in enumerate(_history(seed, 150)):
            if act == "drop":
                bulk.drop_instance(batch.instance_id)
                each.drop_instance(batch.instance_id)
                bulk.readmit(batch.instance_id)
                each.readmit(batch.instance_id)
            copy = pickle.loads(pickle.dumps(batch))
            reply = bulk.ingest([batch])
            with _EntryByEntry():
                assert each.ingest([copy]) == reply
            assert _state(bulk) == _state(each), step
    # The bulk paths were taken, and often: mixed batches, claims on known content.
    assert counted.runs > 100 and counted.mixed > 40
    assert counted.joined > (10 if blend else -1)


# --- all or nothing --------------------------------------------------------------------------


def _bulk_batch(names: list[str], seq: int, incarnation: int = 0, salt: str = "t0",
                first_content: int = 0) -> CacheEventBatch:
    entries = [CacheEventEntry(
        key=EncodedObjectKey(chunk_hash_hex=name, model_name="m", cache_salt=salt,
                             kv_rank=pack_kv_rank(1)),
        token_ids=list(CONTENTS[(first_content + i) % 3]), token_offset=4 * i,
        size_bytes=100) for i, name in enumerate(names)]
    return CacheEventBatch(instance_id="i0", incarnation=incarnation, seq=seq,
                           event_type="store", tier="l1", backend="dram", entries=entries)


class _Boom(RuntimeError):
    pass


def test_a_failure_after_the_bulk_records_changes_nothing_and_a_retry_applies(monkeypatch):
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    directory.ingest([_bulk_batch(["a1", "a2"], seq=1)])
    before = _state(directory)
    real = IndexWriter.add_rows

    def fail(*args):  # the bindings, placements and the emitter's set are written by now
        raise _Boom("injected")

    monkeypatch.setattr(IndexWriter, "add_rows", fail)
    with pytest.raises(_Boom):
        directory.ingest([_bulk_batch(["b1", "b2", "b3"], seq=2)])
    assert _state(directory) == before
    monkeypatch.setattr(IndexWriter, "add_rows", real)
    assert directory.ingest([_bulk_batch(["b1", "b2", "b3"], seq=2)]).applied == 1
    assert directory.stats()["num_keys"] == 5


def test_a_failure_in_the_index_after_a_fence_puts_the_index_back(monkeypatch):
    """A restart fences first (its removals reach the index), then the bulk adds fail in
    the index: the fenced chunks are indexed again, and a retry applies."""
    directory = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    directory.ingest([_bulk_batch(["a1", "a2"], seq=1)])
    before = _reported(directory)
    real = ContentIndex.add_many

    def fail_once(self, *args, **kwargs):
        monkeypatch.setattr(ContentIndex, "add_many", real)
        raise _Boom("injected in the index")

    monkeypatch.setattr(ContentIndex, "add_many", fail_once)
    with pytest.raises(_Boom):
        directory.ingest([_bulk_batch(["b1", "b2"], seq=1, incarnation=1, first_content=1)])
    assert _reported(directory) == before  # re-indexed: other slots
    assert directory.ingest([_bulk_batch(["b1", "b2"], seq=1, incarnation=1,
                                         first_content=1)]).applied == 1
    assert sorted(directory._bindings.table) == [bytes.fromhex("b1"), bytes.fromhex("b2")]


# --- the writer's blocks ---------------------------------------------------------------------


def test_rows_queued_as_a_block_are_answered_and_sent_as_one_by_one_adds_are():
    t0, t1 = NAMESPACES[0], NAMESPACES[1]
    a, b, c = (np.array(content, dtype=np.uint32) for content in CONTENTS[:3])
    indexes = []
    for in_blocks in (True, False):
        writer = IndexWriter(ContentIndex(C), C)
        writer.add(a.tobytes(), b"h1", 0, t0)
        if in_blocks:
            writer.add_rows(np.stack([b, c]), [b"h1", b"h2"], np.array([4, 8]), t0)
        else:
            writer.add(b.tobytes(), b"h1", 4, t0)
            writer.add(c.tobytes(), b"h2", 8, t0)
        assert writer.tokens_of(b"h1", t0) == b.tobytes()  # as the index will answer
        assert writer.tokens_of(b"h2") == c.tobytes()
        assert writer.tokens_of(b"h2", t1) is None
        writer.remove_chunk(b"h2")
        assert writer.tokens_of(b"h2") is None
        if in_blocks:
            writer.add_rows(a.reshape(1, C), [b"h3"], np.array([12]), t1)
        else:
            writer.add(a.tobytes(), b"h3", 12, t1)
        calls = []
        writer.index.add_many = lambda *args, _real=writer.index.add_many: (
            calls.append(len(args[1])), _real(*args))
        writer.flush()
        assert calls == [3, 1]  # a run of adds, blocks or not, as one call
        indexes.append(writer.index)
    query = np.concatenate([a, b, c])
    for namespace in (t0, t1):
        assert indexes[0].match(query, namespace) == indexes[1].match(query, namespace)
    stats = [index.stats() for index in indexes]
    for figures in stats:
        del figures["bytes"]  # an estimate: what lists and arrays over-allocated differs
    assert stats[0] == stats[1]
    assert [tuple(m) for m in indexes[0].match(query, t1)] == [(b"h3", 12, 0)]


@pytest.mark.parametrize("seed", range(4))
def test_a_mixed_batch_failing_anywhere_changes_nothing_and_a_retry_applies(seed, monkeypatch):
    """Batches of several runs fail at a random step (a run recorded in bulk, an entry
    stored alone, a block queued for the index): nothing of them is left, and applied
    again they leave what the entry-by-entry directory holds."""
    rng = random.Random(seed)
    bulk = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    each = KeyDirectory(chunk_size=C, enable_blend_lookup=True)
    failed = 0
    for batch, act in _history(seed, 120):
        if act == "drop":
            continue
        with _EntryByEntry():
            reply = each.ingest([pickle.loads(pickle.dumps(batch))])
        if batch.event_type == "store" and len(new_chunks.store_runs(
                batch.entries, new_chunks.chunk_hashes(batch.entries), bulk._bindings.table,
                bulk._bindings.writer)) > 1:
            before = _reported(bulk)
            if not _fail_at_some_step(rng, monkeypatch, lambda: bulk.ingest(
                    [pickle.loads(pickle.dumps(batch))])):
                continue  # it had fewer such steps: applied
            assert _reported(bulk) == before
            failed += 1
        assert bulk.ingest([batch]) == reply
        assert _reported(bulk) == _reported(each)
    assert failed > 10


def _reported(directory: KeyDirectory) -> dict:
    """What `_state` holds but by name, not number: a rolled-back batch frees the key and
    place numbers it took (a retry may take them in another order), and leaves sets it
    restored iterating in another order, so a later fence may free index slots in another
    order. Every answer and every binding is compared."""
    state = _state(directory, ordered=False)
    placements = directory._placements
    keys, places = placements.key_raw, placements.places

    def named(binding: tuple) -> tuple:
        content, offset, holds, accesses, reported = _plain(binding)
        pairs = (zip(holds[0::2], holds[1::2]) if type(holds) is tuple
                 else ((k, p) for k, held in holds[0].items() for p in held))
        counts = (dict(zip(accesses[0::2], accesses[1::2])) if type(accesses) is tuple
                  else accesses)
        return (content, offset, sorted((keys[k], places[p]) for k, p in pairs),
                {keys[k]: n for k, n in counts.items()}, reported)

    state["bindings"] = {h: named(b) for h, b in directory._bindings.table.items()}
    state["placements"] = {name: state["placements"][name] for name in (
        "num_keys", "num_placements", "tier_totals", "l1_by_instance")}
    del state["claims"]
    return state


def _fail_at_some_step(rng: random.Random, monkeypatch, ingest) -> bool:
    """Run `ingest` with one of the steps of a batch failing at a random call; whether
    it failed (a batch with fewer such calls applies)."""
    owner, name = rng.choice([(new_chunks, "store_new_chunks"), (bindings.Bindings, "_store"),
                              (IndexWriter, "add_rows")])
    real, calls, fail_at = getattr(owner, name), [0], rng.randint(1, 3)

    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == fail_at:
            raise _Boom("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, step)
    try:
        ingest()
    except _Boom:
        return True
    finally:
        monkeypatch.setattr(owner, name, real)
    return False
