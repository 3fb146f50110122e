"""ContentIndex against a brute-force model: random stores, removals and queries.

The model states the match rule (and the candidates form) the obvious way: at each probed position, of the chunks
whose content equals the window, claimed by the requester's namespace and not named yet
in this query, name the one the namespace claimed first. Two pools: a few hashes over
random contents (collisions, moves, overlaps), and many hashes over three contents (many
occupants per content, spread over namespaces)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from local_matcher import ContentIndex
from local_matcher.types import CANDIDATE_SPARE_CHUNKS, MAX_CANDIDATE_CHUNKS

C = 3
NAMESPACES = ("a", "b", "c")
HASHES = [bytes([i]) for i in range(8)]

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
)


class Model:
    """What the index must answer, by exhaustive comparison."""

    def __init__(self) -> None:
        # chunk -> (content, offset, {namespace: when it claimed the chunk})
        self.chunks: dict[bytes, tuple[tuple[int, ...], int, dict[str, int]]] = {}
        self.clock = 0

    def add(self, content, chunk_hash, offset, namespace) -> None:
        if offset < 0:
            return
        known = self.chunks.get(chunk_hash)
        claims = {}
        if known is not None and known[0] == tuple(content):
            claims = known[2]
        if namespace not in claims:
            self.clock += 1
            claims[namespace] = self.clock
        self.chunks[chunk_hash] = (tuple(content), offset, claims)

    def names(self, chunk_hash, content) -> bool:
        """Whether a removal naming `content` (None: any) applies to the chunk."""
        known = self.chunks.get(chunk_hash)
        return known is not None and (content is None or tuple(content) == known[0])

    def remove_claim(self, chunk_hash, namespace, content) -> None:
        if self.names(chunk_hash, content):
            claims = self.chunks[chunk_hash][2]
            claims.pop(namespace, None)
            if not claims:
                del self.chunks[chunk_hash]

    def remove_chunk(self, chunk_hash, content) -> None:
        if self.names(chunk_hash, content):
            del self.chunks[chunk_hash]

    def match(self, query, namespace, stride):
        found, used = [], set()
        for start in range(0, len(query) - C + 1, stride):
            window = tuple(query[start:start + C])
            candidates = [(claims[namespace], chunk_hash, offset)
                          for chunk_hash, (content, offset, claims) in self.chunks.items()
                          if content == window and namespace in claims
                          and chunk_hash not in used]
            if candidates:
                _, chunk_hash, offset = min(candidates)
                used.add(chunk_hash)
                found.append((start, chunk_hash, offset))
        return found

    def candidates(self, query, namespace, stride):
        """Per content the namespace claims, every probed position where it occurs and its
        chunks in the order `match` names them; contents by first position."""
        by_content: dict[tuple, list] = {}
        for chunk_hash, (content, offset, claims) in self.chunks.items():
            if namespace in claims:
                by_content.setdefault(content, []).append((claims[namespace], chunk_hash, offset))
        found = []
        for content, chunks in by_content.items():
            positions = [start for start in range(0, len(query) - C + 1, stride)
                         if tuple(query[start:start + C]) == content]
            if positions:
                limit = min(len(positions) + CANDIDATE_SPARE_CHUNKS, MAX_CANDIDATE_CHUNKS)
                found.append((tuple(positions), tuple((h, o) for _, h, o in sorted(chunks)[:limit])))
        return sorted(found)

    def stats(self) -> tuple[int, int, int, int]:
        return (len({content for content, _, _ in self.chunks.values()}), len(self.chunks),
                sum(len(claims) for _, _, claims in self.chunks.values()),
                len(set().union(*(claims for _, _, claims in self.chunks.values()))))


MANY_HASHES = [bytes([i]) for i in range(40)]
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


def run_against_model(operations, stride) -> None:
    index, model = ContentIndex(chunk_size=C, probe_stride=stride), Model()
    for op in operations:
        kind = op[0]
        if kind == "add":
            index.add(op[1], op[2], op[3], op[4])
            model.add(*op[1:])
        elif kind == "remove_claim":
            content = model.chunks.get(op[1], ((0,) * C,))[0] if op[3] == "stored" else op[3]
            index.remove_claim(content, op[1], op[2])
            model.remove_claim(op[1], op[2], content)
        elif kind == "remove_chunk":
            content = model.chunks.get(op[1], ((0,) * C,))[0] if op[2] == "stored" else op[2]
            index.remove_chunk(content, op[1])
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

