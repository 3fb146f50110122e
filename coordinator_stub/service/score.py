"""Per-instance CacheBlend score: how much of a request each instance would reuse, and where
from (docs/WIRE.md, "POST /directory/blend-score"). Columns in, `InstanceScore`s out.

For one instance, what its unified lookup would reuse is:

- `prefix_tokens`: the leading whole chunks of the request (LMCache's prefix-chained names)
  that its prefix leg serves, i.e. that its own L1 or a shared tier holds;
- past that prefix, the selection a plugin on that instance makes
  (`local_matcher.selection`, the one rule), with each chunk placed as that instance sees it:
  its own L1 first, then a shared tier, then anywhere else (a peer's L1, or a tier not
  shared). Each kept chunk's tokens count as `l1_tokens`, `shared_tokens` or `peer_tokens`.

`score = prefix_tokens + l1_tokens + w_shared * shared_tokens + w_peer * peer_tokens`.

Cost: one kernel call (`local_matcher.selection.score`) runs the selection once per asked
instance that holds something of the request in its L1 (it sees the request differently
from the rest) plus once for all the others, which see it alike (only shared tiers and
peers) and share one result: O(holders x (occurrences + chunks) + instances), no Python
per content, chunk or holder selection. The occurrences and chunks are the candidates
form's, bounded (WIRE.md, "Limits"); the prefix is hashed only as far as someone holds it
(`prefix_places`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from blend_wire import BlendNamespace, InstanceScore, prefix_chunk_hashes
from coordinator_stub.directory import KeyDirectory
from coordinator_stub.directory.queries import PlaceColumns
from local_matcher import selection
from local_matcher.types import CandidateColumns

#: How many leading chunks `prefix_places` hashes first; each further step 4x as many.
FIRST_PREFIX_STEP = 64


def score_instances(instance_ids: Sequence[str], found: CandidateColumns,
                    places: PlaceColumns, prefix: PlaceColumns, chunk_size: int,
                    w_shared: float, w_peer: float) -> list[InstanceScore]:
    """Every instance of `instance_ids` scored, best first (ties by `instance_id`).

    `found` and `places`: the request's candidates and where each chunk is held;
    `prefix`: the places of the request's leading chunks by LMCache's names, in order
    (it may stop at the first chunk nobody holds)."""
    wanted = set(instance_ids)
    asked = {instance_id: row for row, instance_id in enumerate(
        name for name in dict.fromkeys(places.instances + prefix.instances)
        if name in wanted)}
    holders = len(asked)
    prefixes = _prefix_chunks(prefix, [*asked, None]) * chunk_size
    # The holders CSR renumbered to the asked holders' rows (others hold nothing here).
    row_of = np.array([asked.get(name, -1) for name in places.instances], dtype=np.int64)
    rows = row_of[places.holders] if len(places.holders) else places.holders
    keep = rows >= 0
    chunk_of = np.repeat(np.arange(len(places.shared)), np.diff(places.holder_start))
    holder_start = np.zeros(len(places.shared) + 1, dtype=np.int64)
    np.cumsum(np.bincount(chunk_of[keep], minlength=len(places.shared)), out=holder_start[1:])
    tokens = selection.score(found, places.shared, holder_start, rows[keep], prefixes,
                             chunk_size).tolist()
    prefixes = prefixes.tolist()
    scores = []
    for instance_id in instance_ids:
        row = asked.get(instance_id, holders)
        l1, shared, peer = tokens[row]
        scores.append(InstanceScore(
            instance_id=instance_id, prefix_tokens=prefixes[row], l1_tokens=l1,
            shared_tokens=shared, peer_tokens=peer,
            score=prefixes[row] + l1 + w_shared * shared + w_peer * peer))
    scores.sort(key=lambda s: (-s.score, s.instance_id))
    return scores


def _prefix_chunks(prefix: PlaceColumns, instance_ids: list[str | None]) -> np.ndarray:
    """How many leading chunks each instance's prefix leg serves (None: an instance that
    holds none of them in L1): each held by a shared tier or in its L1. Vectorised over
    the instances: instance n serves up to the first chunk no shared tier holds that it
    does not hold either."""
    unshared = np.flatnonzero(prefix.shared == 0)  # chunks a shared tier does not serve
    rank = np.full(len(prefix.shared), -1, dtype=np.int64)
    rank[unshared] = np.arange(unshared.size)
    chunk_of = np.repeat(np.arange(len(prefix.shared)), np.diff(prefix.holder_start))
    held = rank[chunk_of] >= 0  # holdings that matter: of unshared chunks
    # Per instance, its unshared chunks' ranks ascending (holders are unique per chunk):
    # it serves the first k of them exactly when its j-th holding is rank j for j < k, and
    # rank - j never falls, so k counts the holdings where rank == j.
    who, ranks = prefix.holders[held], rank[chunk_of[held]]
    order = np.lexsort((ranks, who))
    who, ranks = who[order], ranks[order]
    first = np.searchsorted(who, who, side="left")
    leading = np.bincount(who[ranks == np.arange(who.size) - first],
                          minlength=len(prefix.instances) + 1)
    number = {name: n for n, name in enumerate(prefix.instances)}
    runs = leading[[number.get(name, len(prefix.instances)) for name in instance_ids]]
    stops = np.append(unshared, len(prefix.shared))  # past the last unshared: all served
    return stops[runs].astype(np.int64)


def prefix_places(directory: KeyDirectory, tokens: np.ndarray, namespace: BlendNamespace,
                  chunk_size: int) -> PlaceColumns:
    """Where the request's leading chunks, by LMCache's names, are held, up to and with the
    first chunk nobody holds (no prefix leg serves anything past it). The hash chain costs
    a hash per chunk, so it is hashed in steps, `FIRST_PREFIX_STEP` chunks first and 4x as
    many each time all were held: a request whose prefix nobody holds costs one step,
    however long it is, and a held one at most 4/3 of its hashes plus a step."""
    total = tokens.size // chunk_size
    count = min(total, FIRST_PREFIX_STEP)
    while True:
        places = directory.place_columns(
            prefix_chunk_hashes(tokens[:count * chunk_size], chunk_size), namespace)
        unheld = np.flatnonzero((np.diff(places.holder_start) == 0) & (places.shared == 0))
        if unheld.size:
            return _leading(places, int(unheld[0]) + 1)
        if count == total:
            return places
        count = min(total, count * 4)


def _leading(places: PlaceColumns, chunks: int) -> PlaceColumns:
    """The first `chunks` chunks of `places`, naming only their holders."""
    holders = places.holders[:places.holder_start[chunks]]
    numbers, renumbered = np.unique(holders, return_inverse=True)
    return PlaceColumns([places.instances[n] for n in numbers.tolist()],
                        places.holder_start[:chunks + 1], renumbered.astype(np.int64),
                        places.shared[:chunks])
