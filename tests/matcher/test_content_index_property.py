"""ContentIndex against a brute-force model: random stores, removals and queries.

The model states the match rule (and the candidates form) the obvious way: each (chunk, namespace) claim has its own
content and offset; at each probed position, of the chunks the requester's namespace
claims with the window's content and not named yet in this query, name the one first
indexed on that content by any namespace (LMCache's order; an occupant that went and came
back counts from its return). Chunk hashes of 32 bytes and of one byte take different
paths in the index (`local_matcher.chunk_hashes`); every pool mixes them. Two pools: a few hashes over
random contents (collisions, moves, overlaps), and many hashes over three contents (many
occupants per content, spread over namespaces)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import (apply_index_op, claim_one_by_one, remove_chunk_holding,
                     remove_claim_holding, slot_chunks)
from local_matcher import ContentIndex
from local_matcher.types import CANDIDATE_SPARE_CHUNKS, MAX_CANDIDATE_CHUNKS

LANE = "unit"

C = 3
NAMESPACES = ("a", "b", "c")
# Chunk hashes of 32 bytes (kept as columns: `local_matcher.chunk_hashes`) and of one byte
# (kept in a dict), mixed in every pool and batch.
def _hashes(count: int) -> list[bytes]:
    return [bytes([i]) * (32 if i % 2 else 1) for i in range(count)]


HASHES = _hashes(8)

# A tiny alphabet and a few favourite contents make shared content, repeats and
# overlapping matches common.
CONTENTS = [[0, 1, 2], [1, 2, 0], [2, 2, 2], [0, 0, 1]]
tokens = st.one_of(st.sampled_from(CONTENTS), st.lists(st.integers(0, 2), min_size=C, max_size=C))
query = st.one_of(st.lists(st.integers(0, 2), max_size=20),
                  st.lists(st.sampled_from(CONTENTS + [[0], [1, 2]]), max_size=6).map(
                      lambda parts: [t for part in parts for t in part]))
operation = st.one_of(
    st.tuples(st.just("add"), tokens, st.sampled_from(HASHES), st.integers(-1, 50),
              st.sampled_from(NAMESPACES)),
    # Removals name the content as the stored one, no content (None), or possibly other content.
    st.tuples(st.just("remove_claim"), st.sampled_from(HASHES), st.sampled_from(NAMESPACES),
              st.one_of(st.just("stored"), st.none(), tokens)),
    st.tuples(st.just("remove_chunk"), st.sampled_from(HASHES),
              st.one_of(st.just("stored"), st.none(), tokens)),
    st.tuples(st.just("match"), query, st.sampled_from(NAMESPACES)),
    # A batch of one namespace (`add_many`): new, distinct chunks on new contents take the
    # vectorised path; any other batch the per-chunk one. Either must equal adding in order.
    st.tuples(st.just("add_many"),
              st.lists(st.tuples(tokens, st.sampled_from(HASHES), st.integers(0, 50)),
                       min_size=1, max_size=6),
              st.sampled_from(NAMESPACES)),
)


class Model:
    """What the index must answer, by exhaustive comparison."""

    def __init__(self) -> None:
        # (chunk, namespace) -> (content, offset): each claim has its own.
        self.claims: dict[tuple[bytes, str], tuple[tuple[int, ...], int]] = {}
        # (chunk, content) -> when that occupant was first indexed (LMCache's order).
        self.order: dict[tuple[bytes, tuple[int, ...]], int] = {}
        self.clock = 0

    def add(self, content, chunk_hash, offset, namespace) -> None:
        if offset < 0:
            return
        content = tuple(content)
        self.claims[(chunk_hash, namespace)] = (content, offset)
        if (chunk_hash, content) not in self.order:
            self.clock += 1
            self.order[(chunk_hash, content)] = self.clock
        self._forget_empty()

    def stored(self, chunk_hash, namespace=None):
        """The content of a claim on the chunk (of `namespace`'s; None: any)."""
        for (h, ns), (content, _) in self.claims.items():
            if h == chunk_hash and namespace in (None, ns):
                return content
        return (0,) * C

    def remove_claim(self, chunk_hash, namespace, content) -> None:
        held = self.claims.get((chunk_hash, namespace))
        if held is not None and (content is None or tuple(content) == held[0]):
            del self.claims[(chunk_hash, namespace)]
        self._forget_empty()

    def remove_chunk(self, chunk_hash, content) -> None:
        for (h, ns), held in list(self.claims.items()):
            if h == chunk_hash and (content is None or tuple(content) == held[0]):
                del self.claims[(h, ns)]
        self._forget_empty()

    def _forget_empty(self) -> None:
        live = {(h, content) for (h, _), (content, _) in self.claims.items()}
        self.order = {k: v for k, v in self.order.items() if k in live}

    def match(self, query, namespace, stride):
        found, used = [], set()
        for start in range(0, len(query) - C + 1, stride):
            window = tuple(query[start:start + C])
            candidates = [(self.order[(h, content)], h, offset)
                          for (h, ns), (content, offset) in self.claims.items()
                          if ns == namespace and content == window and h not in used]
            if candidates:
                _, chunk_hash, offset = min(candidates)
                used.add(chunk_hash)
                found.append((start, chunk_hash, offset))
        return found

    def candidates(self, query, namespace, stride):
        """Per content the namespace claims, every probed position where it occurs and its
        chunks in the order `match` names them; contents by first position."""
        by_content: dict[tuple, list] = {}
        for (h, ns), (content, offset) in self.claims.items():
            if ns == namespace:
                by_content.setdefault(content, []).append((self.order[(h, content)], h, offset))
        found = []
        for content, chunks in by_content.items():
            positions = [start for start in range(0, len(query) - C + 1, stride)
                         if tuple(query[start:start + C]) == content]
            if positions:
                limit = min(len(positions) + CANDIDATE_SPARE_CHUNKS, MAX_CANDIDATE_CHUNKS)
                found.append((tuple(positions),
                              tuple((h, o) for _, h, o in sorted(chunks)[:limit])))
        return sorted(found)

    def stats(self) -> tuple[int, int, int, int]:
        return (len({content for content, _ in self.claims.values()}), len(self.order),
                len(self.claims), len({ns for _, ns in self.claims}))


MANY_HASHES = _hashes(40)
many_tokens = st.sampled_from(CONTENTS[:3])
many_query = st.lists(st.sampled_from(CONTENTS[:3] + [[0], [2, 2]]), max_size=12).map(
    lambda parts: [t for part in parts for t in part])
many_operation = st.one_of(
    st.tuples(st.just("add"), many_tokens, st.sampled_from(MANY_HASHES),
              st.integers(-1, 50), st.sampled_from(NAMESPACES)),
    st.tuples(st.just("remove_claim"), st.sampled_from(MANY_HASHES),
              st.sampled_from(NAMESPACES), st.one_of(st.just("stored"), st.none())),
    st.tuples(st.just("remove_chunk"), st.sampled_from(MANY_HASHES),
              st.one_of(st.just("stored"), st.none())),
    st.tuples(st.just("match"), many_query, st.sampled_from(NAMESPACES)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(operation, max_size=40), st.sampled_from([1, 2]))
def test_index_agrees_with_brute_force(operations, stride):
    run_against_model(operations, stride)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(many_operation, max_size=120), st.sampled_from([1, 2]))
def test_many_occupants_per_content_agree_with_brute_force(operations, stride):
    run_against_model(operations, stride)


def _widened(value):
    """`value` with every one-byte chunk hash made 32 bytes (all in the index's column)."""
    if type(value) is bytes and len(value) == 1:
        return value * 32
    if type(value) in (tuple, list):
        return type(value)(map(_widened, value))
    return value


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(operation, max_size=40), st.sampled_from([1, 2]))
def test_column_hashes_only_agree_with_brute_force(operations, stride):
    """Every chunk hash of the column's width: lookups name chunks from its rows."""
    run_against_model(_widened(operations), stride)


def run_against_model(operations, stride) -> None:
    index, model = ContentIndex(chunk_size=C, probe_stride=stride), Model()
    for op in operations:
        kind = op[0]
        if kind == "add":
            index.add(op[1], op[2], op[3], op[4])
            model.add(*op[1:])
        elif kind == "add_many":
            rows, hashes, offsets = zip(*op[1])
            index.add_many(np.array(rows, dtype=np.uint32), list(hashes), list(offsets), op[2])
            for content, chunk_hash, offset in op[1]:
                model.add(content, chunk_hash, offset, op[2])
        elif kind == "remove_claim":
            content = model.stored(op[1], op[2]) if op[3] == "stored" else op[3]
            remove_claim_holding(index, content, op[1], op[2])
            model.remove_claim(op[1], op[2], content)
        elif kind == "remove_chunk":
            content = model.stored(op[1]) if op[2] == "stored" else op[2]
            remove_chunk_holding(index, content, op[1], NAMESPACES)
            model.remove_chunk(op[1], content)
        else:
            got = index.match(op[1], op[2])
            assert [(m.cur_st, m.chunk_hash, m.old_st) for m in got] == \
                model.match(op[1], op[2], stride)
            found = index.candidates(op[1], op[2])
            assert [tuple(f) for f in found] == model.candidates(op[1], op[2], stride)
        stats = index.stats()
        assert (stats["num_contents"], stats["num_chunks"], stats["num_claims"],
                stats["num_namespaces"]) == model.stats()



# --- the bulk claim against the per-chunk one -------------------------------------------------

BULK_HASHES = _hashes(24)
bulk_operation = st.one_of(
    # A batch of rows, one namespace for all or one per row: new, distinct chunk hashes take
    # `ClaimLists.claim_new` (contents new, held before, or twice in the batch).
    st.tuples(st.just("add_many"),
              st.lists(st.tuples(tokens, st.sampled_from(BULK_HASHES), st.integers(-1, 50),
                                 st.sampled_from(NAMESPACES)), min_size=1, max_size=8),
              st.booleans()),
    st.tuples(st.just("remove_claim"), st.sampled_from(BULK_HASHES),
              st.sampled_from(NAMESPACES)),
    st.tuples(st.just("remove_chunk"), st.sampled_from(BULK_HASHES)),
)


def _claims_state(index: ContentIndex) -> tuple:
    claims = index._claims
    return (claims.chunks.items(), slot_chunks(claims),
            *(bytes(a) for a in (claims.slot_ns, claims.slot_cid, claims.slot_offset,
                                 claims._slot_order, claims.next_slot, claims._prev,
                                 claims.head, claims.num_chunks, claims._free_slots)),
            dict(claims.other_heads.items()), dict(claims.ns_ids), claims.num_claims,
            claims.num_occupants, claims._next_order, index._store.ns_mask.tobytes())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(bulk_operation, max_size=30))
def test_the_bulk_claim_leaves_what_claiming_chunk_by_chunk_does(operations):
    """Two indexes take the same operations, one claiming every batch chunk by chunk
    (`claim_all`): every slot, list, order number and mask must be the same."""
    key = (12345, 6789 | 1)
    bulk = ContentIndex(chunk_size=C, fingerprint_key=key)
    each = ContentIndex(chunk_size=C, fingerprint_key=key)
    each._claims.claim_new = lambda *args: claim_one_by_one(each._claims, *args)
    for op in operations:
        for index in (bulk, each):
            apply_index_op(index, op)
        assert _claims_state(bulk) == _claims_state(each)
