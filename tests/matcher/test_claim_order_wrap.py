"""Claim order numbers are int32 (local_matcher/claims.py, module doc): when the next one
would pass the limit, every live number is renumbered by rank. Nothing a caller sees may
change: the same operations give the same matches, candidates, list order and occupant
order with the limit lowered (renumbering often) as with the real one (never), and an
older snapshot's 8-byte numbers load as 4-byte ones."""

from __future__ import annotations

import pickle
import random
from array import array

import numpy as np

from helpers import apply_index_op
from local_matcher import ContentIndex
from local_matcher import claims as claims_module

LANE = "unit"

C = 3
KEY = (12345, 6789 | 1)
# More namespaces than a tuple of claims holds (`_FEW_CLAIMS`): chunks claimed by many
# keep their occupants' numbers in a `_ManyClaims`, which a renumbering updates too.
NAMESPACES = [f"ns{i}" for i in range(11)]
CONTENTS = [[0, 1, 2], [1, 2, 0], [2, 2, 2]]
# 32-byte hashes (the column) and one-byte ones (the dict), as the index sees both.
HASHES = [bytes([i]) * (32 if i % 2 else 1) for i in range(12)]
QUERY = np.array([t for content in CONTENTS * 2 for t in content], dtype=np.uint32)
# At most 12 chunks x 3 contents occupants, plus a batch of 6: renumbered every dozen or
# so new occupants, always with room left.
SMALL_LIMIT = 42


def _operations(seed: int, count: int) -> list[tuple]:
    rng = random.Random(seed)
    ops = []
    for _ in range(count):
        kind = rng.choices(["add", "add_many", "remove_claim", "remove_chunk"],
                           weights=[5, 3, 2, 1])[0]
        if kind == "add":
            ops.append((kind, rng.choice(CONTENTS), rng.choice(HASHES), rng.randrange(50),
                        rng.choice(NAMESPACES)))
        elif kind == "add_many":
            rows = [(rng.choice(CONTENTS), rng.choice(HASHES), rng.randrange(50),
                     rng.choice(NAMESPACES)) for _ in range(rng.randint(1, 6))]
            ops.append((kind, rows, rng.random() < 0.5))
        elif kind == "remove_claim":
            ops.append((kind, rng.choice(HASHES), rng.choice(NAMESPACES)))
        else:
            ops.append((kind, rng.choice(HASHES)))
    return ops


def _order_ranks(claims) -> tuple:
    """Each live slot's order number as its rank among the live ones, and each many-claims
    record's occupants' likewise: what comparisons of order numbers can tell."""
    orders = np.array(claims._slot_order, dtype=np.int64)
    live = np.ones(len(orders), dtype=bool)
    live[list(claims._free_slots)] = False
    distinct, ranks = np.unique(orders[live], return_inverse=True)
    many = {}
    for chunk_hash, claim in claims.chunks.items().items():
        if type(claim) is claims_module._ManyClaims:
            many[chunk_hash] = {cid: (int(np.searchsorted(distinct, order)), held)
                                for cid, (order, held) in claim.occupants.items()}
            assert all(distinct[rank] == order for (rank, _), (order, _) in
                       zip(many[chunk_hash].values(), claim.occupants.values()))
    return ranks.tolist(), many


def _seen(index: ContentIndex) -> tuple:
    """What the index answers, and how its lists are linked."""
    claims = index._claims
    found = [([tuple(m) for m in index.match(QUERY, ns)],
              [tuple(c) for c in index.candidates(QUERY, ns)]) for ns in NAMESPACES]
    links = tuple(bytes(a) for a in (claims.next_slot, claims._prev, claims.head,
                                     claims._free_slots))
    return found, links, dict(claims.other_heads.items()), _order_ranks(claims), \
        claims.num_occupants


def _run(ops: list[tuple]) -> tuple[list, int, int]:
    """What the index shows after each operation; how many renumberings it made, and how
    many of them with a many-claims record there."""
    index = ContentIndex(chunk_size=C, fingerprint_key=KEY)
    seen, renumbered, with_many = [], 0, 0
    for op in ops:
        before = index._claims._next_order
        apply_index_op(index, op)
        after = index._claims._next_order
        assert after <= claims_module._MAX_ORDER
        seen.append(_seen(index))
        renumbered += after < before
        with_many += after < before and bool(seen[-1][3][1])
    return seen, renumbered, with_many


def test_renumbering_changes_no_match_and_no_order(monkeypatch):
    for seed in range(4):
        ops = _operations(seed, 250)
        plain, none, _ = _run(ops)
        monkeypatch.setattr(claims_module, "_MAX_ORDER", SMALL_LIMIT)
        wrapped, renumbered, with_many = _run(ops)
        monkeypatch.undo()
        assert none == 0 and renumbered >= 3 and with_many >= 1
        for step, (expected, got) in enumerate(zip(plain, wrapped)):
            assert got == expected, (seed, step, ops[step])


def test_renumbering_keeps_one_number_per_occupant_and_new_ones_last(monkeypatch):
    monkeypatch.setattr(claims_module, "_MAX_ORDER", 10)
    index = ContentIndex(chunk_size=C, fingerprint_key=KEY)
    # Two namespaces on each of three chunks of one content: three occupants, six slots.
    for ns in NAMESPACES[:2]:
        index.add_many(np.array([CONTENTS[0]] * 3, dtype=np.uint32), HASHES[:3], [0, 3, 6],
                       ns)
    index.remove_chunk(HASHES[1])  # numbers 0 and 2 live, next 3
    for chunk_hash in HASHES[3:11]:  # new occupants: the eighth would take next past 10
        index.add(CONTENTS[0], chunk_hash, 9, NAMESPACES[0])
    claims = index._claims
    slot_of = {h: [s for s in range(len(claims.slot_ns)) if s not in claims._free_slots
                   and claims.chunks.at([s])[0] == h] for h in HASHES[:11]}
    orders = {h: {claims._slot_order[s] for s in slots} for h, slots in slot_of.items()
              if slots}
    assert all(len(numbers) == 1 for numbers in orders.values())  # one per occupant
    assert orders[HASHES[2]] == {1} and claims._next_order == 10  # renumbered by rank
    ranked = sorted(orders, key=lambda h: orders[h].pop())
    assert ranked == [HASHES[0], HASHES[2], *HASHES[3:11]]
    assert [m.chunk_hash for m in index.match(np.array(CONTENTS[0] * 10, dtype=np.uint32),
                                              NAMESPACES[0])] == ranked


def test_an_older_snapshots_8_byte_order_numbers_load_as_4_byte_ones():
    ops = _operations(7, 160)
    old, fresh = (ContentIndex(chunk_size=C, fingerprint_key=KEY) for _ in range(2))
    for op in ops[:120]:
        apply_index_op(old, op)
        apply_index_op(fresh, op)
    # As a build with 8-byte numbers held them: past 2^31 and wide apart, in the slots and
    # in the many-claims records alike (the order of each comparison kept).
    claims = old._claims
    wide = np.array(claims._slot_order, dtype=np.int64) * 3 + 2**40
    claims._slot_order, claims._next_order = array("q", wide.tobytes()), int(wide.max()) + 3
    for claim in claims.chunks.others.values():
        if type(claim) is claims_module._ManyClaims:
            for occupant in claim.occupants.values():
                occupant[0] = occupant[0] * 3 + 2**40
    loaded = pickle.loads(pickle.dumps(old))
    assert loaded._claims._slot_order.typecode == "i"
    assert loaded._claims._next_order == loaded._claims.num_occupants
    assert _seen(loaded) == _seen(fresh)
    for op in ops[120:]:  # and they go on alike
        apply_index_op(loaded, op)
        apply_index_op(fresh, op)
        assert _seen(loaded) == _seen(fresh)
