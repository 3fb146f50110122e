"""`KeyDirectory`: the coordinator's domain state, thread-safe (docs/DESIGN.md,
"Coordinator" and "Key directory internals"; docs/WIRE.md for what each query answers).

It holds the ingest gate and the pipeline's consumers (`pipeline.py`: the bindings with
their placements and index writer, `bindings.py`, `placements.py`, `writer.py`; the
capacity table) and answers queries (`queries.py`). Each admitted batch applies all or
nothing under the undo journal (`journal.py`). Lock order: directory
-> index, never the other way; lookups (`match`, `candidates`, `places_of`) and the
running totals are read without the directory lock, so they never wait for ingest.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from blend_wire import BlendNamespace, CacheEventBatch
from coordinator_stub.directory import queries
from coordinator_stub.directory.bindings import Bindings
from coordinator_stub.directory.gate import IngestGate
from coordinator_stub.directory.journal import Journal
from coordinator_stub.directory.pipeline import Capacity, IngestPipeline, Tally
from coordinator_stub.directory.placements import Placements
from coordinator_stub.directory.writer import IndexWriter

if TYPE_CHECKING:
    from local_matcher.types import CandidateColumns

log = logging.getLogger(__name__)

_COUNTERS = (
    "batches_applied", "batches_duplicate", "batches_stale", "instances_fenced",
    "instances_dropped", "entries_applied", "entries_duplicate", "entries_stale",
    "entries_stored", "entries_deleted", "entries_accessed", "deletes_unknown",
    "accesses_unknown", "token_lists_wrong_length", "token_lists_out_of_range",
    "chunk_size_mismatched_emitters", "stores_conflicting", "foreign_placement_changes")


class KeyDirectory:
    """Placements, token bindings and the blend index derived from them. Thread-safe."""

    def __init__(self, chunk_size: int = 256, probe_stride: int = 1,
                 enable_blend_lookup: bool = False, trust_shared_hashes: bool = False) -> None:
        self.chunk_size = chunk_size
        self.probe_stride = probe_stride
        self._lock = threading.Lock()
        self._journal = Journal()
        self._gate = IngestGate()
        self._index = None  # ContentIndex once blend lookup is on (its writer: bindings)
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._placements = Placements(self._journal)
        self._bindings = Bindings(self._journal, self._placements, self._counters,
                                  trust_shared_hashes)
        self._capacity = Capacity(self._journal)
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
                self._new_index(ContentIndex, self.chunk_size)

    def _new_index(self, index_class: type, chunk_size: int) -> None:
        index = index_class(chunk_size=chunk_size, probe_stride=self.probe_stride)
        self._bindings.writer = IndexWriter(index, chunk_size)
        self._index = index

    def match(self, tokens: np.ndarray, namespace: BlendNamespace, *,
              wait: bool = True) -> list:
        """Blend matches of `namespace` in `tokens` (a list of `BlendMatch`).

        Deliberately not under the directory lock: the index is thread-safe and always a
        consistent view of the bindings as of some applied entry. `wait=False`:
        `IndexBusy` rather than wait while ingest writes the index.
        """
        index = self._index
        if index is None or tokens.size < self.chunk_size:
            return []
        return index.match(tokens, namespace, wait=wait)

    def candidates(self, tokens: np.ndarray, namespace: BlendNamespace, *,
                   wait: bool = True) -> list:
        """The candidates form of a blend lookup (`ContentIndex.candidates`), not under the
        directory lock, as `match`."""
        index = self._index
        if index is None or tokens.size < self.chunk_size:
            return []
        return index.candidates(tokens, namespace, wait=wait)

    def candidate_columns(self, tokens: np.ndarray, namespace: BlendNamespace, *,
                          wait: bool = True) -> CandidateColumns:
        """`candidates` as columns (`ContentIndex.candidate_columns`)."""
        index = self._index
        if index is None or tokens.size < self.chunk_size:
            from local_matcher.types import EMPTY_COLUMNS
            return EMPTY_COLUMNS
        return index.candidate_columns(tokens, namespace, wait=wait)

    def place_columns(self, chunk_hashes: Sequence[bytes], namespace: BlendNamespace,
                      slots: np.ndarray | None = None) -> queries.PlaceColumns:
        """`places_of` as columns (`queries.place_columns`), without the directory lock;
        `slots`: the chunks' claim slots, if a lookup found them (`CandidateColumns`)."""
        return queries.place_columns(self._bindings.table, self._placements, chunk_hashes,
                                     namespace, slots)

    def places_of(self, chunk_hashes: list[bytes], namespace: BlendNamespace
                  ) -> list[tuple[list[str], bool]]:
        """Where `namespace`'s keys of each chunk are held: (instances whose L1 has one,
        sorted; whether a shared tier has one). Without the directory lock
        (`queries.places_of` says what that means)."""
        return queries.places_of(self._bindings.table, self._placements, chunk_hashes,
                                 namespace)

    # --- ingest: the pipeline's gate and consumers (pipeline.py) ---------------------------

    def ingest(self, batches: list[CacheEventBatch],
               speaks_for: Callable[[str], bool] | None = None) -> Tally:
        """Gate and apply validated batches, in order (`IngestPipeline.ingest`); counts
        are of batches. `speaks_for`: the instances the posting token's scope names (None:
        any); a shared pool's placement another reporter holds changes only if it names
        that reporter (`guard.what_stands`)."""
        with self._lock:
            if speaks_for is not None:
                self._bindings.speaks_for = speaks_for
            try:
                return self._pipeline().ingest(batches)
            finally:
                vars(self._bindings).pop("speaks_for", None)

    def _pipeline(self) -> IngestPipeline:
        # Made per call (cheap): it holds no state of its own, so a snapshot has none.
        return IngestPipeline(self._gate, (self._bindings, self._capacity),
                              self._all_or_nothing, self._settle, self._counters)

    @contextlib.contextmanager
    def _all_or_nothing(self, batch: CacheEventBatch, position: tuple):
        """One admitted batch, all or nothing (DESIGN.md): the consumers change under the
        undo journal, and the index writer sends what they staged once they are done.
        `position` is the gate's snapshot from before the batch was admitted."""
        counters = dict(self._counters)
        totals = self._placements.checkpoint()
        bindings = self._bindings
        self._journal.begin()
        bindings.table.begin(len(batch.entries))
        try:
            yield
            if bindings.writer is not None:
                bindings.writer.flush()
        except BaseException:
            touched = self._journal.keys_changed(bindings.table.hot)  # the batch changed
            self._journal.rollback()
            self._counters.update(counters)
            self._placements.restore(totals)
            self._gate.restore(batch.instance_id, position)
            if bindings.writer is not None and bindings.writer.discard():
                bindings.reindex(touched)  # its flush failed part-way: repair the index
            log.exception("batch %d of %s failed while being applied; rolled back, nothing "
                          "of it is applied", batch.seq, batch.instance_id)
            self._placements.free_unused()
            raise
        written = self._journal.keys_changed(bindings.table.hot, singly=True)
        self._journal.commit()
        self._placements.free_unused()
        bindings.table.freeze(written)  # its common bindings into columns

    def _settle(self) -> None:
        """After a departure (not journaled): the index writer sends what it staged."""
        if self._bindings.writer is not None:
            self._bindings.writer.flush()
        self._placements.free_unused()

    # --- instances coming and going, the chunk size ---------------------------------------

    def drop_instance(self, instance_id: str) -> None:
        """An instance left (deregistered, or silent past the timeout): its L1 was that
        process's memory, so its L1 placements go; its L2 placements stay (fleet storage,
        they leave by DELETE events); its capacity rows go (it declares them again on its
        return). Its ingest cursor is forgotten, and its L1 batches of this incarnation are
        refused until it registers again (`readmit`; LMCache 0.5.7's `drop_instance`,
        gate.py)."""
        with self._lock:
            self._pipeline().depart(instance_id)

    def readmit(self, instance_id: str) -> None:
        """The instance registered (again): its L1 batches are taken again."""
        with self._lock:
            self._gate.readmit(instance_id)

    def bind_chunk_size(self, chunk_size: int) -> bool:
        """Index at `chunk_size` from now on (LMCache 0.5.7's `bind_chunk_size`, whose
        rules the caller checks); False if it already was. Chunks indexed at the old size
        cannot be chunks at the new one: they leave the index (their placements, and the
        tokens directory queries show, stay). All or nothing: the new index is built
        first and the bindings change under the undo journal, so a bind that fails
        (say, out of memory) leaves the size, the index and the bindings as they were."""
        with self._lock:
            if chunk_size == self.chunk_size:
                return False
            index = None
            if self._index is not None:
                from local_matcher import ContentIndex

                index = ContentIndex(chunk_size=chunk_size, probe_stride=self.probe_stride)
            self._journal.begin()
            try:
                self._bindings.unindex_all()
            except BaseException:
                self._journal.rollback()
                raise
            self._journal.commit()
            self.chunk_size = chunk_size
            self._bindings.size_warned.clear()
            if index is not None:
                self._bindings.writer = IndexWriter(index, chunk_size)
                self._index = index
            return True

    def tracks(self, instance_id: str) -> bool:
        """Whether the id has a gate cursor or holds a placement (read without the lock:
        two dict lookups)."""
        return (self._gate.position(instance_id) is not None
                or self._bindings.holds_any(instance_id))

    def has_ghosts(self, registered: Callable[[str], bool]) -> bool:
        """Whether some id with a gate cursor is not `registered` and holds nothing."""
        with self._lock:
            holds_any = self._bindings.holds_any
            return any(not registered(instance_id) and not holds_any(instance_id)
                       for instance_id in self._gate.instances())

    def release_ghosts(self, registered: Callable[[str], bool], now: float,
                       timeout: float) -> list[str]:
        """Forget the gate cursor and capacity rows of every id that is not `registered`,
        holds no placement, and has sent no batch for more than `timeout` (by `now`, the
        reaper's clock, across its sweeps): ids that never registered or stopped, which
        would otherwise be kept for good. Such an id's next batch is its first; it holds
        nothing, so there is nothing to fence. An unregistered id that holds placements
        (a ZMQ-only server reports without registering) keeps its cursor. Returns the ids
        released. O(ids with a cursor), under the directory lock."""
        with self._lock:
            gate, holds_any = self._gate, self._bindings.holds_any
            released = []
            for instance_id in gate.instances():
                if registered(instance_id) or holds_any(instance_id):
                    gate.not_idle(instance_id)
                elif gate.idle_for(instance_id, now) > timeout:
                    released.append(instance_id)
            if not released:
                return released
            gone = set(released)
            for instance_id in released:
                gate.forget(instance_id)
                self._placements.l1_by_instance.pop(instance_id, None)
            self._capacity.forget(lambda place: place[0] in gone)
            return released

    # --- snapshots (the replica pickles the directory) ----------------------------------

    def __getstate__(self) -> dict:
        """Everything but the lock (made anew on load). Take it while no batch is being
        applied (the replica snapshots on its apply thread)."""
        state = dict(vars(self))
        del state["_lock"]
        return state

    def restore_from(self, other: "KeyDirectory") -> None:
        """Take `other`'s whole state (a loaded snapshot, or a fresh directory) in place,
        so whoever holds this directory (the coordinator, the metrics) sees it."""
        state = other.__getstate__()
        with self._lock:
            vars(self).update(state)

    def __setstate__(self, state: dict) -> None:
        # Indexed chunks' digests came from the writing process's `hash`: they stay as
        # they are, and a differing one is checked against the indexed tokens.
        vars(self).update(state)
        self._lock = threading.Lock()
        for name in _COUNTERS:  # counters added since the snapshot was written start at 0
            self._counters.setdefault(name, 0)
        if type(self._capacity) is not Capacity:  # written before it was a consumer
            self._capacity = Capacity(self._journal, self._capacity)

    def state_parts(self) -> tuple:
        """The objects whose fields make up a snapshot's layout (`snapshot.layout_of`),
        but the index's (the index writer's with blend lookup on)."""
        writer = self._bindings.writer
        return (self, self._placements, self._bindings, self._bindings.table, self._gate,
                *(() if writer is None else (writer,)))

    # --- inspection ---------------------------------------------------------------------

    def placements_of(self, keys: list[tuple[bytes, tuple]]) -> list[tuple[list, list, int]]:
        """For each `(chunk_hash, (model_name, cache_salt, kv_rank, object_group_id))`:
        its places sorted by `(instance_id, tier, backend)`, the chunk's tokens (empty
        when unknown; they belong to the chunk, so any of its keys shows them) and the
        key's access count. Unknown keys get `([], tokens, 0)`. Cost: per key, its own
        placements (a chunk's tokens are converted once per call)."""
        with self._lock:
            return queries.placements_of(self._bindings.table, self._placements,
                                         self._bindings.writer, keys)

    def with_other_groups(self, keys: list[tuple[bytes, tuple]]) -> list[tuple[bytes, tuple]]:
        """Each `(chunk_hash, raw_key)` followed by the stored keys of its chunk that
        differ from it only in object group, in ascending group order (LMCache's token
        lookups resolve group 0 and follow these). A chunk's keys are read once."""
        with self._lock:
            return queries.with_other_groups(self._bindings.table, self._placements, keys)

    def list_keys(self, tier: str, instance_id: str, backend: str, offset: int, limit: int
                  ) -> tuple[int, list[tuple[bytes, tuple, list, int, int]]]:
        """Keys with at least one placement matching the filters (`tier` "all" and empty
        strings match anything), as `(total, page)`; a page row is `(chunk_hash, raw_key,
        matching places, num_tokens, access_count)`. Order: by chunk, in the order chunks
        were first stored, then by key, in the order keys first held the chunk. The
        directory lock is held only to copy the binding table and the place and key
        tables its rows refer to (numbers freed after a batch are reused), so a listing
        walks a consistent snapshot while ingest goes on."""
        with self._lock:
            rows = queries.key_rows(self._bindings.table, self.chunk_size)
            places, key_raw = list(self._placements.places), list(self._placements.key_raw)
        return queries.key_page(rows, places, key_raw, tier, instance_id, backend, offset,
                                limit)

    def totals(self) -> dict[str, int]:
        """Running totals, read without the lock (metrics scrapes must never wait for
        ingest): each value is one int, current as of some moment of ingest."""
        placements = self._placements
        l1, l2 = placements.tier_totals["l1"], placements.tier_totals["l2"]
        return {"num_keys": placements.num_keys, "num_placements": placements.num_placements,
                "l1_count": l1[0], "l1_size_bytes": l1[1],
                "l2_count": l2[0], "l2_size_bytes": l2[1], **self._counters,
                **self._gate.totals()}

    def ingest_streams(self) -> dict[str, dict]:
        """The gate's per-emitter figures (gate.py), read without the lock, as totals."""
        return self._gate.streams(ages=True)

    def blend_stats(self) -> dict[str, int]:
        """The blend index's stats (zeros with blend lookup off). Takes the index lock
        only, briefly."""
        index = self._index
        if index is None:
            return dict.fromkeys(("num_contents", "num_chunks", "num_claims",
                                  "num_namespaces", "table_size", "bytes"), 0)
        return index.stats()

    def stats(self) -> dict:
        """WIRE.md's stats object, LMCache's fields first, then ours."""
        with self._lock:
            blend = self.blend_stats()
            blend_bytes = blend.pop("bytes")
            placements = self._placements
            l1, l2 = placements.tier_totals["l1"], placements.tier_totals["l2"]
            return {
                "num_keys": placements.num_keys,
                "num_placements": placements.num_placements,
                # An entry for every instance the gate has a stream for (LMCache: from its
                # first admitted batch until it is dropped).
                "l1_keys_by_instance": {
                    instance_id: placements.l1_by_instance.get(instance_id, 0)
                    for instance_id in self._gate.instances()},
                "blend": blend,
                "l1_count": l1[0],
                "l1_size_bytes": l1[1],
                "l2_count": l2[0],
                "l2_size_bytes": l2[1],
                "num_bindings": len(self._bindings.table),
                "num_instances": len(self._gate),
                "blend_enabled": self._index is not None,
                "blend_bytes": blend_bytes,
                "chunk_size": self.chunk_size,
                "counters": {**self._counters, **self._gate.totals()},
                # LMCache 0.5.7's gate figures, per emitter (gate.py).
                "ingest_streams": self._gate.streams(),
                "capacity": [
                    {"instance_id": place[0], "tier": place[1], "backend": place[2],
                     "capacity_bytes": value[0], "capacity_revision": value[1]}
                    for place, value in self._capacity.items()],
            }
