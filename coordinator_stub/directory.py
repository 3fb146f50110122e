"""The key directory: where every stored object lives, and what content each chunk holds.

State (all guarded by `self._lock`, the directory lock):
- placements: per object key, the places `(instance_id, tier, backend)` holding it. A key
  is identified by `(chunk_hash, namespace, kv_rank, object_group_id)`; its namespace is
  `(model_name, cache_salt, world_size)` (WIRE.md). A key with no placement is forgotten.
- bindings: one per `chunk_hash` that has at least one key: the chunk's content (exactly
  `chunk_size` tokens, or unknown) and its stored offset (or -1, unknown). A binding with
  no key left is forgotten, content and all.
- per instance, the keys it placed, so a restart can fence them without a scan.
- the ingest gate's cursors (`IngestGate`): admitting a batch and applying it are one step.

The blend index (`local_matcher.ContentIndex`) is a derived view of the bindings and only
this module writes it, exactly as DESIGN.md's lifecycle table says. Invariant, after
every entry applied: a chunk is in the index iff its binding has content and an offset
>= 0, and then the namespaces claiming it are exactly the namespaces of its keys.

Lock order: directory -> index, never the other way (the index never calls out). Lookups
go to the index directly, without the directory lock, so they never wait for ingest.

With blend lookup off, no content is recorded or hashed and no index exists. Enabling
it later creates an empty index; content recorded from then on is indexed, nothing from
before is back-filled.

Memory: the directory keeps its own copy of each indexed chunk's tokens (`bytes`,
4 * chunk_size) because `ContentIndex` can only re-claim a known chunk for a new namespace
(a token-less STORE) when given its tokens; everything else is a few small objects.
"""

from __future__ import annotations

import logging
import threading
from typing import Iterable

import numpy as np

from coordinator_stub.gate import IngestGate, Verdict
from plugin.wire import (
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
#: `(namespace, kv_rank, object_group_id)`: an object key without its chunk hash.
KeyId = tuple[BlendNamespace, int, int]


class _Binding:
    """What the directory knows about one chunk hash."""

    __slots__ = ("tokens", "offset", "keys")

    def __init__(self) -> None:
        self.tokens: bytes | None = None  # native uint32, exactly chunk_size of them
        self.offset: int = UNKNOWN_TOKEN_OFFSET
        # Placements per key, as a tuple: most keys have one, and a tuple is far
        # smaller than a set.
        self.keys: dict[KeyId, tuple[Placement, ...]] = {}

    @property
    def indexable(self) -> bool:
        return self.tokens is not None and self.offset >= 0

    def namespaces(self) -> Iterable[BlendNamespace]:
        return dict.fromkeys(key_id[0] for key_id in self.keys)

    def claims(self, namespace: BlendNamespace) -> bool:
        return any(key_id[0] == namespace for key_id in self.keys)


def _as_array(tokens: bytes) -> np.ndarray:
    return np.frombuffer(tokens, dtype=np.uint32)


class KeyDirectory:
    """Placements, token bindings and the blend index derived from them. Thread-safe."""

    def __init__(self, chunk_size: int = 256, probe_stride: int = 1,
                 enable_blend_lookup: bool = False) -> None:
        self.chunk_size = chunk_size
        self.probe_stride = probe_stride
        self._lock = threading.Lock()
        self._gate = IngestGate()
        self._index = None  # ContentIndex once blend lookup is on
        self._bindings: dict[bytes, _Binding] = {}
        self._placed: dict[str, set[tuple[bytes, KeyId]]] = {}
        # Interning tables: every key and placement of the same value shares one object,
        # so a million keys of a few namespaces cost a million references, not tuples.
        self._key_ids: dict[tuple[str, str, int, int], KeyId] = {}
        self._placements: dict[Placement, Placement] = {}
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
                self._index = ContentIndex(chunk_size=self.chunk_size,
                                           probe_stride=self.probe_stride)

    def match(self, tokens: np.ndarray, namespace: BlendNamespace) -> list:
        """Blend matches of `namespace` in `tokens` (a list of `BlendMatch`).

        Deliberately not under the directory lock: the index is thread-safe and its
        content is always a consistent view of the bindings as of some applied entry.
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
                if verdict is Verdict.FENCE:
                    self._fence(batch.instance_id)
                self._apply(batch)
                applied += 1
            self._counters["batches_applied"] += applied
            self._counters["batches_duplicate"] += duplicates
            self._counters["batches_stale"] += stale
        return EventsReply(applied=applied, duplicates=duplicates, stale=stale)

    def _apply(self, batch: CacheEventBatch) -> None:
        place = (batch.instance_id, batch.tier, batch.backend)
        place = self._placements.setdefault(place, place)
        kind = batch.event_type
        if kind == "store":
            for entry in batch.entries:
                self._store(entry, place)
            self._counters["entries_stored"] += len(batch.entries)
        elif kind == "delete":
            for entry in batch.entries:
                self._delete(entry, place)
            self._counters["entries_deleted"] += len(batch.entries)
        elif kind == "config":
            self._capacity[place] = (batch.capacity_bytes, batch.capacity_revision)
        else:  # "access": recency only, which this directory does not rank by
            self._counters["entries_accessed"] += len(batch.entries)

    def _key_id(self, key: EncodedObjectKey) -> KeyId:
        raw = (key.model_name, key.cache_salt, key.kv_rank, key.object_group_id)
        key_id = self._key_ids.get(raw)
        if key_id is None:
            key_id = self._key_ids[raw] = (key.namespace, key.kv_rank, key.object_group_id)
        return key_id

    def _store(self, entry: CacheEventEntry, place: Placement) -> None:
        key_id = self._key_id(entry.key)
        chunk_hash = bytes.fromhex(entry.key.chunk_hash_hex)
        binding = self._bindings.get(chunk_hash)
        if binding is None:
            binding = self._bindings[chunk_hash] = _Binding()
        namespace = key_id[0]
        places = binding.keys.get(key_id)
        if places is None:
            new_claim = not binding.claims(namespace)
            binding.keys[key_id] = (place,)
            self._num_keys += 1
            self._num_placements += 1
            self._placed_of(place[0]).add((chunk_hash, key_id))
        else:
            new_claim = False
            if place not in places:
                if not any(held[0] == place[0] for held in places):
                    self._placed_of(place[0]).add((chunk_hash, key_id))
                binding.keys[key_id] = places + (place,)
                self._num_placements += 1
        if self._index is None:
            if entry.token_offset >= 0:
                binding.offset = entry.token_offset
            return
        self._bind_content(chunk_hash, binding, entry, namespace, new_claim)

    def _bind_content(self, chunk_hash: bytes, binding: _Binding, entry: CacheEventEntry,
                      namespace: BlendNamespace, new_claim: bool) -> None:
        """Record the entry's content and offset, and bring the index in line (the table)."""
        tokens = None
        if entry.token_ids:
            if len(entry.token_ids) == self.chunk_size:
                tokens = np.array(entry.token_ids, dtype=np.uint32).tobytes()
            else:
                # Not indexable at this chunk size: handled as a token-less store.
                self._counters["token_lists_wrong_length"] += 1
                log.debug("chunk %s: %d tokens, not %d; content ignored",
                          entry.key.chunk_hash_hex, len(entry.token_ids), self.chunk_size)
        was_indexed = binding.indexable
        old_tokens = binding.tokens
        changed = tokens is not None and old_tokens is not None and tokens != old_tokens
        if tokens is not None:
            binding.tokens = tokens
        moved = False
        # -1 means "not reported", so it never erases an offset reported before.
        if entry.token_offset >= 0 and entry.token_offset != binding.offset:
            binding.offset = entry.token_offset
            moved = True
        if not binding.indexable:
            return  # content unknown (a later stamped store repairs it) or no position
        index = self._index
        if changed and was_indexed:
            index.remove_chunk(_as_array(old_tokens), chunk_hash)
        if changed or not was_indexed:
            # New content, or content/position just completed: every namespace holding
            # a key of this chunk claims it.
            content = _as_array(binding.tokens)
            for claimant in binding.namespaces():
                index.add(content, chunk_hash, binding.offset, claimant)
        elif new_claim or moved:
            # Content known already (a token-less store lands here too): claim it for
            # this namespace at once; a moved offset is updated by the same call.
            index.add(_as_array(binding.tokens), chunk_hash, binding.offset, namespace)

    def _delete(self, entry: CacheEventEntry, place: Placement) -> None:
        key_id = self._key_id(entry.key)
        chunk_hash = bytes.fromhex(entry.key.chunk_hash_hex)
        binding = self._bindings.get(chunk_hash)
        places = None if binding is None else binding.keys.get(key_id)
        if places is None or place not in places:
            self._counters["deletes_unknown"] += 1
            return
        keep = tuple(held for held in places if held != place)
        if not any(held[0] == place[0] for held in keep):
            self._placed[place[0]].discard((chunk_hash, key_id))
        self._drop_placements(chunk_hash, binding, key_id, places, keep)

    def _fence(self, instance_id: str) -> None:
        """Drop every placement `instance_id` reported (it restarted and lost them)."""
        self._counters["instances_fenced"] += 1
        for chunk_hash, key_id in self._placed.pop(instance_id, ()):
            binding = self._bindings[chunk_hash]
            places = binding.keys[key_id]
            keep = tuple(held for held in places if held[0] != instance_id)
            self._drop_placements(chunk_hash, binding, key_id, places, keep)

    def _drop_placements(self, chunk_hash: bytes, binding: _Binding, key_id: KeyId,
                         places: tuple[Placement, ...], keep: tuple[Placement, ...]) -> None:
        self._num_placements -= len(places) - len(keep)
        if keep:
            binding.keys[key_id] = keep
            return
        del binding.keys[key_id]
        self._num_keys -= 1
        namespace = key_id[0]
        if self._index is not None and binding.indexable and not binding.claims(namespace):
            # The namespace's last key of this chunk is gone; if it was the chunk's last
            # claim, the index drops the occupant (and the content if unshared) too.
            self._index.remove_claim(_as_array(binding.tokens), chunk_hash, namespace)
        if not binding.keys:
            del self._bindings[chunk_hash]

    def _placed_of(self, instance_id: str) -> set[tuple[bytes, KeyId]]:
        placed = self._placed.get(instance_id)
        if placed is None:
            placed = self._placed[instance_id] = set()
        return placed

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

    def cursor(self, instance_id: str) -> tuple[int, int] | None:
        with self._lock:
            return self._gate.cursor(instance_id)

    def placements(self, key: EncodedObjectKey) -> list[Placement]:
        """Where an object key is held (empty if nowhere)."""
        with self._lock:
            binding = self._bindings.get(key.chunk_hash)
            if binding is None:
                return []
            return list(binding.keys.get(self._key_id(key), ()))
