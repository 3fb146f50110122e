"""Read-only answers from the directory's bindings and placements: where a namespace's
chunks are held, a key's places, tokens and access count, the key listing (docs/WIRE.md,
"POST /directory/lookup", "GET /directory/keys"). `KeyDirectory` calls these under its
lock, except `places_of` (lookups never wait for ingest: see there) and the walk of a
listing's copied rows and tables.
"""

from __future__ import annotations

from itertools import count
from operator import itemgetter
from typing import NamedTuple, Sequence

import numpy as np

from blend_wire import BlendNamespace
from coordinator_stub.directory import place_kernels
from coordinator_stub.directory.binding_table import BindingTable
from coordinator_stub.directory.bindings import OwnContent, access_count
from coordinator_stub.directory.placements import (
    BACKEND,
    INSTANCE,
    SHARED,
    TIER,
    Placements,
    place_order,
    placements_in,
)
from coordinator_stub.directory.writer import IndexWriter

class PlaceColumns(NamedTuple):
    """Where each of a list of chunks is held, as columns: chunk i's L1 holders are
    ``instances[k]`` for k in ``holders[holder_start[i]:holder_start[i + 1]]`` (sorted by
    id), and ``shared[i]`` is 1 when a shared tier has it."""

    instances: list[str]
    holder_start: np.ndarray
    holders: np.ndarray
    shared: np.ndarray

    def l1_of(self, chunk: int) -> list[str]:
        return [self.instances[k] for k in
                self.holders[self.holder_start[chunk]:self.holder_start[chunk + 1]].tolist()]


def place_columns(table: BindingTable, placements: Placements, chunk_hashes: Sequence[bytes],
                  namespace: BlendNamespace, slots: np.ndarray | None = None
                  ) -> PlaceColumns:
    """Where `namespace`'s keys of each chunk are held (`PlaceColumns`).

    A hint for the requester's choice among chunks of one content, read without the
    directory lock so that lookups never wait for ingest: it is the state as of some
    moment while batches apply (tuples are replaced whole; a many-keys record changed
    under the read answers "nowhere known", which only makes a chunk look remote).

    Per chunk, a read of the binding table's columns, or of its dict for a chunk not
    frozen there, done by C maps and numpy (`BindingTable.hold_codes`; `slots`, the claim
    slots a lookup found, spare it the index's dict); the placement records are read once
    per distinct record (`_where`): a lookup names hundreds of chunks but a handful of
    distinct records (a record is its `(key_no, place_no)` pairs, and keys and places are
    few), so no Python runs per chunk; numbering the records and gathering each chunk's
    holders are a kernel pass each (`place_kernels`). Instances are numbered in order of
    first mention, as a pass over the chunks would."""
    codes, records = table.hold_codes(chunk_hashes, _NOWHERE, slots)
    of_chunk, firsts = place_kernels.number_records(codes)  # records by first mention
    number: dict[str, int] = {}
    shared_of, count_of, held_by = [], [], []
    for code in codes[firsts].tolist():  # each distinct record read once
        record = (code >> 32, code & _LOW32) if code >= 0 else records[-1 - code]
        l1, is_shared = _where(record, placements, namespace)
        shared_of.append(is_shared)
        count_of.append(len(l1))
        held_by.extend(number.setdefault(name, len(number)) for name in l1)
    holder_start, holders = place_kernels.gather_holders(
        of_chunk, np.array(count_of, dtype=np.int64), np.array(held_by, dtype=np.int64))
    return PlaceColumns(list(number), holder_start, holders,
                        np.array(shared_of, dtype=np.uint8)[of_chunk])


#: A chunk the directory does not hold reads as a binding holding nothing.
_NOWHERE = (None, None, None, None, None)
_LOW32 = (1 << 32) - 1


def _where(holds, placements: Placements, namespace: BlendNamespace
           ) -> tuple[list[str], bool]:
    """(L1 holders, sorted; shared?) of `namespace`'s keys in one placement record, read
    without the lock (`place_columns`): a record changed under the read, or naming a
    number not yet visible, is held nowhere known."""
    if holds is None:
        return [], False
    key_ns, places = placements.key_ns, placements.places
    try:
        pairs = (zip(holds[0::2], holds[1::2]) if type(holds) is tuple else
                 [(k, p) for k, ps in list(holds.places.items()) for p in ps])
        l1, is_shared = set(), False
        for key_no, place_no in pairs:
            if key_ns[key_no] == namespace:
                place = places[place_no]
                if place[SHARED]:
                    is_shared = True
                elif place[TIER] == "l1":
                    l1.add(place[INSTANCE])
    except (RuntimeError, IndexError, TypeError):
        return [], False
    return sorted(l1), is_shared


def places_of(table: BindingTable, placements: Placements, chunk_hashes: Sequence[bytes],
              namespace: BlendNamespace) -> list[tuple[list[str], bool]]:
    """`place_columns` as one (L1 holders, sorted; shared?) per chunk (plain data)."""
    columns = place_columns(table, placements, chunk_hashes, namespace)
    return [(columns.l1_of(i), bool(columns.shared[i])) for i in range(len(chunk_hashes))]


def placements_of(table: BindingTable, placements: Placements, writer: IndexWriter | None,
                  keys: list[tuple[bytes, tuple]]) -> list[tuple[list, list, int]]:
    """`KeyDirectory.placements_of`, under the directory lock."""
    results = []
    tokens_of: dict[bytes, list[int]] = {}
    for chunk_hash, raw_key in keys:
        binding = table.get(chunk_hash)
        if binding is None:
            results.append(([], [], 0))
            continue
        tokens = tokens_of.get(chunk_hash)
        if tokens is None:
            tokens = tokens_of[chunk_hash] = shown_tokens(chunk_hash, binding, writer)
        key_no = placements.key_nos.get(raw_key)
        if key_no is None:
            results.append(([], tokens, 0))
            continue
        holds = binding[2]
        place_nos = ([holds[i + 1] for i in range(0, len(holds), 2)
                      if holds[i] == key_no] if type(holds) is tuple
                     else holds.places.get(key_no, ()))
        places = sorted((placements.places[p] for p in place_nos), key=place_order)
        results.append((places, tokens, access_count(binding[3], key_no)))
    return results


def with_other_groups(table: BindingTable, placements: Placements,
                      keys: list[tuple[bytes, tuple]]) -> list[tuple[bytes, tuple]]:
    """`KeyDirectory.with_other_groups`, under the directory lock."""
    expanded: list[tuple[bytes, tuple]] = []
    by_chunk: dict[bytes, dict[tuple, list[tuple]]] = {}
    for chunk_hash, raw_key in keys:
        groups = by_chunk.get(chunk_hash)
        if groups is None:
            groups = by_chunk[chunk_hash] = {}
            binding = table.get(chunk_hash)
            holds = binding[2] if binding is not None else ()
            key_nos = (dict.fromkeys(holds[0::2]) if type(holds) is tuple
                       else holds.places)
            for key_no in key_nos:
                stored = placements.key_raw[key_no]
                groups.setdefault(stored[:3], []).append(stored)
        expanded.append((chunk_hash, raw_key))
        expanded.extend((chunk_hash, stored) for stored in sorted(
            (stored for stored in groups.get(raw_key[:3], ()) if stored != raw_key),
            key=lambda stored: stored[3]))
    return expanded


def key_rows(table: BindingTable, chunk_size: int) -> list[tuple]:
    """A copy of the bindings for a listing, `(chunk_hash, num_tokens, holds, accesses)`
    (under the directory lock: flat records are immutable tuples, the others copied)."""
    return [(chunk_hash,
             len(reported) // 4 if reported is not None
             else 0 if content is None or type(content) is OwnContent
             else chunk_size,
             holds if type(holds) is tuple else placements_in(holds),
             accesses if type(accesses) is tuple else dict(accesses))
            for chunk_hash, (content, _, holds, accesses, reported) in table.items()]


def key_page(rows: list[tuple], places: list, key_raw: list, tier: str, instance_id: str,
             backend: str, offset: int, limit: int
             ) -> tuple[int, list[tuple[bytes, tuple, list, int, int]]]:
    """The listing of `key_rows` (`KeyDirectory.list_keys`), walked without the lock:
    the rows, `places` and `key_raw` (`Placements`' tables) are copies taken together
    under it (a batch frees numbers, and a later one reuses them)."""
    total, page = 0, []
    for chunk_hash, num_tokens, holds, accesses in rows:
        pairs = zip(holds[0::2], holds[1::2]) if type(holds) is tuple else holds
        by_key: dict[int, list] = {}
        for key_no, place_no in pairs:
            place = places[place_no]
            if ((tier == "all" or place[TIER] == tier)
                    and (not instance_id or place[INSTANCE] == instance_id)
                    and (not backend or place[BACKEND] == backend)):
                by_key.setdefault(key_no, []).append(place)
        for key_no, matching in by_key.items():
            if offset <= total < offset + limit:
                matching.sort(key=place_order)
                page.append((chunk_hash, key_raw[key_no], matching, num_tokens,
                             access_count(accesses, key_no)))
            total += 1
    return total, page


def shown_tokens(chunk_hash: bytes, binding: tuple, writer: IndexWriter | None
                 ) -> list[int]:
    """The tokens directory queries show for a chunk: those of the latest STORE that
    carried any (DESIGN.md, "Key directory internals")."""
    content, reported = binding[0], binding[4]
    if reported is not None:
        return np.frombuffer(reported, dtype=np.uint32).tolist()
    if content is None or type(content) is OwnContent:
        return []
    if type(content) is bytes:
        return np.frombuffer(content, dtype=np.uint32).tolist()
    tokens = writer.tokens_of(chunk_hash) if writer is not None else None
    return [] if tokens is None else np.frombuffer(tokens, dtype=np.uint32).tolist()
