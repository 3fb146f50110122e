"""What another instance reported stands (docs/WIRE.md, "Chunk hashes shared by
namespaces"): the checks `Bindings` makes before a STORE or DELETE changes a chunk other
instances hold, unless shared hashes are trusted (`--trust-shared-hashes`: LMCache's rules,
where the latest report wins whoever made it). Under the directory lock, as `Bindings`.

- A chunk hash names one prefix, so a STORE of it with tokens other than its namespace's
  while another instance holds the chunk in that namespace is a collision or a lie: nothing
  of it is recorded (no placement, no content; counted `stores_conflicting`), so lookups
  of either text find what they found before. The same tokens at another offset count as
  a STORE without tokens: the position stands too.
- A shared pool's placement (one per `(tier, backend)` fleet-wide, naming its latest
  reporter) changes hands, or goes, only by a token that speaks for its reporter: a STORE
  or DELETE of it from a token scoped to other instances leaves it as it is (counted
  `foreign_placement_changes`). Unscoped tokens keep LMCache's rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from blend_wire import UNKNOWN_TOKEN_OFFSET, BlendNamespace
from coordinator_stub.directory.placements import INSTANCE, SHARED, placements_in

if TYPE_CHECKING:
    from coordinator_stub.directory.bindings import Bindings


def what_stands(bindings: "Bindings", chunk_hash: bytes, binding: tuple | None,
                key_no: int, place_no: int, tokens: bytes | None, new_offset: int
                ) -> tuple[bool, bytes | None] | None:
    """For a STORE of a chunk (`binding` None: new to the directory; module doc): None
    when it is refused, else `(keep_place, tokens)`: whether the chunk's placement of
    that identity stays as it is, and the tokens the STORE may set (None: it counts as a
    STORE without them)."""
    if binding is None or bindings.trust_shared_hashes:
        return False, tokens
    placements = bindings._placements
    namespace = placements.key_ns[key_no]
    content, offset, holds = binding[:3]
    if tokens is not None:
        own = isinstance(content, dict)  # an `OwnContent`: each namespace's own
        if own:
            content, offset = content.get(namespace, (None, UNKNOWN_TOKEN_OFFSET))
        if content is not None:
            same = bindings._same_content(chunk_hash, content, tokens,
                                          namespace if own else None)
            moved = same and offset >= 0 and new_offset != offset
            if (not same or moved) and _others_hold(bindings, holds, namespace):
                if not same:
                    bindings._counters["stores_conflicting"] += 1
                    return None
                tokens = None  # the position stands too
    keep_place = False
    if placements.places[place_no][SHARED]:
        held = placements.held_place(holds, key_no, placements.place_idents[place_no])
        keep_place = held is not None and foreign_place(bindings, held)
    return keep_place, tokens


def foreign_place(bindings: "Bindings", place_no: int) -> bool:
    """Whether the batch being applied may not change that placement: its reporter is
    not one the batch's token speaks for (counted)."""
    speaks_for = bindings.speaks_for
    if speaks_for is None or speaks_for(bindings._placements.places[place_no][INSTANCE]):
        return False
    bindings._counters["foreign_placement_changes"] += 1
    return True


def _others_hold(bindings: "Bindings", holds, namespace: BlendNamespace) -> bool:
    """Whether an instance other than the emitter holds a placement of the chunk under a
    key of `namespace`."""
    placements, emitter = bindings._placements, bindings.emitter
    if type(holds) is not tuple and holds.placements_of.keys() <= {emitter}:
        return False  # many keys, all the emitter's: no scan
    key_ns, places = placements.key_ns, placements.places
    return any(key_ns[key_no] == namespace and places[place_no][INSTANCE] != emitter
               for key_no, place_no in placements_in(holds))
