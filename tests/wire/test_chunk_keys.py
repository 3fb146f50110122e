"""LMCache's chunk naming (blend_wire.chunk_keys) against LMCache's own `TokenHasher`.

The fixed vectors were computed with LMCache 0.5.6's
`lmcache.v1.multiprocess.token_hasher.TokenHasher(chunk_size=C).compute_chunk_hashes`
(blake3, its default). Where LMCache is installed, random sequences are compared with
it directly as well.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from blend_wire import lookup_kv_ranks, prefix_chunk_hashes

LANE = "unit"

VECTORS = [
    (256, list(range(600)), [
        "084547b6c40ed5b05ba8cd0305db5bf74d5617673948d9ed193ab7d6cbc484d4",
        "e5ffee45c2b9db326814c9692dc594369887ba3b0df5761817820b60f864c8e0"]),
    (4, [0, 1, 2, 3, 4294967295, 7, 7, 7, 9], [
        "a2981a4d792b45f791d784bfd025148836ce3032f546cc490ef9fb7db9e639de",
        "8e83ee078e4062393d3ce96666878ed96e7227e9f93594331ddb7447b42b2e6c"]),
    (1, [5, 6], [
        "86f75d51e3e8beb1d50851f8e66dc6de103230ab2860e7f6732728b0cd663ade",
        "ddfacc8c2583bc139e802ac983551457e84f2c7cbe07a6094471bfcd79d907ac"]),
]


@pytest.mark.parametrize("chunk_size, tokens, expected", VECTORS, ids=["C256", "C4", "C1"])
def test_fixed_vectors_from_lmcaches_token_hasher(chunk_size, tokens, expected):
    assert [h.hex() for h in prefix_chunk_hashes(tokens, chunk_size)] == expected
    as_array = np.asarray(tokens, dtype=np.uint32)
    assert [h.hex() for h in prefix_chunk_hashes(as_array, chunk_size)] == expected


def test_a_chunk_hash_names_its_whole_prefix():
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    assert prefix_chunk_hashes(a + b, 4)[1] != prefix_chunk_hashes(b + b, 4)[1]
    assert prefix_chunk_hashes(a + b + [9], 4) == prefix_chunk_hashes(a + b, 4)
    assert prefix_chunk_hashes(a[:3], 4) == []


def test_kv_rank_fan_out_packs_world_size_and_rank_twice():
    assert lookup_kv_ranks(1) == [(1 << 24) | (1 << 8)]
    assert lookup_kv_ranks(2) == [(2 << 24) | (0 << 16) | (2 << 8) | 0,
                                  (2 << 24) | (1 << 16) | (2 << 8) | 1]


@pytest.mark.lmcache
def test_random_sequences_hash_as_lmcache_does():
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    token_hasher = pytest.importorskip(
        "lmcache.v1.multiprocess.token_hasher",
        reason="LMCache is not installed; the fixed vectors above still hold it to LMCache")
    rng = np.random.default_rng(7)
    for chunk_size in (1, 4, 16, 256):
        reference = token_hasher.TokenHasher(chunk_size=chunk_size)
        for length in (0, chunk_size - 1, chunk_size, 3 * chunk_size + 1):
            tokens = rng.integers(0, 2**32, length, dtype=np.uint64).tolist()
            assert prefix_chunk_hashes(tokens, chunk_size) == \
                reference.compute_chunk_hashes(tokens), (chunk_size, length)
