"""ChunkHashes (local_matcher.chunk_hashes) against a dict: random claims, removals and
reads, over chunk hashes crowded onto a few homes of the table (long clusters, so every
removal shifts entries back), mixed with hashes of other lengths and types (the column's
width is the first hash's that can be one)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from local_matcher.chunk_hashes import EMPTY, ChunkHashes, HashRows, _home, hash_block

LANE = "unit"
SALT = np.uint64(0x1234_5678_9ABC_DEF1)
SLOTS = 64


def _crowded_hashes(count: int, width: int) -> list[bytes]:
    """Hashes of `width` bytes whose homes in a 16-entry table are 3 or 4 (under SALT)."""
    rng, found = np.random.default_rng(7), []
    while len(found) < count:
        words = rng.integers(0, 2**63, size=width // 8, dtype=np.int64).astype(np.uint64)
        if _home(words, SALT, 15) in (3, 4):
            found.append(words.tobytes())
    return found


# The column's width is the first named hash's: 32 or 16 bytes, whichever comes first.
COLUMN = _crowded_hashes(20, 32)
POOL = COLUMN + _crowded_hashes(4, 16) + [b"x", b"y" * 33, b"", 7, ("t", 1)]

operation = st.one_of(
    st.tuples(st.just("claim"), st.sampled_from(POOL), st.integers(0, SLOTS - 1)),
    st.tuples(st.just("several"), st.sampled_from(POOL),
              st.lists(st.integers(0, SLOTS - 1), min_size=2, max_size=3).map(tuple)),
    st.tuples(st.just("forget"), st.sampled_from(POOL)),
    st.tuples(st.just("batch"), st.lists(st.sampled_from(POOL), min_size=1, max_size=8,
                                         unique_by=lambda h: (type(h), h))),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(operation, max_size=60))
def test_chunk_hashes_agree_with_a_dict(operations):
    hashes, model, names = ChunkHashes(), {}, {}
    hashes.salt = SALT
    hashes.reserve(SLOTS)
    free = list(range(SLOTS))

    def take_slot(chunk_hash) -> int:
        slot = free.pop()
        hashes.name(slot, chunk_hash)
        names[slot] = chunk_hash
        return slot

    def release(chunk_hash) -> None:
        claim = model.pop(chunk_hash)
        for slot in (claim,) if type(claim) is int else claim:
            hashes.unname(slot)
            del names[slot]
            free.append(slot)

    for op in operations:
        if op[0] in ("claim", "several"):
            if op[1] in model:
                release(op[1])
                hashes.delete(op[1])
            count = 1 if op[0] == "claim" else len(op[2])
            if len(free) < count:
                continue
            slots = tuple(take_slot(op[1]) for _ in range(count))
            model[op[1]] = slots[0] if count == 1 else slots
            hashes.set(op[1], model[op[1]])
        elif op[0] == "forget":
            if op[1] in model:
                release(op[1])
                hashes.delete(op[1])
        else:
            new = [h for h in op[1] if h not in model][:len(free)]
            if new:
                slots = np.array([free.pop() for _ in new], dtype=np.int64)
                hashes.name_all(slots, new)
                hashes.add_new(new, slots)
                for chunk_hash, slot in zip(new, slots.tolist()):
                    model[chunk_hash], names[slot] = slot, chunk_hash
        assert len(hashes) == len(model)
        assert hashes.items() == model
        assert [hashes.get(h, "none") for h in POOL] == [model.get(h, "none") for h in POOL]
        assert hashes.known(POOL) == [h in model for h in POOL]
        column = COLUMN
        assert hashes.known(column) == [h in model for h in column]
        assert hashes.slots_of(POOL) == [model[h] if type(model.get(h)) is int else EMPTY
                                         for h in POOL]
        assert hashes.slots_of(column) == [model[h] if type(model.get(h)) is int else EMPTY
                                           for h in column]
        assert hashes.at(list(names)) == list(names.values())


def test_a_million_column_hashes_cost_no_python_object_each():
    """The common chunk hash is a row and a table entry: under 48 B each with slack."""
    hashes, count = ChunkHashes(), 1 << 20
    rows = np.random.default_rng(1).integers(0, 2**63, size=(count, 4), dtype=np.int64)
    names = [rows[i].tobytes() for i in range(count)]
    hashes.reserve(count)
    hashes.name_all(np.arange(count), names)
    hashes.add_new(names, np.arange(count))
    assert hashes.nbytes() / count < 48 and len(hashes) == count
    assert hashes.slots_of(names[::1000]) == list(range(0, count, 1000))
    assert hashes.at([5, 77]) == [names[5], names[77]] and hashes.width == 32


def test_hash_rows_read_as_the_hashes_they_hold():
    names = [bytes([i]) * 16 for i in range(5)]
    rows = HashRows(np.frombuffer(b"".join(names), dtype=np.uint64).reshape(5, 2))
    assert list(rows) == names and rows == names and rows[1] == names[1]
    assert list(rows[1:3]) == names[1:3] and len(rows[1:3]) == 2
    assert hash_block(rows) == (16, b"".join(names)) == hash_block(names)
    assert hash_block([b"a" * 16, b"b" * 8]) is None and hash_block([7]) is None
    assert hash_block(rows[:0]) == (32, b"")
