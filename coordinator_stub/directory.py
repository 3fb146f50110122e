"""The key directory: where every stored object lives, and what content each chunk holds.

State (all guarded by `self._lock`, the directory lock):
- placements: per object key, the places `(instance_id, tier, backend)` holding it. A key
  is `(chunk_hash, namespace, kv_rank, object_group_id)`; its namespace is
  `(model_name, cache_salt, world_size)` (WIRE.md). A key with no placement is forgotten.
- bindings: one per `chunk_hash` that has at least one key: the chunk's content (exactly
  `chunk_size` tokens, or unknown) and its stored offset (or -1, unknown). A binding with
  no key left is forgotten, content and all.
- per instance, the chunk hashes it holds a placement of, so a restart is fenced
  without scanning the directory.
- the ingest gate's cursors (`IngestGate`): admitting a batch and applying it are one step.

The blend index (`local_matcher.ContentIndex`) is a derived view of the bindings, and
only this module writes it (through `_IndexWriter`). Each step of DESIGN.md's lifecycle
table is one method below (`_fill_content`, `_move_offset`, `_claim_for`, `_release`, ...).
Invariant, after every batch applied: a chunk is in the index iff its binding has content
and an offset >= 0, and then the namespaces claiming it are exactly those of its keys.
The offset is the one carried by the latest STORE with usable `token_ids`; a STORE
without them (none, the wrong length, or an id outside uint32) records its placement
and leaves content and offset as they were.

Lock order: directory -> index, never the other way (the index never calls out). Lookups
go to the index directly, without the directory lock, so they never wait for ingest.

With blend lookup off, no content is recorded or hashed and no index exists. Enabling
it later creates an empty index; content recorded from then on is indexed, nothing from
before is back-filled.

Representation (why it looks the way it does): a binding is one tuple
`(content, offset, holds)`. `holds` is, for a chunk with up to `_FEW` placements (nearly
all), a flat tuple of small-int pairs `(key_no, place_no, key_no, place_no, ...)`,
numbering keys and places through interning tables; beyond that, a `_ManyKeys`, whose
dicts make adding or removing one key O(1) however many keys (object groups, ranks) one
chunk hash has. Atom-only tuples are untracked by Python's cyclic garbage collector, so a
directory of millions of chunks adds nothing to a GC pass (which would otherwise stall
every request for a quarter second at 200k chunks), and they are several times smaller
than per-chunk objects, dicts and sets.

`content` is None (unknown), the tokens as `bytes` (native uint32) while the chunk is
not indexed (no offset), or, for an indexed chunk, only an `int` digest of them: the
tokens are kept once, in the index, and fetched back (`ContentIndex.tokens_of`) for the
rare steps that need them (claiming an indexed chunk for another namespace, moving its
offset, un-indexing it).
"""

from __future__ import annotations

import logging
import struct
import threading

import numpy as np

from coordinator_stub.gate import IngestGate, Verdict
from blend_wire import (
    UNKNOWN_TOKEN_OFFSET,
    BlendNamespace,
    CacheEventBatch,
    CacheEventEntry,
    EncodedObjectKey,
    EventsReply,
)

log = logging.getLogger(__name__)

#: `(instance_id, tier, backend)`: one place an object is held.
Placement = tuple[str, str, str]

#: Placements a binding keeps in a flat tuple (scanned); past this, a `_ManyKeys`.
_FEW = 8

Content = bytes | int | None


def _digest(tokens: bytes) -> int:
    # Only ever compared within this process: the per-process randomised hash is right.
    return hash(tokens)


class _ManyKeys:
    """The placements of one chunk hash with many keys (e.g. thousands of object groups).

    `places[key_no]`: the place numbers holding that key; `keys_in[namespace]`: how many
    of the keys belong to it; `placements_of[instance_id]`: how many placements the
    instance holds. Every update is O(1) in the number of keys. Rare, so its GC tracking
    does not matter."""

    __slots__ = ("places", "keys_in", "placements_of", "count")

    def __init__(self) -> None:
        self.places: dict[int, tuple[int, ...]] = {}
        self.keys_in: dict[BlendNamespace, int] = {}
        self.placements_of: dict[str, int] = {}
        self.count = 0


class _IndexWriter:
    """The directory's only path to the index: adds are buffered and sent per namespace
    with one `add_many` (one lock acquisition, one kernel call) instead of one per chunk.

    Order is preserved where it matters: a buffered add for a chunk hash is never
    reordered with another operation on the same hash, because any add that would
    change a buffered one (other content or offset) and every removal flush first.
    Adds of distinct hashes commute, so grouping them by namespace changes nothing.
    Called only under the directory lock, and flushed before the lock is released.
    """

    def __init__(self, index, chunk_size: int) -> None:
        self.index = index
        self.chunk_size = chunk_size
        self._pending: dict[bytes, tuple[bytes, int]] = {}
        self._groups: dict[BlendNamespace, tuple[list, list, list]] = {}

    def add(self, tokens: bytes, chunk_hash: bytes, offset: int,
            namespace: BlendNamespace) -> None:
        buffered = self._pending.get(chunk_hash)
        if buffered is not None and (buffered[1] != offset or buffered[0] != tokens):
            self.flush()
        self._pending[chunk_hash] = (tokens, offset)
        group = self._groups.get(namespace)
        if group is None:
            group = self._groups[namespace] = ([], [], [])
        group[0].append(tokens)
        group[1].append(chunk_hash)
        group[2].append(offset)

    def remove_claim(self, chunk_hash: bytes, namespace: BlendNamespace) -> None:
        self.flush()
        self.index.remove_claim(None, chunk_hash, namespace)

    def remove_chunk(self, chunk_hash: bytes) -> None:
        self.flush()
        self.index.remove_chunk(None, chunk_hash)

    def tokens_of(self, chunk_hash: bytes) -> bytes | None:
        """The indexed content of a chunk, including one still buffered here."""
        buffered = self._pending.get(chunk_hash)
        if buffered is not None:
            return buffered[0]
        tokens = self.index.tokens_of(chunk_hash)
        return None if tokens is None else np.asarray(tokens, dtype=np.uint32).tobytes()

    def flush(self) -> None:
        if not self._groups:
            return
        groups, self._groups, self._pending = self._groups, {}, {}
        for namespace, (contents, hashes, offsets) in groups.items():
            rows = np.frombuffer(b"".join(contents), dtype=np.uint32).reshape(
                len(contents), self.chunk_size)
            self.index.add_many(rows, hashes, offsets, namespace)


class KeyDirectory:
    """Placements, token bindings and the blend index derived from them. Thread-safe."""

    def __init__(self, chunk_size: int = 256, probe_stride: int = 1,
                 enable_blend_lookup: bool = False) -> None:
        self.chunk_size = chunk_size
        self.probe_stride = probe_stride
        # Token ids to native uint32 bytes, the same layout as numpy's: 3x faster than
        # going through np.array, and it refuses ids outside uint32 (struct.error).
        self._pack_tokens = struct.Struct(f"={chunk_size}I").pack
        self._lock = threading.Lock()
        self._gate = IngestGate()
        self._index = None  # ContentIndex once blend lookup is on
        self._writer: _IndexWriter | None = None  # the one writer of self._index
        self._bindings: dict[bytes, tuple] = {}
        self._held_by: dict[str, set[bytes]] = {}
        # Interning tables: keys and places are numbered once and referred to by number.
        self._key_nos: dict[tuple[str, str, int, int], int] = {}
        self._key_ns: list[BlendNamespace] = []  # namespace of each key number
        self._namespaces: dict[BlendNamespace, BlendNamespace] = {}
        self._place_nos: dict[Placement, int] = {}
        self._places: list[Placement] = []
        self._capacity: dict[Placement, tuple[int, int]] = {}
        self._num_keys = 0
        self._num_placements = 0
        self._counters = dict.fromkeys(
            ("batches_applied", "batches_duplicate", "batches_stale", "instances_fenced",
             "entries_stored", "entries_deleted", "entries_accessed", "deletes_unknown",
             "token_lists_wrong_length", "token_lists_out_of_range"), 0)
        if enable_blend_lookup:
            self.enable_blend_lookup()

    # --- blend lookup switch and matching -------------------------------------------------

    @property
    def blend_enabled(self) -> bool:
        return self._index is not None

    def enable_blend_lookup(self) -> None:
        """Start indexing content from now on. One-way; earlier chunks are not back-filled."""
        # Imported here: numba compiles (or loads) the index kernels only when asked for.
        from local_matcher import ContentIndex

        with self._lock:
            if self._index is None:
                index = ContentIndex(chunk_size=self.chunk_size, probe_stride=self.probe_stride)
                self._writer = _IndexWriter(index, self.chunk_size)
                self._index = index

    def match(self, tokens: np.ndarray, namespace: BlendNamespace) -> list:
        """Blend matches of `namespace` in `tokens` (a list of `BlendMatch`).

        Deliberately not under the directory lock: the index is thread-safe and always a
        consistent view of the bindings as of some applied entry.
        """
        index = self._index
        if index is None or tokens.size < self.chunk_size:
            return []
        return index.match(tokens, namespace)

    # --- ingest -----------------------------------------------------------------------

    def ingest(self, batches: list[CacheEventBatch]) -> EventsReply:
        """Gate and apply validated batches, in order. Counts are of batches."""
        applied = duplicates = stale = 0
        with self._lock:
            for batch in batches:
                verdict = self._gate.admit(batch.instance_id, batch.incarnation, batch.seq)
                if verdict is Verdict.DUPLICATE:
                    duplicates += 1
                    continue
                if verdict is Verdict.STALE:
                    stale += 1
                    continue
                try:
                    if verdict is Verdict.FENCE:
                        self._fence(batch.instance_id)
                    self._apply(batch)
                finally:
                    if self._writer is not None:
                        self._writer.flush()
                applied += 1
            self._counters["batches_applied"] += applied
            self._counters["batches_duplicate"] += duplicates
            self._counters["batches_stale"] += stale
        return EventsReply(applied=applied, duplicates=duplicates, stale=stale)

    def _apply(self, batch: CacheEventBatch) -> None:
        place = (batch.instance_id, batch.tier, batch.backend)
        place_no = self._place_nos.get(place)
        if place_no is None:
            place_no = self._place_nos[place] = len(self._places)
            self._places.append(place)
        kind = batch.event_type
        if kind == "store":
            held = self._held_by.get(batch.instance_id)
            if held is None:
                held = self._held_by[batch.instance_id] = set()
            for entry in batch.entries:
                self._store(entry, place_no, held)
            self._counters["entries_stored"] += len(batch.entries)
        elif kind == "delete":
            for entry in batch.entries:
                self._delete(entry.key, place_no)
            self._counters["entries_deleted"] += len(batch.entries)
        elif kind == "config":
            self._capacity[place] = (batch.capacity_bytes, batch.capacity_revision)
        else:  # "access": recency only, which this directory does not rank by
            self._counters["entries_accessed"] += len(batch.entries)

    def _key_no(self, key: EncodedObjectKey) -> int:
        raw = (key.model_name, key.cache_salt, key.kv_rank, key.object_group_id)
        key_no = self._key_nos.get(raw)
        if key_no is None:
            namespace = key.namespace
            namespace = self._namespaces.setdefault(namespace, namespace)
            key_no = self._key_nos[raw] = len(self._key_ns)
            self._key_ns.append(namespace)
        return key_no

    # --- the lifecycle table, one step per row ----------------------------------------------

    def _store(self, entry: CacheEventEntry, place_no: int, held: set[bytes]) -> None:
        """One STORE entry: record the placement, then the binding's content and offset."""
        key_no = self._key_no(entry.key)
        chunk_hash = bytes.fromhex(entry.key.chunk_hash_hex)
        binding = self._bindings.get(chunk_hash)
        content, offset, holds = binding if binding is not None else (
            None, UNKNOWN_TOKEN_OFFSET, ())
        holds, new_claim = self._add_placement(holds, key_no, place_no)
        held.add(chunk_hash)
        if self._writer is not None:  # blend lookup off: no content is recorded (or hashed)
            stamped = self._stamped_tokens(entry)
            claimant = self._key_ns[key_no] if new_claim else None
            if stamped is not None:
                content, offset = self._stamp(chunk_hash, content, offset, holds, stamped,
                                              entry.token_offset, claimant)
            elif claimant is not None and self._indexed(content, offset):
                # STORE without tokens, content known: claim it for the key's namespace.
                self._claim_for(chunk_hash, content, offset, claimant)
        self._bindings[chunk_hash] = (content, offset, holds)

    def _stamped_tokens(self, entry: CacheEventEntry) -> bytes | None:
        """The entry's tokens as native uint32 bytes, or None when it carries no usable
        content (then the STORE is handled as a token-less one)."""
        if not entry.token_ids:
            return None
        if len(entry.token_ids) != self.chunk_size:  # not indexable at this chunk size
            self._counters["token_lists_wrong_length"] += 1
            return None
        try:
            return self._pack_tokens(*entry.token_ids)
        except struct.error:  # an id outside uint32: a miss, not a failed batch (WIRE.md)
            self._counters["token_lists_out_of_range"] += 1
            return None

    @staticmethod
    def _indexed(content: Content, offset: int) -> bool:
        return content is not None and offset >= 0

    def _stamp(self, chunk_hash: bytes, content: Content, offset: int, holds,
               tokens: bytes, new_offset: int, claimant: BlendNamespace | None
               ) -> tuple[Content, int]:
        """A STORE with tokens: its content and offset become the binding's. `claimant`
        is the key's namespace if it is new to the chunk. Returns the binding's new
        (content, offset)."""
        if content is None:
            return self._fill_content(chunk_hash, holds, tokens, new_offset)
        same = tokens == content if type(content) is bytes else _digest(tokens) == content
        if not same:
            # New text under a known hash: the old position belonged to the old text.
            if self._indexed(content, offset):
                self._writer.remove_chunk(chunk_hash)
            return self._fill_content(chunk_hash, holds, tokens, new_offset)
        if new_offset != offset:
            return self._move_offset(chunk_hash, content, offset, holds, tokens, new_offset)
        if claimant is not None and self._indexed(content, offset):
            # Same content, same offset, a namespace new to the chunk: it claims it.
            self._claim_for(chunk_hash, content, offset, claimant)
        return content, offset

    def _fill_content(self, chunk_hash: bytes, holds, tokens: bytes, offset: int
                      ) -> tuple[Content, int]:
        """STORE that first fills a binding's content (or replaces it): with an offset,
        every namespace already on the binding claims it; -1 leaves it unindexed."""
        if offset < 0:
            return tokens, offset
        for namespace in self._namespaces_of(holds):
            self._writer.add(tokens, chunk_hash, offset, namespace)
        return _digest(tokens), offset

    def _move_offset(self, chunk_hash: bytes, content: Content, offset: int, holds,
                     tokens: bytes, new_offset: int) -> tuple[Content, int]:
        """STORE with the same tokens at another offset: it becomes the chunk's offset;
        -1 un-indexes the chunk (a match needs a position)."""
        if new_offset < 0:
            self._writer.remove_chunk(chunk_hash)
            return tokens, new_offset
        # Indexed or not before, every namespace on the binding claims it at the new
        # offset (re-adding a claimed chunk only moves its offset).
        return self._fill_content(chunk_hash, holds, tokens, new_offset)

    def _claim_for(self, chunk_hash: bytes, content: Content, offset: int,
                   namespace: BlendNamespace) -> None:
        """Claim an indexed chunk for one more namespace (idempotent in the index)."""
        tokens = content if type(content) is bytes else self._writer.tokens_of(chunk_hash)
        if tokens is None:  # cannot happen while the invariant holds
            log.error("chunk %s is indexed but the index has no content for it",
                      chunk_hash.hex())
            return
        self._writer.add(tokens, chunk_hash, offset, namespace)

    def _delete(self, key: EncodedObjectKey, place_no: int) -> None:
        """One DELETE entry: drop the placement; release what it was the last of."""
        # Looked up, not interned: deleting what was never stored must not grow the table.
        key_no = self._key_nos.get(
            (key.model_name, key.cache_salt, key.kv_rank, key.object_group_id))
        chunk_hash = bytes.fromhex(key.chunk_hash_hex)
        binding = self._bindings.get(chunk_hash)
        removed = None
        if binding is not None and key_no is not None:
            removed = self._remove_placement(binding[2], key_no, place_no)
        if removed is None:
            self._counters["deletes_unknown"] += 1
            return
        holds, claim_gone, instance_gone = removed
        if instance_gone:
            self._held_by[self._places[place_no][0]].discard(chunk_hash)
        self._release(chunk_hash, binding, holds,
                      [self._key_ns[key_no]] if claim_gone else [])

    def _fence(self, instance_id: str) -> None:
        """Instance restarted: drop every placement it reported (and what they held)."""
        self._counters["instances_fenced"] += 1
        places = self._places
        for chunk_hash in self._held_by.pop(instance_id, ()):
            binding = self._bindings[chunk_hash]
            holds, lost = binding[2], []
            for key_no, place_no in self._placements_in(holds):
                if places[place_no][0] == instance_id:
                    holds, claim_gone, _ = self._remove_placement(holds, key_no, place_no)
                    if claim_gone:
                        lost.append(self._key_ns[key_no])
            self._release(chunk_hash, binding, holds, lost)

    def _release(self, chunk_hash: bytes, binding: tuple, holds, lost: list) -> None:
        """Placements gone: each namespace left without a key drops its claim (the last
        claim drops the occupant); a binding without placements is forgotten."""
        content, offset, _ = binding
        if self._writer is not None and self._indexed(content, offset):
            for namespace in lost:
                self._writer.remove_claim(chunk_hash, namespace)
        if holds:
            self._bindings[chunk_hash] = (content, offset, holds)
        else:
            del self._bindings[chunk_hash]

    # --- placements of one chunk (flat tuple, or _ManyKeys past _FEW) -------------------

    def _add_placement(self, holds, key_no: int, place_no: int) -> tuple[object, bool]:
        """Record `(key_no, place_no)`; returns (holds, whether the key's namespace is
        new to this chunk). Counts keys and placements."""
        key_ns, namespace = self._key_ns, self._key_ns[key_no]
        if type(holds) is tuple:
            new_key = new_claim = True
            for i in range(0, len(holds), 2):
                if holds[i] == key_no:
                    new_key = new_claim = False
                    if holds[i + 1] == place_no:
                        return holds, False
                elif key_ns[holds[i]] == namespace:
                    new_claim = False
            holds += (key_no, place_no)
            if len(holds) > 2 * _FEW:
                holds = self._many_keys(holds)
        else:
            places = holds.places.get(key_no)
            new_key = places is None
            if new_key:
                new_claim = namespace not in holds.keys_in
                holds.keys_in[namespace] = holds.keys_in.get(namespace, 0) + 1
                places = ()
            elif place_no in places:
                return holds, False
            else:
                new_claim = False
            holds.places[key_no] = places + (place_no,)
            instance = self._places[place_no][0]
            holds.placements_of[instance] = holds.placements_of.get(instance, 0) + 1
            holds.count += 1
        self._num_keys += new_key
        self._num_placements += 1
        return holds, new_claim

    def _remove_placement(self, holds, key_no: int, place_no: int):
        """Drop `(key_no, place_no)`: (holds, whether the key's namespace lost its last
        key here, whether the place's instance lost its last placement here), or None if
        there is no such placement. Counts keys and placements."""
        key_ns, places = self._key_ns, self._places
        instance = places[place_no][0]
        if type(holds) is tuple:
            for i in range(0, len(holds), 2):
                if holds[i] == key_no and holds[i + 1] == place_no:
                    break
            else:
                return None
            holds = holds[:i] + holds[i + 2:]
            key_gone = key_no not in holds[0::2]
            namespace = key_ns[key_no]
            claim_gone = key_gone and all(key_ns[k] != namespace for k in holds[0::2])
            instance_gone = all(places[p][0] != instance for p in holds[1::2])
        else:
            kept = holds.places.get(key_no, ())
            if place_no not in kept:
                return None
            kept = tuple(p for p in kept if p != place_no)
            key_gone = not kept
            claim_gone = False
            if key_gone:
                del holds.places[key_no]
                namespace = key_ns[key_no]
                holds.keys_in[namespace] -= 1
                if not holds.keys_in[namespace]:
                    del holds.keys_in[namespace]
                    claim_gone = True
            else:
                holds.places[key_no] = kept
            holds.placements_of[instance] -= 1
            instance_gone = not holds.placements_of[instance]
            if instance_gone:
                del holds.placements_of[instance]
            holds.count -= 1
            if holds.count <= _FEW // 2:  # small again: back to a flat tuple
                holds = tuple(v for k, p in self._placements_in(holds) for v in (k, p))
        self._num_keys -= key_gone
        self._num_placements -= 1
        return holds, claim_gone, instance_gone

    def _many_keys(self, flat: tuple[int, ...]) -> _ManyKeys:
        many = _ManyKeys()
        for i in range(0, len(flat), 2):
            key_no, place_no = flat[i], flat[i + 1]
            if key_no not in many.places:
                namespace = self._key_ns[key_no]
                many.keys_in[namespace] = many.keys_in.get(namespace, 0) + 1
            many.places[key_no] = many.places.get(key_no, ()) + (place_no,)
            instance = self._places[place_no][0]
            many.placements_of[instance] = many.placements_of.get(instance, 0) + 1
        many.count = len(flat) // 2
        return many

    @staticmethod
    def _placements_in(holds) -> list[tuple[int, int]]:
        """Every `(key_no, place_no)` of a chunk (a copy: safe to remove while iterating)."""
        if type(holds) is tuple:
            return list(zip(holds[0::2], holds[1::2]))
        return [(k, p) for k, places in holds.places.items() for p in places]

    def _namespaces_of(self, holds) -> list[BlendNamespace]:
        if type(holds) is not tuple:
            return list(holds.keys_in)
        found: list[BlendNamespace] = []
        for key_no in holds[0::2]:
            namespace = self._key_ns[key_no]
            if namespace not in found:
                found.append(namespace)
        return found

    # --- inspection ---------------------------------------------------------------------

    def stats(self) -> dict:
        """WIRE.md's stats object (`num_keys`, `num_placements`, `blend`) plus counters."""
        with self._lock:
            blend = self._index.stats() if self._index is not None else dict.fromkeys(
                ("num_contents", "num_chunks", "num_claims", "num_namespaces",
                 "table_size", "bytes"), 0)
            return {
                "num_keys": self._num_keys,
                "num_placements": self._num_placements,
                "num_bindings": len(self._bindings),
                "num_instances": len(self._gate),
                "blend_enabled": self._index is not None,
                "chunk_size": self.chunk_size,
                "blend": blend,
                "counters": dict(self._counters),
                "capacity": [
                    {"instance_id": place[0], "tier": place[1], "backend": place[2],
                     "capacity_bytes": value[0], "capacity_revision": value[1]}
                    for place, value in self._capacity.items()],
            }
