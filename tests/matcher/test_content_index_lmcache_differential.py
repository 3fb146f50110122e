"""ContentIndex against LMCache 0.5.6's own `BlendIndex`, driven as the coordinator drives it.

LMCache's index keeps one content and one offset per chunk hash (a re-store with other
tokens is `remove_chunk` then `add`; an `add` at another offset moves the chunk's offset for
every namespace). Our index keeps them per claim, so the driver does what the directory does
with `--trust-shared-hashes`: other content retires the chunk first, and a new offset is
re-added for every namespace claiming the chunk; LMCache's removals take the claim's tokens,
ours none, so the driver checks them first (`helpers.remove_claim_holding`). Then every
match must be the same list, in the same order: LMCache names, per content, the occupants
in the order they were first indexed on it (a namespace joining an older occupant does not
move it; one removed and indexed again goes last).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from lmcache.v1.mp_coordinator.blend_index import BlendIndex

from helpers import remove_claim_holding
from local_matcher import ContentIndex

LANE = "lmcache"

C = 3
NAMESPACES = ("a", "b", "c")
HASHES = [bytes([i]) for i in range(5)]
CONTENTS = [(0, 1, 2), (1, 2, 0), (2, 2, 2)]


class Both:
    """The two indexes, and what LMCache's holds per chunk (content, offset, namespaces)."""

    def __init__(self) -> None:
        self.ours = ContentIndex(chunk_size=C)
        self.theirs = BlendIndex(chunk_size=C)
        self.chunks: dict[bytes, tuple[tuple[int, ...], int, set[str]]] = {}

    def add(self, content, chunk_hash, offset, namespace) -> None:
        known = self.chunks.get(chunk_hash)
        if known is not None and known[0] != content:
            self.remove_chunk(chunk_hash)
            known = None
        self.theirs.add(np.array(content, dtype=np.uint32), chunk_hash, offset, namespace)
        self.ours.add(content, chunk_hash, offset, namespace)
        namespaces = set() if known is None else known[2]
        if known is not None and known[1] != offset:  # LMCache's offset is the chunk's
            for other in namespaces:
                self.ours.add(content, chunk_hash, offset, other)
        self.chunks[chunk_hash] = (content, offset, namespaces | {namespace})

    def remove_claim(self, chunk_hash, namespace) -> None:
        known = self.chunks.get(chunk_hash)
        if known is None:
            return
        self.theirs.remove_claim(np.array(known[0], dtype=np.uint32), chunk_hash, namespace)
        remove_claim_holding(self.ours, known[0], chunk_hash, namespace)
        known[2].discard(namespace)
        if not known[2]:
            del self.chunks[chunk_hash]

    def remove_chunk(self, chunk_hash) -> None:
        known = self.chunks.pop(chunk_hash, None)
        if known is not None:
            self.theirs.remove_chunk(np.array(known[0], dtype=np.uint32), chunk_hash)
            self.ours.remove_chunk(chunk_hash)

    def assert_same(self, query, namespace) -> None:
        ours = [(m.chunk_hash, m.old_st, m.cur_st) for m in self.ours.match(query, namespace)]
        theirs = [(m.chunk_hash, m.old_st, m.cur_st)
                  for m in self.theirs.match(np.array(query, dtype=np.uint32), namespace)]
        assert ours == theirs, (query, namespace)
        stats, reference = self.ours.stats(), self.theirs.stats()
        assert (stats["num_contents"], stats["num_chunks"], stats["num_claims"],
                stats["num_namespaces"]) == (reference.num_contents, reference.num_chunks,
                                             reference.num_claims, reference.num_namespaces)


def test_a_namespace_claiming_an_older_chunk_after_its_own_gets_lmcaches_order():
    both = Both()
    both.add(CONTENTS[0], b"older", 0, "b")
    both.add(CONTENTS[0], b"own", 8, "a")
    both.add(CONTENTS[0], b"older", 0, "a")  # a joins b's occupant, first indexed earlier
    both.assert_same(list(CONTENTS[0] * 2), "a")  # [older @0, own @3], as LMCache
    both.remove_claim(b"older", "b")
    both.assert_same(list(CONTENTS[0] * 2), "a")
    both.remove_claim(b"older", "a")  # gone, then indexed again: last
    both.add(CONTENTS[0], b"older", 0, "a")
    both.assert_same(list(CONTENTS[0] * 2), "a")


# Each content repeated (several occupants of one namespace named in order), and all of
# them in a row twice.
QUERIES = [list(c) * 4 for c in CONTENTS] + [[t for c in CONTENTS for t in c] * 2]


@pytest.mark.parametrize("seed", range(24))
def test_matches_are_lmcaches_under_any_history(seed):
    # Seeded histories, long enough that namespaces join each other's older occupants,
    # leave, come back, and chunks move offsets and contents (a few hashes, contents and
    # namespaces make all of it common).
    rng, both = random.Random(seed), Both()
    for _ in range(80):
        roll = rng.random()
        if roll < 0.6:
            both.add(rng.choice(CONTENTS), rng.choice(HASHES), rng.choice([0, 4, 9]),
                     rng.choice(NAMESPACES))
        elif roll < 0.85:
            both.remove_claim(rng.choice(HASHES), rng.choice(NAMESPACES))
        else:
            both.remove_chunk(rng.choice(HASHES))
        for query in QUERIES:
            for namespace in NAMESPACES:
                both.assert_same(query, namespace)
