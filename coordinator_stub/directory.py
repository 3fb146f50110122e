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
only this module writes it (through `_IndexWriter`), as DESIGN.md's lifecycle table says.
Invariant, after every batch applied: a chunk is in the index iff its binding has content
and an offset >= 0, and then the namespaces claiming it are exactly those of its keys.

Lock order: directory -> index, never the other way (the index never calls out). Lookups
go to the index directly, without the directory lock, so they never wait for ingest.

With blend lookup off, no content is recorded or hashed and no index exists. Enabling
it later creates an empty index; content recorded from then on is indexed, nothing from
before is back-filled.

Representation (why it looks the way it does): a binding is one tuple
`(content, offset, holds)` of atoms, where `holds` is a flat tuple of small-int pairs
`(key_no, place_no, key_no, place_no, ...)`, one pair per placement, numbering keys and
places through interning tables. Atom-only tuples are untracked by Python's cyclic
garbage collector, so a directory of millions of chunks adds nothing to a GC pass (which
would otherwise stall every request for a quarter second at 200k chunks), and they are
several times smaller than per-chunk objects, dicts and sets.

`content` is None (unknown), the tokens as `bytes` (native uint32) while the chunk is
not indexed (no offset yet), or, for an indexed chunk, only an `int` digest of them: the
tokens are kept once, in the index, and fetched back (`ContentIndex.tokens_of`) for the
rare operations that need them (a token-less STORE claiming the chunk for another
namespace, or moving its offset).
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
    EncodedObjectKey,
    EventsReply,
)

log = logging.getLogger(__name__)

#: `(instance_id, tier, backend)`: one place an object is held.
Placement = tuple[str, str, str]

# A binding: (content: bytes | int | None, offset: int, holds: tuple[int, ...]).
_CONTENT, _OFFSET, _HOLDS = 0, 1, 2


def _digest(tokens: bytes) -> int:
    # Only ever compared within this process: the per-process randomised hash is right.
    return hash(tokens)


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

    def remove_claim(self, content: bytes | int, chunk_hash: bytes,
                     namespace: BlendNamespace) -> None:
        self.flush()
        self.index.remove_claim(_tokens_or_none(content), chunk_hash, namespace)

    def remove_chunk(self, content: bytes | int, chunk_hash: bytes) -> None:
        self.flush()
        self.index.remove_chunk(_tokens_or_none(content), chunk_hash)

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


def _tokens_or_none(content: bytes | int) -> np.ndarray | None:
    # None tells the index "whatever content the chunk has": all a digest can say.
    return np.frombuffer(content, dtype=np.uint32) if type(content) is bytes else None


class KeyDirectory:
    """Placements, token bindings and the blend index derived from them. Thread-safe."""

    def __init__(self, chunk_size: int = 256, probe_stride: int = 1,
                 enable_blend_lookup: bool = False) -> None:
        self.chunk_size = chunk_size
        self.probe_stride = probe_stride
        # Token ids (already checked to fit uint32 by the wire decoder) to native uint32
        # bytes, the same layout as numpy's: 3x faster than going through np.array.
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
             "token_lists_wrong_length"), 0)
        if enable_blend_lookup:
            self.enable_blend_lookup()

    # --- blend lookup switch and matching -------------------------------------------------

    @property
    def blend_enabled(self) -> bool:
        return self._index is not None

    def enable_blend_lookup(self) -> None:
        """Start indexing content from now on. One-way; earlier chunks are not back-filled."""
        # Imported here: a coordinator without blend lookup never loads numba.
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
            self._store(batch, place_no)
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

    def _store(self, batch: CacheEventBatch, place_no: int) -> None:
        bindings, key_ns, writer = self._bindings, self._key_ns, self._writer
        held = self._held_by.get(batch.instance_id)
        if held is None:
            held = self._held_by[batch.instance_id] = set()
        chunk_size, pack_tokens = self.chunk_size, self._pack_tokens
        for entry in batch.entries:
            key_no = self._key_no(entry.key)
            namespace = key_ns[key_no]
            chunk_hash = bytes.fromhex(entry.key.chunk_hash_hex)
            binding = bindings.get(chunk_hash)
            if binding is None:
                content, offset, holds = None, UNKNOWN_TOKEN_OFFSET, (key_no, place_no)
                new_claim = True
                self._num_keys += 1
                self._num_placements += 1
            else:
                content, offset, holds = binding
                new_claim = True
                new_key = True
                for i in range(0, len(holds), 2):
                    if holds[i] == key_no:
                        new_key = new_claim = False
                        if holds[i + 1] == place_no:
                            break
                    elif key_ns[holds[i]] == namespace:
                        new_claim = False
                else:  # this key is not held here yet
                    holds += (key_no, place_no)
                    self._num_placements += 1
                    self._num_keys += new_key
            held.add(chunk_hash)
            if writer is None:
                # Blend lookup off: no content is recorded (or hashed).
                if entry.token_offset >= 0:
                    offset = entry.token_offset
                bindings[chunk_hash] = (content, offset, holds)
                continue
            # --- content and offset, and the index actions of the lifecycle table ---
            stamped = None
            if entry.token_ids:
                if len(entry.token_ids) == chunk_size:
                    stamped = pack_tokens(*entry.token_ids)
                else:  # not indexable at this chunk size: handled as a token-less store
                    self._counters["token_lists_wrong_length"] += 1
            was_indexed = content is not None and offset >= 0
            changed = stamped is not None and content is not None and (
                stamped != content if type(content) is bytes else _digest(stamped) != content)
            tokens = stamped if stamped is not None else content
            moved = False
            if changed:
                # New text under a known hash: the old position belonged to the old text.
                if was_indexed:
                    writer.remove_chunk(content, chunk_hash)
                offset = entry.token_offset
            elif entry.token_offset >= 0 and entry.token_offset != offset:
                # -1 means "not reported", so it never erases an offset reported before.
                offset = entry.token_offset
                moved = True
            if tokens is None or offset < 0:
                # Content unknown (a later stamped store repairs it), or no position.
                bindings[chunk_hash] = (tokens, offset, holds)
                continue
            if changed or not was_indexed:
                # New content, or content/position just completed: every namespace holding
                # a key of this chunk claims it.
                for claimant in self._namespaces_of(holds):
                    writer.add(tokens, chunk_hash, offset, claimant)
            elif new_claim or moved:
                # Content known already (a token-less store lands here too): claim it for
                # this namespace at once; a moved offset is updated by the same call.
                if type(tokens) is not bytes:
                    tokens = writer.tokens_of(chunk_hash)
                if tokens is None:  # cannot happen while the invariant holds
                    log.error("chunk %s is indexed but the index has no content for it",
                              chunk_hash.hex())
                    tokens = content
                else:
                    writer.add(tokens, chunk_hash, offset, namespace)
            if type(tokens) is bytes:  # indexed now: the index holds the tokens
                tokens = _digest(tokens)
            bindings[chunk_hash] = (tokens, offset, holds)
        self._counters["entries_stored"] += len(batch.entries)

    def _namespaces_of(self, holds: tuple[int, ...]) -> list[BlendNamespace]:
        found: list[BlendNamespace] = []
        for i in range(0, len(holds), 2):
            namespace = self._key_ns[holds[i]]
            if namespace not in found:
                found.append(namespace)
        return found

    def _delete(self, key: EncodedObjectKey, place_no: int) -> None:
        # Looked up, not interned: deleting what was never stored must not grow the table.
        key_no = self._key_nos.get(
            (key.model_name, key.cache_salt, key.kv_rank, key.object_group_id))
        chunk_hash = bytes.fromhex(key.chunk_hash_hex)
        binding = self._bindings.get(chunk_hash)
        holds = () if binding is None or key_no is None else binding[_HOLDS]
        for i in range(0, len(holds), 2):
            if holds[i] == key_no and holds[i + 1] == place_no:
                break
        else:
            self._counters["deletes_unknown"] += 1
            return
        remaining = holds[:i] + holds[i + 2:]
        instance = self._places[place_no][0]
        if not any(self._places[remaining[j + 1]][0] == instance
                   for j in range(0, len(remaining), 2)):
            self._held_by[instance].discard(chunk_hash)
        self._replace_holds(chunk_hash, binding, remaining)

    def _fence(self, instance_id: str) -> None:
        """Drop every placement `instance_id` reported (it restarted and lost them)."""
        self._counters["instances_fenced"] += 1
        places = self._places
        for chunk_hash in self._held_by.pop(instance_id, ()):
            binding = self._bindings[chunk_hash]
            holds = binding[_HOLDS]
            remaining = tuple(value for i in range(0, len(holds), 2)
                              if places[holds[i + 1]][0] != instance_id
                              for value in holds[i:i + 2])
            self._replace_holds(chunk_hash, binding, remaining)

    def _replace_holds(self, chunk_hash: bytes, binding: tuple, remaining: tuple) -> None:
        """Shrink a binding's placements; release index claims of namespaces left keyless."""
        content, offset, holds = binding
        keys_before, keys_after = set(holds[0::2]), set(remaining[0::2])
        self._num_placements -= (len(holds) - len(remaining)) // 2
        self._num_keys -= len(keys_before) - len(keys_after)
        if self._writer is not None and content is not None and offset >= 0:
            lost = ({self._key_ns[k] for k in keys_before}
                    - {self._key_ns[k] for k in keys_after})
            # If the last claim goes, the index drops the occupant (and its content when
            # no other chunk shares it).
            for namespace in lost:
                self._writer.remove_claim(content, chunk_hash, namespace)
        if remaining:
            self._bindings[chunk_hash] = (content, offset, remaining)
        else:
            del self._bindings[chunk_hash]

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
