"""STORE entries of chunks the directory does not hold yet, recorded in bulk: a serving
process reports the chunks it just stored, runs of them under one key, so most of a batch
costs a few operations per run instead of a dozen calls per entry. `store_batch` splits a
batch into maximal runs the bulk path can take and the entries between them, which go
entry by entry (`Bindings._store`), in order. The bulk path records what the entry-by-entry
one would; tests/coordinator/test_coordinator_directory_bulk.py holds the two to the same state over
random batches. Also `digest`, what a binding keeps of indexed tokens.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import attrgetter, ne
from typing import TYPE_CHECKING

import numpy as np

from blend_wire import UNKNOWN_TOKEN_OFFSET, CacheEventBatch, CacheEventEntry
from coordinator_stub.directory.journal import JournaledSet
from coordinator_stub.directory.placements import Placements

if TYPE_CHECKING:
    from coordinator_stub.directory.binding_table import BindingTable

#: The digest of indexed tokens (native uint32 bytes) a binding keeps. Only ever compared
#: within this process: the per-process randomised `hash` is right, and a builtin, so a
#: batch's digests are taken without a Python call each.
digest = hash

#: Token offsets, each value kept once: a binding's offset is then a reference to a shared
#: int (offsets are mostly a few hundred multiples of the chunk size), not an int object
#: of its own (28 B a chunk). Bounded: emptied past `_MAX_SHARED_OFFSETS` values.
_SHARED_OFFSETS: dict[int, int] = {}
_MAX_SHARED_OFFSETS = 1 << 16


def shared_offsets(offsets: list[int]) -> list[int]:
    """`offsets`, each the shared int of its value (`_SHARED_OFFSETS`)."""
    if len(_SHARED_OFFSETS) > _MAX_SHARED_OFFSETS:
        _SHARED_OFFSETS.clear()
    return list(map(_SHARED_OFFSETS.setdefault, offsets, offsets))


def shared_offset(offset: int) -> int:
    """`shared_offsets` of one."""
    if len(_SHARED_OFFSETS) > _MAX_SHARED_OFFSETS:
        _SHARED_OFFSETS.clear()
    return _SHARED_OFFSETS.setdefault(offset, offset)


_KEY, _SIZE, _TOKENS, _OFFSET = (attrgetter(name) for name in (
    "key", "size_bytes", "token_ids", "token_offset"))
_HEX = attrgetter("chunk_hash_hex")
_KEY_FIELDS = attrgetter("model_name", "cache_salt", "kv_rank", "object_group_id")


def chunk_hashes(entries: list[CacheEventEntry]) -> list[bytes]:
    """Each entry's (validated) hex chunk hash as bytes; of one length, all decoded at
    once."""
    hexes = [key.chunk_hash_hex for key in map(_KEY, entries)]
    if len(set(map(len, hexes))) != 1:
        return [bytes.fromhex(text) for text in hexes]
    return np.frombuffer(bytes.fromhex("".join(hexes)),
                         dtype=np.dtype((np.void, len(hexes[0]) // 2))).tolist()


def store_batch(batch: CacheEventBatch, table: "BindingTable", held: JournaledSet,
                placements: Placements, writer, store_one) -> None:
    """A STORE batch's entries in order: the runs `store_runs` finds in bulk, the entries
    between them one by one (`store_one(entry, chunk_hash, place_no, held)`:
    `Bindings._store`)."""
    entries = batch.entries
    hashes = chunk_hashes(entries)
    runs = store_runs(entries, hashes, table, writer)
    tokens = run_tokens(entries, runs, writer is not None)
    for start, stop, bulk in runs:
        if bulk:
            store_new_chunks(batch, entries[start:stop], hashes[start:stop],
                             tokens.get(start), table, held, placements, writer)
            continue
        for i in range(start, stop):
            entry = entries[i]
            store_one(entry, hashes[i], placements.place_no(batch, entry.size_bytes), held)


def store_runs(entries: list[CacheEventEntry], hashes: list[bytes], table: "BindingTable",
               writer) -> list[tuple[int, int, bool]]:
    """A STORE batch's entries as maximal runs `(start, stop, True)` the bulk path can take
    and the entries between them `(start, stop, False)`, in order. A bulk run's entries
    name chunks absent from `table` and from the batch before them, under one key but for
    the hash, of one size, with token lists of one length (arrays: every id in uint32,
    `TokenIds`) that is none or a chunk when blend lookup is on (`writer` set): anything
    else is counted, warned of, or merged with what the chunk holds, entry by entry.
    A few passes over the batch in C, then O(runs)."""
    count = len(entries)
    fields = list(map(_KEY_FIELDS, map(_KEY, entries)))
    sizes = list(map(_SIZE, entries))
    tokens = list(map(_TOKENS, entries))
    lengths = list(map(len, tokens))
    cuts = {0, count}  # where a run may start: the key, size or length changes
    for values in (fields, sizes, lengths):
        cuts.update(compress(range(1, count), map(ne, values[1:], values)))
    alone = _one_by_one(hashes, tokens, lengths, table, writer)
    cuts.update(alone)
    cuts.update(i + 1 for i in alone)
    runs: list[tuple[int, int, bool]] = []
    bounds = sorted(cuts)
    for start, stop in zip(bounds, bounds[1:]):
        bulk = start not in alone  # an entry alone is a run of its own
        if not bulk and runs and not runs[-1][2]:
            runs[-1] = (runs[-1][0], stop, False)
        else:
            runs.append((start, stop, bulk))
    return runs


def _one_by_one(hashes: list[bytes], tokens: list, lengths: list[int], table: "BindingTable",
                writer) -> set[int]:
    """The entries `store_runs` leaves to the entry-by-entry path (by position)."""
    alone: set[int] = set()
    alone.update(table.present(hashes))
    if len(set(hashes)) != len(hashes):  # a hash again: known by then
        seen: set[bytes] = set()
        for i, chunk_hash in enumerate(hashes):
            if chunk_hash in seen:
                alone.add(i)
            seen.add(chunk_hash)
    if set(map(type, tokens)) != {np.ndarray}:  # an id outside uint32: a list
        alone.update(i for i, ids in enumerate(tokens) if type(ids) is not np.ndarray)
    if writer is not None and not set(lengths) <= {0, writer.chunk_size}:
        alone.update(i for i, length in enumerate(lengths)  # not indexable: warned of
                     if length and length != writer.chunk_size)
    return alone


def run_tokens(entries: list[CacheEventEntry], runs: list[tuple[int, int, bool]],
               indexed: bool) -> dict[int, "RunTokens"]:
    """Per bulk run carrying tokens (by its start), its token lists converted: for the
    whole batch at once when they have one length (always, blend lookup on)."""
    spans = [(start, stop) for start, stop, bulk in runs
             if bulk and len(entries[start].token_ids)]
    if len({len(entries[start].token_ids) for start, _ in spans}) > 1:
        return {start: RunTokens(entries[start:stop], indexed) for start, stop in spans}
    if not spans:
        return {}
    whole = RunTokens(entries if spans == [(0, len(entries))] else
                      [e for start, stop in spans for e in entries[start:stop]], indexed)
    found, first = {}, 0
    for start, stop in spans:
        found[start] = whole.part(first, first + stop - start)
        first += stop - start
    return found


class RunTokens:
    """Bulk entries' token lists (of one length) as rows of one array, each row's bytes,
    and with blend lookup on (`indexed`) their offsets and binding contents (the digest
    of the tokens once indexed, at a known offset, else the tokens:
    `Bindings._fill_content`)."""

    __slots__ = ("rows", "row_bytes", "offsets", "positions", "contents")

    def __init__(self, entries: list[CacheEventEntry], indexed: bool) -> None:
        lists = list(map(_TOKENS, entries))
        self.rows = np.concatenate(lists).reshape(len(lists), len(lists[0]))
        self.row_bytes = self.rows.view(
            np.dtype((np.void, self.rows.shape[1] * self.rows.itemsize))).ravel().tolist()
        self.offsets = self.positions = self.contents = None
        if indexed:
            self.offsets = shared_offsets(list(map(_OFFSET, entries)))
            self.positions = np.array(self.offsets, dtype=np.int64)
            self.contents = (list(map(digest, self.row_bytes)) if min(self.offsets) >= 0
                             else [digest(row) if offset >= 0 else row
                                   for row, offset in zip(self.row_bytes, self.offsets)])

    def part(self, start: int, stop: int) -> "RunTokens":
        part = RunTokens.__new__(RunTokens)
        part.rows, part.row_bytes = self.rows[start:stop], self.row_bytes[start:stop]
        part.offsets = part.positions = part.contents = None
        if self.offsets is not None:
            part.offsets, part.contents = self.offsets[start:stop], self.contents[start:stop]
            part.positions = self.positions[start:stop]
        return part


def store_new_chunks(batch: CacheEventBatch, entries: list[CacheEventEntry],
                     hashes: list[bytes], tokens: RunTokens | None, table: "BindingTable",
                     held: JournaledSet, placements: Placements, writer) -> None:
    """Record a bulk run of `store_runs` (`hashes`: its entries' chunk hashes, `tokens`
    theirs from `run_tokens`): their bindings, their placements, `held` (the emitter's
    chunks), the index adds."""
    key_no = placements.key_no(entries[0].key)
    holds = placements.add_first(key_no, placements.place_no(batch, entries[0].size_bytes),
                                 len(hashes))
    if tokens is None:  # no tokens: nothing known of the content, nothing indexed
        table.insert_absent(hashes, repeat((None, UNKNOWN_TOKEN_OFFSET, holds, (), None)))
    elif writer is None:  # blend lookup off: the tokens are kept to be shown
        table.insert_absent(hashes, zip(repeat(None), repeat(UNKNOWN_TOKEN_OFFSET),
                                        repeat(holds), repeat(()), tokens.row_bytes))
    else:
        # Not in `held` yet: most will be frozen, which lists them no more (binding_table).
        table.insert_run(hashes, tokens.contents, tokens.offsets, tokens.positions, holds)
        _add_rows(writer, tokens, hashes, placements.key_ns[key_no])
        return
    held.add_all(hashes)


def _add_rows(writer, tokens: RunTokens, hashes: list[bytes], namespace) -> None:
    """The chunks with a known offset join the index, for the key's namespace."""
    rows, positions = tokens.rows, tokens.positions
    if min(tokens.offsets) < 0:
        kept = np.flatnonzero(positions >= 0)
        if not kept.size:
            return
        rows, positions = rows[kept], positions[kept]
        hashes = [hashes[i] for i in kept.tolist()]
    writer.add_rows(rows, hashes, positions, namespace)
