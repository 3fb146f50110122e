"""`make bench-coordinator`'s workload shapes (`--workload rag` and its parts): the corpus
and the lookups hold what the options say, so a ratio measured on them means that shape."""

from __future__ import annotations

import numpy as np

from benchmarks.bench_coordinator import build_corpus, build_queries, token_ids
from blend_wire import decode_tokens

LANE = "unit"

C = 16


def query_tokens(query) -> np.ndarray:
    import msgspec

    body = query.request.split(b"\r\n\r\n", 1)[1]
    return decode_tokens(msgspec.json.decode(body)["tokens_b64"])


def test_copies_share_one_text_under_other_hashes_and_tenants():
    corpus = build_corpus(4 * 8 * 2, C, 8, tenants=4, instances=2,
                          rng=np.random.default_rng(1), copies=2)
    # Sequences 0 and 1 hold one text, stored by tenants 0 and 1 under other chunk hashes.
    assert np.array_equal(corpus.tokens[0:8], corpus.tokens[8:16])
    assert not set(corpus.hashes[0:8]) & set(corpus.hashes[8:16])
    assert (corpus.tenant[0], corpus.tenant[8]) == (0, 1)
    assert not np.array_equal(corpus.tokens[0:8], corpus.tokens[16:24])
    assert len(set(corpus.hashes)) == len(corpus.hashes)


def test_runs_are_consecutive_stored_chunks_at_the_positions_expected():
    rng = np.random.default_rng(2)
    corpus = build_corpus(4 * 8 * 4, C, 8, tenants=4, instances=2, rng=rng, tokens="zipf")
    queries = build_queries(corpus, 20, 400, 8, 4, "h", 1, rng, run=4, tokens="zipf")
    row_of = {h.hex(): i for i, h in enumerate(corpus.hashes)}
    for query in queries:
        tokens = query_tokens(query)
        assert len(query.expected) == 8
        found = sorted((cur_st, row_of[h]) for h, _, cur_st in query.expected)
        for cur_st, row in found:
            assert np.array_equal(tokens[cur_st:cur_st + C], corpus.tokens[row])
        # Two runs of four: each run's chunks follow each other in the query and the store.
        for run in (found[:4], found[4:]):
            assert [r for _, r in run] == list(range(run[0][1], run[0][1] + 4))
            assert [p for p, _ in run] == [run[0][0] + k * C for k in range(4)]


def test_misses_hold_nothing_stored_and_zipf_ids_are_skewed():
    rng = np.random.default_rng(3)
    corpus = build_corpus(4 * 8, C, 8, tenants=4, instances=1, rng=rng)
    queries = build_queries(corpus, 200, 256, 4, 4, "h", 1, rng, misses=0.5)
    empty = sum(not q.expected for q in queries)
    assert 60 < empty < 140
    ids = token_ids(np.random.default_rng(4), 100_000, "zipf")
    _, counts = np.unique(ids, return_counts=True)
    assert counts.max() > 0.05 * ids.size  # the most frequent id: several % of all text
