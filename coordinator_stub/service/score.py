"""Per-instance CacheBlend score: how much of a request each instance would reuse, and where
from (docs/WIRE.md, "Blend score"). Pure: plain data in, `InstanceScore`s out.

For one instance, what its unified lookup would reuse is:

- `prefix_tokens`: the leading whole chunks of the request (LMCache's prefix-chained names)
  that its prefix leg serves, i.e. that its own L1 or a shared tier holds;
- past that prefix, the selection a plugin on that instance makes
  (`local_matcher.selection`, the one rule), with each chunk placed as that instance sees it:
  its own L1 first, then a shared tier, then anywhere else (a peer's L1, or a tier not
  shared). Each kept chunk's tokens count as `l1_tokens`, `shared_tokens` or `peer_tokens`.

`score = prefix_tokens + l1_tokens + w_shared * shared_tokens + w_peer * peer_tokens`.

Cost: the selection runs once per instance that holds something of the request in its L1
(it sees the request differently from the rest) plus once for all the others, which see it
alike (only shared tiers and peers) and share one result: O(holders x candidates +
instances), not O(instances x candidates).
"""

from __future__ import annotations

from typing import Hashable, NamedTuple, Sequence

from blend_wire import InstanceScore
from local_matcher.selection import select_offers

#: A chunk's places as the directory names them: (instances whose L1 holds it, shared?).
Places = tuple[frozenset[str], bool]
_THIS_L1, _SHARED, _ELSEWHERE = 0, 1, 2


class PlacedContent(NamedTuple):
    """One content found in the request: its positions and its chunks with their places."""

    positions: tuple[int, ...]
    chunks: tuple[tuple[Hashable, int, frozenset[str], bool], ...]  # hash, old_st, l1, shared


def score_instances(instance_ids: Sequence[str], contents: Sequence[PlacedContent],
                    prefix_places: Sequence[Places], chunk_size: int, w_shared: float,
                    w_peer: float) -> list[InstanceScore]:
    """Every instance of `instance_ids` scored, best first (ties by `instance_id`).

    `prefix_places`: the places of the request's leading chunks by LMCache's names, in
    order (it may stop at the first chunk nobody holds)."""
    holders = {i for c in contents for _, _, l1, _ in c.chunks for i in l1}
    holders |= {i for l1, _ in prefix_places for i in l1}
    stranger = None  # the result of every instance that holds nothing of the request in L1
    scores = []
    for instance_id in instance_ids:
        if instance_id in holders:
            result = _score(instance_id, contents, prefix_places, chunk_size)
        else:
            if stranger is None:
                stranger = _score(None, contents, prefix_places, chunk_size)
            result = stranger
        prefix, l1, shared, peer = result
        scores.append(InstanceScore(
            instance_id=instance_id, prefix_tokens=prefix, l1_tokens=l1, shared_tokens=shared,
            peer_tokens=peer, score=prefix + l1 + w_shared * shared + w_peer * peer))
    scores.sort(key=lambda s: (-s.score, s.instance_id))
    return scores


def _score(instance_id: str | None, contents: Sequence[PlacedContent],
           prefix_places: Sequence[Places], chunk_size: int) -> tuple[int, int, int, int]:
    prefix_chunks = 0
    for l1, shared in prefix_places:
        if not shared and instance_id not in l1:
            break
        prefix_chunks += 1
    prefix = prefix_chunks * chunk_size
    leg = []
    for c in contents:  # one selection group per content and place, as the plugin's
        by_place: dict[int, list] = {}
        for chunk_hash, old_st, l1, shared in c.chunks:
            place = _THIS_L1 if instance_id in l1 else _SHARED if shared else _ELSEWHERE
            by_place.setdefault(place, []).append((chunk_hash, old_st))
        leg.extend((c.positions, place, tuple(chunks)) for place, chunks in by_place.items())
    by_place = [0, 0, 0]
    for _, _, _, place, _ in select_offers((leg,), prefix, chunk_size):
        by_place[place] += chunk_size
    return prefix, by_place[_THIS_L1], by_place[_SHARED], by_place[_ELSEWHERE]
