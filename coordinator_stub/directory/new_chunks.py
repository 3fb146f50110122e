"""A STORE batch of chunks the directory does not hold yet, recorded in bulk: the common
batch (a serving process reports the chunks it just stored) at a few operations per batch
instead of a dozen calls per entry. It records what the entry-by-entry path
(`Bindings._store`) would; tests/test_coordinator_directory_bulk.py holds the two to the
same state over random batches. Also `digest`, what a binding keeps of indexed tokens.
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter

import numpy as np

from blend_wire import UNKNOWN_TOKEN_OFFSET, CacheEventBatch
from coordinator_stub.directory.journal import JournaledDict, JournaledSet
from coordinator_stub.directory.placements import Placements

#: The digest of indexed tokens (native uint32 bytes) a binding keeps. Only ever compared
#: within this process: the per-process randomised `hash` is right, and a builtin, so a
#: batch's digests are taken without a Python call each.
digest = hash

_KEY, _SIZE, _TOKENS, _OFFSET = (attrgetter(name) for name in (
    "key", "size_bytes", "token_ids", "token_offset"))
_HEX = attrgetter("chunk_hash_hex")
_KEY_FIELDS = attrgetter("model_name", "cache_salt", "kv_rank", "object_group_id")


def store_new_chunks(batch: CacheEventBatch, table: JournaledDict, held: JournaledSet,
                     placements: Placements, writer) -> bool:
    """Record a STORE batch whose entries name chunks new to the directory (absent from
    `table`, each once), one key but for the chunk hash, one size, and token lists of one
    length (with blend lookup on, `writer` set: none, or a chunk): their bindings, their
    placements, `held` (the emitter's chunks), the index adds. False, and nothing changed,
    for any other batch."""
    entries = batch.entries
    keys = list(map(_KEY, entries))
    if (not keys or len(set(map(_KEY_FIELDS, keys))) != 1
            or len(set(map(_SIZE, entries))) != 1):
        return False
    hashes = _chunk_hashes(list(map(_HEX, keys)))
    if len(set(hashes)) != len(hashes) or not table.keys().isdisjoint(hashes):
        return False
    token_lists = list(map(_TOKENS, entries))
    if set(map(type, token_lists)) != {np.ndarray} or len(set(map(len, token_lists))) != 1:
        return False  # an id outside uint32 (a list), or lists of several lengths
    length = len(token_lists[0])
    if writer is not None and length not in (0, writer.chunk_size):
        return False  # not indexable: counted and warned of entry by entry
    rows = np.concatenate(token_lists).reshape(len(entries), length) if length else None
    if rows is not None and rows.dtype != np.uint32:
        return False
    key_no = placements.key_no(keys[0])
    holds = placements.add_first(key_no, placements.place_no(batch, entries[0].size_bytes),
                                 len(hashes))
    if rows is None:  # no tokens: nothing known of the content, nothing indexed
        table.insert_absent(hashes, repeat((None, UNKNOWN_TOKEN_OFFSET, holds, (), None)))
    elif writer is None:  # blend lookup off: the tokens are kept to be shown
        table.insert_absent(hashes, zip(repeat(None), repeat(UNKNOWN_TOKEN_OFFSET),
                                        repeat(holds), repeat(()), _row_bytes(rows)))
    else:
        offsets = list(map(_OFFSET, entries))
        table.insert_absent(hashes, zip(_contents(rows, offsets), offsets, repeat(holds),
                                        repeat(()), repeat(None)))
        _add_rows(writer, rows, hashes, offsets, placements.key_ns[key_no])
    held.add_all(hashes)
    return True


def _chunk_hashes(hexes: list[str]) -> list[bytes]:
    """Each (validated) hex chunk hash as bytes: of one length, all decoded at once."""
    if len(set(map(len, hexes))) != 1:
        return [bytes.fromhex(text) for text in hexes]
    return np.frombuffer(bytes.fromhex("".join(hexes)),
                         dtype=np.dtype((np.void, len(hexes[0]) // 2))).tolist()


def _row_bytes(rows: np.ndarray) -> list[bytes]:
    """Each row of a contiguous array as bytes (what `tobytes()` of it gives)."""
    return rows.view(np.dtype((np.void, rows.shape[1] * rows.itemsize))).ravel().tolist()


def _contents(rows: np.ndarray, offsets: list[int]) -> list:
    """A binding's content per chunk STOREd with tokens: their digest once indexed (a
    known offset), else the tokens themselves (`Bindings._fill_content`)."""
    tokens = _row_bytes(rows)
    if min(offsets) >= 0:
        return list(map(digest, tokens))
    return [digest(row) if offset >= 0 else row for row, offset in zip(tokens, offsets)]


def _add_rows(writer, rows: np.ndarray, hashes: list[bytes], offsets: list[int],
              namespace) -> None:
    """The chunks with a known offset join the index, for the key's namespace."""
    positions = np.array(offsets, dtype=np.int64)
    known = positions >= 0
    if not known.all():
        kept = np.flatnonzero(known)
        rows, positions = rows[kept], positions[kept]
        hashes = [hashes[i] for i in kept.tolist()]
    if len(hashes):
        writer.add_rows(rows, hashes, positions, namespace)
