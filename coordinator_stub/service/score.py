"""Per-instance CacheBlend score: how much of a request each instance would reuse, and where
from (docs/WIRE.md, "Blend score"). Columns in, `InstanceScore`s out.

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
per content, chunk or holder selection.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from blend_wire import InstanceScore
from coordinator_stub.directory.queries import PlaceColumns
from local_matcher import selection
from local_matcher.types import CandidateColumns


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
    prefixes = np.full(holders + 1, _prefix_chunks(prefix, None) * chunk_size,
                       dtype=np.int64)
    for instance_id, row in asked.items():
        prefixes[row] = _prefix_chunks(prefix, instance_id) * chunk_size
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


def _prefix_chunks(prefix: PlaceColumns, instance_id: str | None) -> int:
    """How many leading chunks an instance's prefix leg serves (None: an instance that
    holds none of them in L1): each held by a shared tier or in its L1."""
    number = (prefix.instances.index(instance_id)
              if instance_id is not None and instance_id in prefix.instances else -1)
    served = prefix.shared.astype(bool)
    if number >= 0:
        chunk_of = np.repeat(np.arange(len(served)), np.diff(prefix.holder_start))
        served[chunk_of[prefix.holders == number]] = True
    unserved = np.flatnonzero(~served)
    return int(unserved[0]) if unserved.size else len(served)
