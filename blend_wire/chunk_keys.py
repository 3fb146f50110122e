"""How LMCache names the chunks of a token sequence: prefix-chained hashes, per-rank keys.

Contract (WIRE.md, `POST /directory/lookup`, tokens form; LMCache 0.5.6's `TokenHasher`
with its default blake3 algorithm):
- `prefix_chunk_hashes(tokens, chunk_size)`: one 32-byte hash per complete chunk (a
  trailing partial chunk is ignored): `h0 = blake3(12 zero bytes)`, `h_i = blake3(h_{i-1}
  || chunk i's tokens as uint32 big-endian)`. So a chunk's hash names its whole prefix.
- `lookup_kv_ranks(world_size)`: the `kv_rank` of every rank of a lookup, in rank order:
  `(ws << 24) | (r << 16) | (ws << 8) | r`.
- `MAX_TOKEN_IDS`: the most tokens one request may ask to resolve.

Tokens are converted once (one vectorised byte-swap); hashing is one blake3 call per
chunk, never per token.
"""

from __future__ import annotations

import numpy as np
from blake3 import blake3

from blend_wire.values import pack_kv_rank

#: LMCache's cap on the token ids of one token-addressed request.
MAX_TOKEN_IDS = 1_000_000

# LMCache seeds the chain with its hash of (prefix 0 as 8 signed big-endian bytes, token 0).
_CHAIN_SEED = blake3(bytes(12)).digest()


def prefix_chunk_hashes(tokens, chunk_size: int) -> list[bytes]:
    """The prefix-chained blake3 hash of every complete chunk of `tokens` (uint32 ids)."""
    count = len(tokens) // chunk_size
    if count == 0:
        return []
    packed = np.asarray(tokens[:count * chunk_size], dtype=">u4").tobytes()
    step = 4 * chunk_size
    hashes: list[bytes] = []
    previous = _CHAIN_SEED
    for start in range(0, count * step, step):
        previous = blake3(previous + packed[start:start + step]).digest()
        hashes.append(previous)
    return hashes


def lookup_kv_ranks(world_size: int) -> list[int]:
    """The kv_rank of each rank of a `world_size`-way lookup (one node: local = global)."""
    return [pack_kv_rank(world_size, rank, world_size, rank) for rank in range(world_size)]
