"""The key directory: where every stored object lives, and what content each chunk holds.

State (all guarded by `self._lock`, the directory lock):
- placements: per object key, the places holding it. A place is what the reporter said,
  `(instance_id, incarnation, tier, backend, shared, size_bytes)`; its identity is
  `(instance_id, tier, backend)`, or `(tier, backend)` for a `shared` (fleet-wide) pool,
  whose one placement names its latest reporter (LMCache's rule): a STORE of the same
  identity replaces the place, a DELETE of it removes it. A key is
  `(chunk_hash, namespace, kv_rank, object_group_id)`; its namespace is
  `(model_name, cache_salt, world_size)` (WIRE.md). A key with no placement is forgotten,
  with its count of `access` entries.
- bindings: one per `chunk_hash` that has at least one key: the chunk's content (exactly
  `chunk_size` tokens, or unknown) and its stored offset (or -1, unknown), or, once its
  namespaces part ways, each namespace's own (below). A binding with no key left is
  forgotten, content and all.
- per instance, the chunk hashes it holds a placement of, so a restart (or a departure:
  `drop_instance`, L1 only) is fenced without scanning the directory.
- running totals (placements and reported bytes per tier, L1 placements per instance),
  so stats and metrics never walk the directory.
- the ingest gate's cursors (`IngestGate`): admitting a batch and applying it are one step.

All or nothing per batch: everything that can fail on the way in is checked by the wire
decoder before a batch gets here (ranges, hex, token ids). Then a batch is admitted and
applied under an undo journal (`coordinator_stub.directory.journal`: the bindings, the per-instance
sets, the many-keys records and the capacity map are journaled; counters and the gate
cursor are snapshotted), and its index updates are queued, not sent, until the directory
part is done. If anything raises, the journal is rolled back, the cursor restored and the
queued index updates dropped, so the gate and the directory are as they were and a retry
of the same batch applies it. If the index itself fails part-way through the queued
updates, the chunks the batch touched are re-indexed from the restored bindings. Key and
place numbers no placement refers to after a batch (committed or rolled back) are freed.
Whoever adds state that a batch mutates in place makes it a `JournaledDict` /
`JournaledSet` (or snapshots it in `_apply_atomically`); tests/hostile/test_hostile_atomic.py
compares everything the directory reports before and after a failed batch.

The blend index (`local_matcher.ContentIndex`) is a derived view of the bindings, and
only this module writes it (through `_IndexWriter`). Each step of DESIGN.md's lifecycle
table is one method below (`_fill_content`, `_move_offset`, `_claim_for`, `_store_own`,
`_release`, ...).

Content per namespace (WIRE.md, "Chunk hashes shared by namespaces"; why we depart from
LMCache there): chunk hashes do not include the namespace and anyone can compute them, so a
report for a hash never changes what other namespaces match. Each namespace's content and
offset for a hash are those of its own latest STORE with usable `token_ids` (none, the
wrong length, or an id outside uint32 make a STORE token-less: it records its placement and
changes neither), and a token-less STORE claims only content its own namespace reported.
While a chunk has one namespace, or all of its namespaces hold the same content at the same
offset (the common case), the binding keeps one `(content, offset)` for all of them, as
before; the first report that parts them turns it into an `_OwnContent`, {namespace:
(content, offset)} (once, O(namespaces)), and it turns back when one namespace is left.
With `trust_shared_hashes` (`--trust-shared-hashes`) the binding always keeps one content and
offset, LMCache's rules: the latest STORE with tokens from any namespace sets them (new
content retires every claim first) and a token-less STORE of any namespace claims them.
Invariant, after every batch applied: a (chunk, namespace) claim is in the index iff that
namespace's content is known with an offset >= 0 and the namespace has a key on the chunk,
and then it is indexed with that content and offset.

Lock order: directory -> index, never the other way (the index never calls out). Lookups
go to the index directly, without the directory lock, so they never wait for ingest.

With blend lookup off, no content is recorded or hashed and no index exists. Enabling
it later creates an empty index; content recorded from then on is indexed, nothing from
before is back-filled.

What directory queries show as a chunk's tokens is what LMCache shows: the token ids of
the latest STORE that carried any (of any length; one with an id outside uint32 changes
nothing), blend lookup on or off. They are the binding's content when that STORE's
tokens became it (the common case: no second copy); otherwise (blend lookup off, or a
list that is not one chunk long) they are kept aside as `reported`, for display only:
never hashed, never indexed.

Representation (why it looks the way it does): a binding is one tuple
`(content, offset, holds, accesses, reported)` (`reported`: None, or the displayed
tokens as native uint32 bytes when they are not the content). `accesses` holds the counts of the chunk's keys
that were ever accessed (usually none): a flat tuple of `(key_no, count)` pairs, or past
`_FEW` keys a dict {key_no: count}, so counting and forgetting stay O(1) per key. A place number
stands for the whole place, size included: an instance reports one size per tier and
chunk size, so places stay few and a placement costs no more than before. `holds` is, for a chunk with up to `_FEW` placements (nearly
all), a flat tuple of small-int pairs `(key_no, place_no, key_no, place_no, ...)`,
numbering keys and places through interning tables; beyond that, a `_ManyKeys`, whose
dicts make adding or removing one key O(1) however many keys (object groups, ranks) one
chunk hash has. Atom-only tuples are untracked by Python's cyclic garbage collector, so a
directory of millions of chunks adds nothing to a GC pass (which would otherwise stall
every request for a quarter second at 200k chunks), and they are several times smaller
than per-chunk objects, dicts and sets.

`content` is None (unknown), the tokens as `bytes` (native uint32) while the chunk is
not indexed (no offset), an `_OwnContent` whose values hold the same forms per namespace
(its `reported` then always holds the displayed tokens), or, for an indexed chunk, only an
`int` digest of them: the
tokens are kept once, in the index, and fetched back (`ContentIndex.tokens_of`) for the
rare steps that need them (claiming an indexed chunk for another namespace, moving its
offset, un-indexing it). The digest is `hash`, randomised per process: a directory loaded
from a snapshot keeps the writer's digests, and a STORE whose digest differs is compared
with the indexed tokens before it counts as new content (nothing is re-digested on load).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import numpy as np

from coordinator_stub.directory.gate import IngestGate, Verdict
from coordinator_stub.directory.journal import Journal, JournaledDict
from blend_wire import (
    UNKNOWN_TOKEN_OFFSET,
    BlendNamespace,
    CacheEventBatch,
    CacheEventEntry,
    EncodedObjectKey,
    EventsReply,
    TokenIds,
)

log = logging.getLogger(__name__)

#: `(instance_id, incarnation, tier, backend, shared, size_bytes)`: one place an object
#: is held, as its (latest) reporter described it.
Place = tuple[str, int, str, str, bool, int]
_INSTANCE, _INCARNATION, _TIER, _BACKEND, _SHARED, _SIZE = range(6)
_NO_ACCESSES: tuple = ()
# `places_of` answers for a chunk held nowhere the requester can see, or only in a shared
# tier (shared by every answer: never mutated).
_NOWHERE: tuple[list[str], bool] = ((), False)
_SHARED_ONLY: tuple[list[str], bool] = ((), True)

#: Placements a binding keeps in a flat tuple (scanned); past this, a `_ManyKeys`.
_FEW = 8
#: Emitters remembered as warned of a chunk-size mismatch (forgotten when they leave).
_MAX_SIZE_WARNED = 4096

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

    __slots__ = ("places", "keys_in", "placements_of", "_count", "_journal")

    def __init__(self, journal: Journal) -> None:
        # Journaled like the directory's own maps: a rolled-back batch leaves no trace.
        self.places: dict[int, tuple[int, ...]] = JournaledDict(journal)
        self.keys_in: dict[BlendNamespace, int] = JournaledDict(journal)
        self.placements_of: dict[str, int] = JournaledDict(journal)
        self._journal = journal
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    @count.setter
    def count(self, value: int) -> None:
        self._journal.note(self, "_count")
        self._count = value


class _OwnContent(JournaledDict):
    """The content of a chunk whose namespaces reported different tokens or offsets (or
    one reported none while another did): {namespace: (content, offset)}, `content` as
    for a binding (bytes, or the digest of indexed tokens). A namespace not in it has no
    content of its own for the chunk, and claims none. Journaled like the bindings; rare,
    so its GC tracking does not matter."""

    __slots__ = ()

    def __reduce__(self):
        return _OwnContent, (self.journal, dict(self))


class _IndexWriter:
    """The directory's only path to the index. Updates are queued and sent by `flush()`,
    consecutive adds as one `add_many` (one lock acquisition, one kernel call, one
    namespace per row) instead of one call per chunk; `discard()` drops what is queued.

    Order is preserved: adds are sent in the order they were queued (the index numbers
    occupants in the order they are first indexed, LMCache's match order), and every
    removal closes the current run of adds first. While updates are queued, `tokens_of`
    answers as the index will once they are sent.

    `flush()` records, before each removal, the tokens the claims had (`replaced`, by
    `(chunk_hash, namespace)`, or by chunk hash for a whole chunk), so a failure part-way
    can be repaired; `sent` says how many updates reached the index. Called only under
    the directory lock, and flushed before the lock is released.
    """

    def __init__(self, index, chunk_size: int) -> None:
        self.index = index
        self.chunk_size = chunk_size
        self._ops: list[tuple] = []
        # Per chunk hash, the content of each namespace's claim once queued updates land
        # (None: no claim); `_ALL` present: the chunk was dropped, so unlisted ones too.
        self._latest: dict[bytes, dict] = {}
        self._adds: tuple[list, list, list, list] | None = None
        self.sent = 0
        self.replaced: dict = {}

    def add(self, tokens: bytes, chunk_hash: bytes, offset: int,
            namespace: BlendNamespace) -> None:
        self._latest.setdefault(chunk_hash, {})[namespace] = tokens
        adds = self._adds
        if adds is None:
            adds = self._adds = ([], [], [], [])
        adds[0].append(tokens)
        adds[1].append(chunk_hash)
        adds[2].append(offset)
        adds[3].append(namespace)

    def remove_claim(self, chunk_hash: bytes, namespace: BlendNamespace) -> None:
        self._close_adds()
        self._ops.append((_REMOVE_CLAIM, chunk_hash, namespace))
        self._latest.setdefault(chunk_hash, {})[namespace] = None

    def remove_chunk(self, chunk_hash: bytes) -> None:
        self._close_adds()
        self._ops.append((_REMOVE_CHUNK, chunk_hash, None))
        self._latest[chunk_hash] = {_ALL: None}

    def tokens_of(self, chunk_hash: bytes, namespace: BlendNamespace | None = None
                  ) -> bytes | None:
        """The content of `namespace`'s claim (None: of any claim, for a chunk whose
        claims all agree) as it will be once the queue is sent."""
        latest = self._latest.get(chunk_hash)
        if latest is not None:
            if namespace is None:
                for tokens in latest.values():
                    if tokens is not None:
                        return tokens
            elif namespace in latest:
                return latest[namespace]
            if _ALL in latest:
                return None
        tokens = self.index.tokens_of(chunk_hash, namespace)
        return None if tokens is None else np.asarray(tokens, dtype=np.uint32).tobytes()

    def _close_adds(self) -> None:
        if self._adds is not None:
            self._ops.append((_ADD_MANY, None, self._adds))
            self._adds = None

    def flush(self) -> None:
        """Send every queued update to the index, in order."""
        self._close_adds()
        ops, self._ops, self._latest = self._ops, [], {}
        self.sent, self.replaced = 0, {}
        index = self.index
        for kind, first, second in ops:
            if kind is _ADD_MANY:
                contents, hashes, offsets, namespaces = second
                # One row per distinct tokens object: a chunk claimed for every namespace on
                # it queues the same bytes n times, hashed and looked up once here.
                row_numbers: dict[int, int] = {}
                distinct: list[bytes] = []
                row_of = []
                for tokens in contents:
                    row = row_numbers.get(id(tokens))
                    if row is None:
                        row = row_numbers[id(tokens)] = len(distinct)
                        distinct.append(tokens)
                    row_of.append(row)
                rows = np.frombuffer(b"".join(distinct), dtype=np.uint32).reshape(
                    len(distinct), self.chunk_size)
                index.add_many(rows, hashes, offsets, namespaces,
                               row_of if len(distinct) < len(contents) else None)
            elif kind is _REMOVE_CLAIM:
                if (first, second) not in self.replaced:  # to restore should this fail
                    self.replaced[(first, second)] = index.tokens_of(first, second)
                index.remove_claim(None, first, second)
            else:
                if first not in self.replaced:
                    self.replaced[first] = index.tokens_of(first)
                index.remove_chunk(None, first)
            self.sent += 1

    def discard(self) -> None:
        """Drop every queued update (the batch that queued them was rolled back)."""
        self._ops, self._latest, self._adds = [], {}, None


_ALL = object()  # `_IndexWriter._latest`: every claim of the chunk
_ADD_MANY, _REMOVE_CLAIM, _REMOVE_CHUNK = "add_many", "remove_claim", "remove_chunk"


class KeyDirectory:
    """Placements, token bindings and the blend index derived from them. Thread-safe."""

    def __init__(self, chunk_size: int = 256, probe_stride: int = 1,
                 enable_blend_lookup: bool = False, trust_shared_hashes: bool = False) -> None:
        self.chunk_size = chunk_size
        self.probe_stride = probe_stride
        # LMCache's cross-namespace rules (module doc): one content per chunk hash, set by
        # whichever namespace stored it last, and claimed by a token-less STORE of any.
        self._trust_shared_hashes = trust_shared_hashes
        self._lock = threading.Lock()
        self._journal = Journal()
        self._gate = IngestGate()
        self._index = None  # ContentIndex once blend lookup is on
        self._writer: _IndexWriter | None = None  # the one writer of self._index
        # Journaled: what a batch changed here is undone if the batch fails (module doc).
        self._bindings: dict[bytes, tuple] = JournaledDict(self._journal)
        self._held_by: dict[str, set[bytes]] = JournaledDict(self._journal)
        # Interning tables: keys and places are numbered once and referred to by number.
        self._key_nos: dict[tuple[str, str, int, int], int] = {}
        self._key_ns: list[BlendNamespace] = []  # namespace of each key number
        self._namespaces: dict[BlendNamespace, BlendNamespace] = {}
        self._key_raw: list[tuple[str, str, int, int]] = []  # fields of each key number
        self._place_nos: dict[Place, int] = {}
        self._places: list[Place] = []
        self._ident_nos: dict[tuple, int] = {}
        self._place_idents: list[int] = []  # identity number of each place number
        # Places are freed when no placement refers to them any more (an instance that
        # restarted, left or was reaped, a size nobody reports now), so churn of
        # instances and incarnations does not grow these tables: placements per place
        # (journaled, like the rest of a batch), places per identity, and free numbers.
        self._place_refs: dict[int, int] = JournaledDict(self._journal)
        self._idents: dict[int, tuple] = {}
        self._ident_refs: dict[int, int] = {}
        self._next_ident = 0
        self._free_place_nos: list[int] = []
        self._maybe_unused: set[int] = set()
        # Keys likewise: chunks holding each key number (journaled), keys per interned
        # namespace, free numbers; so keys (salts, models, ranks, groups) nobody holds any
        # more cost nothing, however many a client made up.
        self._key_refs: dict[int, int] = JournaledDict(self._journal)
        self._namespace_refs: dict[BlendNamespace, int] = {}
        self._free_key_nos: list[int] = []
        self._maybe_unused_keys: set[int] = set()
        self._capacity: dict[tuple[str, str, str], tuple[int, int]] = JournaledDict(
            self._journal)
        self._num_keys = 0
        self._num_placements = 0
        # Running totals per tier: [placements, reported bytes]; L1 placements per instance.
        self._tier_totals = {"l1": [0, 0], "l2": [0, 0]}
        self._l1_by_instance: dict[str, int] = JournaledDict(self._journal)
        self._counters = dict.fromkeys(
            ("batches_applied", "batches_duplicate", "batches_stale", "instances_fenced",
             "instances_dropped", "entries_applied", "entries_duplicate", "entries_stale",
             "entries_stored", "entries_deleted", "entries_accessed", "deletes_unknown",
             "accesses_unknown", "token_lists_wrong_length", "token_lists_out_of_range",
             "chunk_size_mismatched_emitters"), 0)
        self._emitter = ""  # the instance whose batch is being applied
        self._size_warned: set[str] = set()  # emitters warned of a chunk-size mismatch
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

    def candidates(self, tokens: np.ndarray, namespace: BlendNamespace) -> list:
        """The candidates form of a blend lookup (`ContentIndex.candidates`), not under the
        directory lock, as `match`."""
        index = self._index
        if index is None or tokens.size < self.chunk_size:
            return []
        return index.candidates(tokens, namespace)

    def places_of(self, chunk_hashes: list[bytes], namespace: BlendNamespace
                  ) -> list[tuple[list[str], bool]]:
        """Where `namespace`'s keys of each chunk are held: (instances whose L1 has one,
        sorted; whether a shared tier has one).

        A hint for the requester's choice among chunks of one content, read without the
        directory lock so that lookups never wait for ingest: it is the state as of some
        moment while batches apply (tuples are replaced whole; a many-keys record changed
        under the read answers "nowhere known", which only makes a chunk look remote)."""
        bindings, key_ns, places = self._bindings, self._key_ns, self._places
        found = []
        for chunk_hash in chunk_hashes:
            binding = bindings.get(chunk_hash)
            holds = None if binding is None else binding[2]
            try:
                if type(holds) is tuple and len(holds) == 2:  # one placement: nearly all
                    if key_ns[holds[0]] != namespace:
                        found.append(_NOWHERE)
                        continue
                    place = places[holds[1]]
                    found.append(_SHARED_ONLY if place[_SHARED] else
                                 ([place[_INSTANCE]], False) if place[_TIER] == "l1"
                                 else _NOWHERE)
                    continue
                if holds is None:
                    found.append(_NOWHERE)
                    continue
                pairs = (zip(holds[0::2], holds[1::2]) if type(holds) is tuple else
                         [(k, p) for k, ps in list(holds.places.items()) for p in ps])
                l1, shared = set(), False
                for key_no, place_no in pairs:
                    if key_ns[key_no] == namespace:
                        place = places[place_no]
                        if place[_SHARED]:
                            shared = True
                        elif place[_TIER] == "l1":
                            l1.add(place[_INSTANCE])
                found.append((sorted(l1), shared))
            except (RuntimeError, IndexError, TypeError):
                found.append(_NOWHERE)
        return found

    # --- ingest -----------------------------------------------------------------------

    def ingest(self, batches: list[CacheEventBatch]) -> EventsReply:
        """Gate and apply validated batches, in order. Counts are of batches."""
        applied = duplicates = stale = 0
        counters = self._counters
        with self._lock:
            for batch in batches:
                position = self._gate.snapshot(batch.instance_id)
                verdict = self._gate.admit(batch.instance_id, batch.incarnation, batch.seq,
                                           tier=batch.tier,
                                           dropped_events=batch.dropped_events, ts=batch.ts)
                if verdict is Verdict.DUPLICATE:
                    duplicates += 1
                    counters["entries_duplicate"] += len(batch.entries)
                    continue
                if verdict is Verdict.STALE:
                    stale += 1
                    counters["entries_stale"] += len(batch.entries)
                    continue
                self._apply_atomically(batch, verdict, position)
                applied += 1
                counters["entries_applied"] += len(batch.entries)
            counters["batches_applied"] += applied
            counters["batches_duplicate"] += duplicates
            counters["batches_stale"] += stale
        return EventsReply(applied=applied, duplicates=duplicates, stale=stale)

    def _apply_atomically(self, batch: CacheEventBatch, verdict: Verdict,
                          position: tuple) -> None:
        """Fence (if asked) and apply one admitted batch, all or nothing (module doc).
        `position` is the gate's snapshot from before the batch was admitted."""
        counters = dict(self._counters)
        totals = (self._num_keys, self._num_placements)
        tier_totals = {tier: list(values) for tier, values in self._tier_totals.items()}
        self._journal.begin()
        try:
            if verdict is Verdict.FENCE:
                self._fence(batch.instance_id)
            self._apply(batch)
            if self._writer is not None:
                self._writer.flush()
        except BaseException:
            touched = self._touched_chunks()
            self._journal.rollback()
            self._counters.update(counters)
            self._num_keys, self._num_placements = totals
            for tier, values in tier_totals.items():
                self._tier_totals[tier][:] = values
            self._gate.restore(batch.instance_id, position)
            if self._writer is not None:
                self._writer.discard()
                if self._writer.sent:
                    self._reindex(touched)
            log.exception("batch %d of %s failed while being applied; rolled back, nothing "
                          "of it is applied", batch.seq, batch.instance_id)
            self._free_unused_places()
            self._free_unused_keys()
            raise
        self._journal.commit()
        self._free_unused_places()
        self._free_unused_keys()

    def _touched_chunks(self) -> set[bytes]:
        bindings = self._bindings
        return {key for _, target, key, _ in self._journal.records or ()
                if target is bindings}

    def _reindex(self, chunk_hashes: set[bytes]) -> None:
        """The index failed part-way through a batch: put back what the restored bindings
        say about the chunks it touched (best effort; logged if even that fails)."""
        index, replaced = self._writer.index, self._writer.replaced
        try:
            for chunk_hash in chunk_hashes:
                binding = self._bindings.get(chunk_hash)
                claims = [] if binding is None else self._indexed_claims(binding)
                restore = []
                for namespace, content, offset in claims:
                    if type(content) is bytes:
                        tokens = np.frombuffer(content, dtype=np.uint32)
                    elif (chunk_hash, namespace) in replaced:
                        tokens = replaced[chunk_hash, namespace]
                    elif chunk_hash in replaced:
                        tokens = replaced[chunk_hash]
                    else:
                        tokens = index.tokens_of(chunk_hash, namespace)
                    restore.append((namespace, tokens, offset))
                index.remove_chunk(None, chunk_hash)
                for namespace, tokens, offset in restore:
                    if tokens is None:
                        log.error("chunk %s cannot be re-indexed: its tokens are gone",
                                  chunk_hash.hex())
                        continue
                    index.add(tokens, chunk_hash, offset, namespace)
        except Exception:
            log.exception("re-indexing after a failed batch failed too; lookups may miss "
                          "chunks until they are stored again")

    def _indexed_claims(self, binding: tuple) -> list[tuple[BlendNamespace, Content, int]]:
        """(namespace, content, offset) of every claim the binding says is indexed."""
        content, offset, holds = binding[:3]
        if type(content) is _OwnContent:
            return [(namespace, held[0], held[1]) for namespace, held in content.items()
                    if held[1] >= 0]
        if not self._indexed(content, offset):
            return []
        return [(namespace, content, offset) for namespace in self._namespaces_of(holds)]

    def _apply(self, batch: CacheEventBatch) -> None:
        kind = batch.event_type
        self._emitter = batch.instance_id  # named by a chunk-size mismatch warning
        if kind == "store":
            held = self._held_by.get(batch.instance_id)
            if held is None:
                self._held_by[batch.instance_id] = set()  # stored as a journaled set
                held = self._held_by[batch.instance_id]
            for entry in batch.entries:
                self._store(entry, self._place_no(batch, entry.size_bytes), held)
            self._counters["entries_stored"] += len(batch.entries)
        elif kind == "delete":
            ident = self._place_idents[self._place_no(batch, 0)]
            for entry in batch.entries:
                self._delete(entry.key, ident)
            self._counters["entries_deleted"] += len(batch.entries)
        elif kind == "config":
            place = (batch.instance_id, batch.tier, batch.backend)
            self._capacity[place] = (batch.capacity_bytes, batch.capacity_revision)
        else:  # "access": counted per key (recency, which this directory does not rank by)
            for entry in batch.entries:
                self._access(entry.key)
            self._counters["entries_accessed"] += len(batch.entries)

    def _place_no(self, batch: CacheEventBatch, size_bytes: int) -> int:
        place = (batch.instance_id, batch.incarnation, batch.tier, batch.backend,
                 batch.shared, size_bytes)
        place_no = self._place_nos.get(place)
        if place_no is None:
            ident = ("", batch.tier, batch.backend, True) if batch.shared else (
                batch.instance_id, batch.tier, batch.backend, False)
            ident_no = self._ident_nos.get(ident)
            if ident_no is None:
                ident_no = self._ident_nos[ident] = self._next_ident
                self._next_ident += 1
                self._idents[ident_no] = ident
            self._ident_refs[ident_no] = self._ident_refs.get(ident_no, 0) + 1
            if self._free_place_nos:
                place_no = self._free_place_nos.pop()
                self._places[place_no], self._place_idents[place_no] = place, ident_no
            else:
                place_no = len(self._places)
                self._places.append(place)
                self._place_idents.append(ident_no)
            self._place_nos[place] = place_no
            self._maybe_unused.add(place_no)  # freed after the batch if nothing holds it
        return place_no

    def _free_unused_places(self) -> None:
        """Forget places no placement refers to (after a batch, committed or not)."""
        refs = self._place_refs
        for place_no in self._maybe_unused:
            if place_no in refs or self._places[place_no] is None:
                continue
            del self._place_nos[self._places[place_no]]
            self._places[place_no] = None
            ident_no = self._place_idents[place_no]
            self._ident_refs[ident_no] -= 1
            if not self._ident_refs[ident_no]:
                del self._ident_refs[ident_no]
                del self._ident_nos[self._idents.pop(ident_no)]
            self._free_place_nos.append(place_no)
        self._maybe_unused.clear()

    def _count(self, place_no: int, sign: int) -> None:
        """Move the running totals by one placement (sign +1 added, -1 removed)."""
        place = self._places[place_no]
        refs = self._place_refs.get(place_no, 0) + sign
        if refs:
            self._place_refs[place_no] = refs
        else:
            del self._place_refs[place_no]
            self._maybe_unused.add(place_no)
        totals = self._tier_totals[place[_TIER]]
        totals[0] += sign
        totals[1] += sign * place[_SIZE]
        if place[_TIER] == "l1":
            instance_id = place[_INSTANCE]
            count = self._l1_by_instance.get(instance_id, 0) + sign
            if count:
                self._l1_by_instance[instance_id] = count
            else:
                del self._l1_by_instance[instance_id]

    def _access(self, key: EncodedObjectKey) -> None:
        """One ACCESS entry: the key's count grows, if the directory holds the key."""
        key_no = self._key_nos.get(
            (key.model_name, key.cache_salt, key.kv_rank, key.object_group_id))
        chunk_hash = bytes.fromhex(key.chunk_hash_hex)
        binding = self._bindings.get(chunk_hash)
        if binding is None or key_no is None or not self._holds_key(binding[2], key_no):
            self._counters["accesses_unknown"] += 1  # LMCache counts only keys it holds
            return
        accesses = binding[3]
        if type(accesses) is not tuple:  # a (journaled) dict
            accesses[key_no] = accesses.get(key_no, 0) + 1
            return
        for i in range(0, len(accesses), 2):
            if accesses[i] == key_no:
                accesses = accesses[:i + 1] + (accesses[i + 1] + 1,) + accesses[i + 2:]
                break
        else:
            if len(accesses) < 2 * _FEW:
                accesses += (key_no, 1)
            else:  # many keys accessed: a dict, O(1) per key from now on
                accesses = JournaledDict(self._journal, zip(accesses[0::2], accesses[1::2]))
                accesses[key_no] = 1
        self._bindings[chunk_hash] = binding[:3] + (accesses,) + binding[4:]

    def _key_no(self, key: EncodedObjectKey) -> int:
        raw = (key.model_name, key.cache_salt, key.kv_rank, key.object_group_id)
        key_no = self._key_nos.get(raw)
        if key_no is None:
            namespace = key.namespace
            namespace = self._namespaces.setdefault(namespace, namespace)
            self._namespace_refs[namespace] = self._namespace_refs.get(namespace, 0) + 1
            if self._free_key_nos:
                key_no = self._free_key_nos.pop()
                self._key_ns[key_no], self._key_raw[key_no] = namespace, raw
            else:
                key_no = len(self._key_ns)
                self._key_ns.append(namespace)
                self._key_raw.append(raw)
            self._key_nos[raw] = key_no
            self._maybe_unused_keys.add(key_no)  # freed after the batch if nothing holds it
        return key_no

    def _free_unused_keys(self) -> None:
        """Forget keys no chunk holds (after a batch, committed or not)."""
        refs = self._key_refs
        for key_no in self._maybe_unused_keys:
            if key_no in refs or self._key_raw[key_no] is None:
                continue
            del self._key_nos[self._key_raw[key_no]]
            namespace = self._key_ns[key_no]
            self._namespace_refs[namespace] -= 1
            if not self._namespace_refs[namespace]:
                del self._namespace_refs[namespace]
                del self._namespaces[namespace]
            self._key_ns[key_no] = self._key_raw[key_no] = None
            self._free_key_nos.append(key_no)
        self._maybe_unused_keys.clear()

    # --- the lifecycle table, one step per row ----------------------------------------------

    def _store(self, entry: CacheEventEntry, place_no: int, held: set[bytes]) -> None:
        """One STORE entry: record the placement, then the binding's content and offset."""
        key_no = self._key_no(entry.key)
        chunk_hash = bytes.fromhex(entry.key.chunk_hash_hex)
        binding = self._bindings.get(chunk_hash)
        content, offset, holds, accesses, reported = binding if binding is not None else (
            None, UNKNOWN_TOKEN_OFFSET, (), _NO_ACCESSES, None)
        holds, new_claim = self._add_placement(holds, key_no, place_no)
        held.add(chunk_hash)
        stamped = None
        if self._writer is not None:  # blend lookup off: no content is recorded (or hashed)
            stamped = self._stamped_tokens(entry)
            namespace = self._key_ns[key_no]
            if type(content) is _OwnContent:
                self._store_own(chunk_hash, content, namespace, stamped, entry.token_offset)
            elif (self._trust_shared_hashes or content is None and stamped is None
                  or self._alone(holds, namespace)):
                # One namespace on the chunk (or LMCache's shared rules): the chunk's
                # content and offset are that namespace's.
                claimant = namespace if new_claim else None
                if stamped is not None:
                    content, offset = self._stamp(chunk_hash, content, offset, holds,
                                                  stamped, entry.token_offset, claimant)
                elif claimant is not None and self._indexed(content, offset):
                    # STORE without tokens, content known: claim it for the key's namespace.
                    self._claim_for(chunk_hash, content, offset, claimant)
            elif (stamped is None and not new_claim) or (
                    stamped is not None and content is not None and offset == entry.token_offset
                    and self._same_content(chunk_hash, content, stamped, None)):
                # Nothing new, or what every namespace here already holds.
                if new_claim and self._indexed(content, offset):
                    self._claim_for(chunk_hash, content, offset, namespace)
            else:
                # Namespaces part ways: from now on each keeps its own content.
                if reported is None and content is not None:
                    reported = (content if type(content) is bytes
                                else self._writer.tokens_of(chunk_hash))
                content = self._own_content(holds, content, offset,
                                            namespace if new_claim else None)
                offset = UNKNOWN_TOKEN_OFFSET
                self._store_own(chunk_hash, content, namespace, stamped, entry.token_offset)
        if type(content) is _OwnContent:
            if stamped is not None:  # displayed: the latest STORE's tokens, as LMCache
                reported = stamped
            elif len(entry.token_ids):
                reported = _packed(entry.token_ids, reported)
        elif stamped is not None:
            reported = None  # the content shows them
        elif len(entry.token_ids):
            reported = _packed(entry.token_ids, reported)
        self._bindings[chunk_hash] = (content, offset, holds, accesses, reported)

    def _alone(self, holds, namespace: BlendNamespace) -> bool:
        """Whether `namespace` is the only one with keys on the chunk."""
        if type(holds) is tuple:
            key_ns = self._key_ns
            return all(key_ns[key_no] == namespace for key_no in holds[0::2])
        return len(holds.keys_in) == 1

    def _same_content(self, chunk_hash: bytes, content: Content, tokens: bytes,
                      namespace: BlendNamespace | None) -> bool:
        """Whether `tokens` are `content` (bytes, or a digest of indexed tokens: another
        process's digest differs for the same tokens, so a differing one is checked
        against the index)."""
        if type(content) is bytes:
            return tokens == content
        return (_digest(tokens) == content
                or tokens == self._writer.tokens_of(chunk_hash, namespace))

    def _own_content(self, holds, content: Content, offset: int,
                     newcomer: BlendNamespace | None) -> "_OwnContent":
        """The shared content of a chunk as each namespace's own (but `newcomer`'s, new
        to the chunk: it had none): O(namespaces), once per chunk that parts ways."""
        own = _OwnContent(self._journal)
        if content is not None:
            for namespace in self._namespaces_of(holds):
                if namespace != newcomer:
                    own[namespace] = (content, offset)
        return own

    def _store_own(self, chunk_hash: bytes, own: "_OwnContent", namespace: BlendNamespace,
                   tokens: bytes | None, new_offset: int) -> None:
        """A STORE on a chunk whose namespaces keep their own content: with tokens they
        become the namespace's content and offset (the index moves only its claim);
        without, nothing changes (a namespace with no content of its own claims none)."""
        if tokens is None:
            return
        held = own.get(namespace)
        indexed = held is not None and held[1] >= 0
        if new_offset < 0:  # no position: its claim leaves the index
            if indexed:
                self._writer.remove_claim(chunk_hash, namespace)
            own[namespace] = (tokens, new_offset)
            return
        if not (indexed and self._same_content(chunk_hash, held[0], tokens, namespace)):
            if indexed:
                # Its claim leaves the old content first (what a failed batch restores).
                self._writer.remove_claim(chunk_hash, namespace)
            self._writer.add(tokens, chunk_hash, new_offset, namespace)
        elif held[1] != new_offset:  # the same content elsewhere: the claim moves in place
            self._writer.add(tokens, chunk_hash, new_offset, namespace)
        own[namespace] = (_digest(tokens), new_offset)

    def _stamped_tokens(self, entry: CacheEventEntry) -> bytes | None:
        """The entry's tokens as native uint32 bytes, or None when it carries no usable
        content (then the STORE is handled as a token-less one)."""
        token_ids = entry.token_ids
        if not len(token_ids):
            return None
        if len(token_ids) != self.chunk_size:  # not indexable at this chunk size
            self._counters["token_lists_wrong_length"] += 1
            self._warn_chunk_size(len(token_ids))
            return None
        if type(token_ids) is list:  # an id outside uint32: a miss, not a failed batch
            self._counters["token_lists_out_of_range"] += 1
            return None
        return token_ids.tobytes()

    def _warn_chunk_size(self, length: int) -> None:
        """Once per emitter (until it leaves): its STOREs are not indexed, say why."""
        emitter = self._emitter
        if emitter in self._size_warned or len(self._size_warned) >= _MAX_SIZE_WARNED:
            return
        self._size_warned.add(emitter)
        self._counters["chunk_size_mismatched_emitters"] += 1
        log.warning("instance %s stores chunks of %d tokens but this coordinator's chunk "
                    "size is %d: its STOREs are not indexed and blend lookups find none of "
                    "them. Run the coordinator with --chunk-size %d (or the server with "
                    "--chunk-size %d)", emitter, length, self.chunk_size, length,
                    self.chunk_size)

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
        if type(content) is bytes:
            same = tokens == content
        else:
            # A digest taken by another process (a loaded snapshot: `hash` is per process)
            # differs even for the same tokens, so a differing digest is checked against
            # the indexed tokens, and the binding takes this process's digest.
            digest = _digest(tokens)
            same = digest == content or tokens == self._writer.tokens_of(chunk_hash)
            content = digest if same else content
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

    def _delete(self, key: EncodedObjectKey, ident: int) -> None:
        """One DELETE entry: drop the placement of that identity; release what it was the
        last of."""
        # Looked up, not interned: deleting what was never stored must not grow the table.
        key_no = self._key_nos.get(
            (key.model_name, key.cache_salt, key.kv_rank, key.object_group_id))
        chunk_hash = bytes.fromhex(key.chunk_hash_hex)
        binding = self._bindings.get(chunk_hash)
        removed = place_no = None
        if binding is not None and key_no is not None:
            place_no = self._held_place(binding[2], key_no, ident)
        if place_no is not None:
            removed = self._remove_placement(binding[2], key_no, place_no)
        if removed is None:
            self._counters["deletes_unknown"] += 1
            return
        holds, key_gone, claim_gone, instance_gone = removed
        if instance_gone:
            instance_id = self._places[place_no][0]
            held = self._held_by[instance_id]
            held.discard(chunk_hash)
            if not held:  # nothing left: the instance costs nothing here any more
                del self._held_by[instance_id]
        self._release(chunk_hash, binding, holds,
                      [self._key_ns[key_no]] if claim_gone else [],
                      [key_no] if key_gone else [])

    def drop_instance(self, instance_id: str) -> None:
        """An instance left (deregistered, or silent past the timeout): its L1 was that
        process's memory, so its L1 placements go; its L2 placements stay (fleet storage,
        they leave by DELETE events). Its ingest cursor is forgotten, and its L1 batches
        of this incarnation are refused until it registers again (`readmit`; LMCache
        0.5.7's `drop_instance`, gate.py)."""
        with self._lock:
            self._counters["instances_dropped"] += 1
            try:
                self._fence(instance_id, l1_only=True)
            finally:
                self._gate.depart(instance_id)
                self._size_warned.discard(instance_id)
                for place in [p for p in self._capacity if p[0] == instance_id]:
                    del self._capacity[place]  # it declares its capacity again on return
                if self._writer is not None:
                    self._writer.flush()
                self._free_unused_places()
                self._free_unused_keys()

    def readmit(self, instance_id: str) -> None:
        """The instance registered (again): its L1 batches are taken again."""
        with self._lock:
            self._gate.readmit(instance_id)

    def bind_chunk_size(self, chunk_size: int) -> bool:
        """Index at `chunk_size` from now on (LMCache 0.5.7's `bind_chunk_size`, whose
        rules the caller checks); False if it already was. Chunks indexed at the old size
        cannot be chunks at the new one: they leave the index (their placements, and the
        tokens directory queries show, stay)."""
        with self._lock:
            if chunk_size == self.chunk_size:
                return False
            writer = self._writer
            for chunk_hash, binding in list(self._bindings.items()):
                content, offset, holds, accesses, reported = binding
                if content is None:
                    continue
                tokens = content if type(content) is bytes else writer.tokens_of(chunk_hash)
                self._bindings[chunk_hash] = (None, UNKNOWN_TOKEN_OFFSET, holds, accesses,
                                              reported if reported is not None else tokens)
            self.chunk_size = chunk_size
            self._size_warned.clear()
            if self._index is not None:
                from local_matcher import ContentIndex

                index = ContentIndex(chunk_size=chunk_size, probe_stride=self.probe_stride)
                self._writer = _IndexWriter(index, chunk_size)
                self._index = index
            return True

    def has_ghosts(self, registered: Callable[[str], bool]) -> bool:
        """Whether some id with a gate cursor is not `registered` and holds nothing."""
        with self._lock:
            return any(not registered(instance_id) and instance_id not in self._held_by
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
            gate, held = self._gate, self._held_by
            released = []
            for instance_id in gate.instances():
                if registered(instance_id) or instance_id in held:
                    gate.not_idle(instance_id)
                elif gate.idle_for(instance_id, now) > timeout:
                    released.append(instance_id)
            if not released:
                return released
            gone = set(released)
            for instance_id in released:
                gate.forget(instance_id)
                self._l1_by_instance.pop(instance_id, None)
            for place in [p for p in self._capacity if p[0] in gone]:
                del self._capacity[place]
            return released

    def _fence(self, instance_id: str, l1_only: bool = False) -> None:
        """Instance restarted: drop every placement it reported (and what they held); or,
        `l1_only`, only its L1 placements."""
        if not l1_only:
            self._counters["instances_fenced"] += 1
        places = self._places
        for chunk_hash in self._held_by.pop(instance_id, ()):
            binding = self._bindings[chunk_hash]
            holds, lost, gone, kept, removed = binding[2], [], [], False, False
            for key_no, place_no in self._placements_in(holds):
                place = places[place_no]
                if place[_INSTANCE] != instance_id:
                    continue
                if l1_only and place[_TIER] != "l1":
                    kept = True
                    continue
                holds, key_gone, claim_gone, _ = self._remove_placement(holds, key_no,
                                                                        place_no)
                removed = True
                if key_gone:
                    gone.append(key_no)
                if claim_gone:
                    lost.append(self._key_ns[key_no])
            if kept:
                self._held_by.setdefault(instance_id, set()).add(chunk_hash)
            if removed:
                self._release(chunk_hash, binding, holds, lost, gone)

    def _release(self, chunk_hash: bytes, binding: tuple, holds, lost: list, gone: list
                 ) -> None:
        """Placements gone: each namespace left without a key drops its claim (the last
        claim drops the occupant), and each key gone its access count; a binding without
        placements is forgotten. A chunk whose namespaces kept their own content and
        that one namespace is left on holds that one's again."""
        content, offset, _, accesses, reported = binding
        if type(content) is _OwnContent:
            for namespace in lost:
                held = content.pop(namespace, None)
                if held is not None and held[1] >= 0:
                    self._writer.remove_claim(chunk_hash, namespace)
            if holds:
                left = self._namespaces_of(holds) if type(holds) is tuple or len(
                    holds.keys_in) == 1 else ()
                if len(left) == 1:
                    content, offset = content.get(left[0], (None, UNKNOWN_TOKEN_OFFSET))
        elif self._writer is not None and self._indexed(content, offset):
            for namespace in lost:
                self._writer.remove_claim(chunk_hash, namespace)
        if holds:
            if accesses and gone:
                accesses = _forget_accesses(accesses, gone)
            self._bindings[chunk_hash] = (content, offset, holds, accesses, reported)
        else:
            del self._bindings[chunk_hash]

    # --- placements of one chunk (flat tuple, or _ManyKeys past _FEW) -------------------

    def _add_placement(self, holds, key_no: int, place_no: int) -> tuple[object, bool]:
        """Record `(key_no, place_no)`; returns (holds, whether the key's namespace is
        new to this chunk). Counts keys and placements."""
        key_ns, namespace = self._key_ns, self._key_ns[key_no]
        idents, ident = self._place_idents, self._place_idents[place_no]
        if type(holds) is tuple:
            new_key = new_claim = True
            for i in range(0, len(holds), 2):
                if holds[i] == key_no:
                    new_key = new_claim = False
                    if idents[holds[i + 1]] == ident:
                        if holds[i + 1] != place_no:  # reported again: the latest report
                            self._replace_place(holds[i + 1], place_no)
                            holds = holds[:i + 1] + (place_no,) + holds[i + 2:]
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
            else:
                new_claim = False
                for i, held in enumerate(places):
                    if idents[held] == ident:
                        if held != place_no:  # reported again: the latest report
                            self._replace_place(held, place_no, holds)
                            holds.places[key_no] = places[:i] + (place_no,) + places[i + 1:]
                        return holds, False
            holds.places[key_no] = places + (place_no,)
            instance = self._places[place_no][0]
            holds.placements_of[instance] = holds.placements_of.get(instance, 0) + 1
            holds.count += 1
        if new_key:
            self._key_refs[key_no] = self._key_refs.get(key_no, 0) + 1
            self._num_keys += 1
        self._num_placements += 1
        self._count(place_no, 1)
        return holds, new_claim

    def _replace_place(self, old: int, new: int, many: _ManyKeys | None = None) -> None:
        """A placement's place is replaced by a new report of the same identity (another
        size or incarnation, or, for a shared pool, another reporter)."""
        self._count(old, -1)
        self._count(new, 1)
        if many is not None:
            old_instance, new_instance = self._places[old][0], self._places[new][0]
            if old_instance != new_instance:
                many.placements_of[old_instance] -= 1
                if not many.placements_of[old_instance]:
                    del many.placements_of[old_instance]
                many.placements_of[new_instance] = many.placements_of.get(new_instance, 0) + 1

    def _held_place(self, holds, key_no: int, ident: int) -> int | None:
        """The place number holding `key_no` with identity `ident`, if any."""
        idents = self._place_idents
        if type(holds) is tuple:
            for i in range(0, len(holds), 2):
                if holds[i] == key_no and idents[holds[i + 1]] == ident:
                    return holds[i + 1]
            return None
        for place_no in holds.places.get(key_no, ()):
            if idents[place_no] == ident:
                return place_no
        return None

    @staticmethod
    def _holds_key(holds, key_no: int) -> bool:
        return key_no in holds[0::2] if type(holds) is tuple else key_no in holds.places

    def _remove_placement(self, holds, key_no: int, place_no: int):
        """Drop `(key_no, place_no)`: (holds, whether the key lost its last placement,
        whether the key's namespace lost its last key here, whether the place's instance
        lost its last placement here), or None if there is no such placement. Counts keys
        and placements."""
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
        if key_gone:
            refs = self._key_refs[key_no] - 1
            if refs:
                self._key_refs[key_no] = refs
            else:
                del self._key_refs[key_no]
                self._maybe_unused_keys.add(key_no)
            self._num_keys -= 1
        self._num_placements -= 1
        self._count(place_no, -1)
        return holds, key_gone, claim_gone, instance_gone

    def _many_keys(self, flat: tuple[int, ...]) -> _ManyKeys:
        many = _ManyKeys(self._journal)
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

    # --- snapshots (coordinator_stub.snapshot pickles the directory) --------------------

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
        # they are, and `_stamp` checks a differing one against the indexed tokens.
        vars(self).update(state)
        self._lock = threading.Lock()

    # --- inspection ---------------------------------------------------------------------

    def placements_of(self, keys: list[tuple[bytes, tuple]]) -> list[tuple[list, list, int]]:
        """For each `(chunk_hash, (model_name, cache_salt, kv_rank, object_group_id))`:
        its places sorted by `(instance_id, tier, backend)`, the chunk's tokens (empty
        when unknown; they belong to the chunk, so any of its keys shows them) and the
        key's access count. Unknown keys get `([], tokens, 0)`. Cost: per key, its own
        placements (a chunk's tokens are converted once per call)."""
        results = []
        tokens_of: dict[bytes, list[int]] = {}
        with self._lock:
            for chunk_hash, raw_key in keys:
                binding = self._bindings.get(chunk_hash)
                if binding is None:
                    results.append(([], [], 0))
                    continue
                tokens = tokens_of.get(chunk_hash)
                if tokens is None:
                    tokens = tokens_of[chunk_hash] = self._tokens_of(chunk_hash, binding)
                key_no = self._key_nos.get(raw_key)
                if key_no is None:
                    results.append(([], tokens, 0))
                    continue
                holds = binding[2]
                place_nos = ([holds[i + 1] for i in range(0, len(holds), 2)
                              if holds[i] == key_no] if type(holds) is tuple
                             else holds.places.get(key_no, ()))
                places = sorted((self._places[p] for p in place_nos), key=_place_order)
                results.append((places, tokens, _access_count(binding[3], key_no)))
        return results

    def with_other_groups(self, keys: list[tuple[bytes, tuple]]) -> list[tuple[bytes, tuple]]:
        """Each `(chunk_hash, raw_key)` followed by the stored keys of its chunk that
        differ from it only in object group, in ascending group order (LMCache's token
        lookups resolve group 0 and follow these). A chunk's keys are read once."""
        expanded: list[tuple[bytes, tuple]] = []
        by_chunk: dict[bytes, dict[tuple, list[tuple]]] = {}
        with self._lock:
            for chunk_hash, raw_key in keys:
                groups = by_chunk.get(chunk_hash)
                if groups is None:
                    groups = by_chunk[chunk_hash] = {}
                    binding = self._bindings.get(chunk_hash)
                    holds = binding[2] if binding is not None else ()
                    key_nos = (dict.fromkeys(holds[0::2]) if type(holds) is tuple
                               else holds.places)
                    for key_no in key_nos:
                        stored = self._key_raw[key_no]
                        groups.setdefault(stored[:3], []).append(stored)
                expanded.append((chunk_hash, raw_key))
                expanded.extend((chunk_hash, stored) for stored in sorted(
                    (stored for stored in groups.get(raw_key[:3], ()) if stored != raw_key),
                    key=lambda stored: stored[3]))
        return expanded

    def list_keys(self, tier: str, instance_id: str, backend: str, offset: int, limit: int
                  ) -> tuple[int, list[tuple[bytes, tuple, list, int, int]]]:
        """Keys with at least one placement matching the filters (`tier` "all" and empty
        strings match anything), as `(total, page)`; a page row is `(chunk_hash, raw_key,
        matching places, num_tokens, access_count)`. Order: by chunk, in the order chunks
        were first stored, then by key, in the order keys first held the chunk.

        The directory lock is held only to copy the binding table (flat bindings are
        immutable tuples, a `_ManyKeys` is read under the lock, and the interning tables
        only grow), so a listing walks a consistent snapshot while ingest goes on.
        """
        with self._lock:
            snapshot = [(chunk_hash,
                         len(reported) // 4 if reported is not None
                         else 0 if content is None or type(content) is _OwnContent
                         else self.chunk_size,
                         holds if type(holds) is tuple else self._placements_in(holds),
                         accesses if type(accesses) is tuple else dict(accesses))
                        for chunk_hash, (content, _, holds, accesses, reported)
                        in self._bindings.items()]
        places, key_raw = self._places, self._key_raw
        total, page = 0, []
        for chunk_hash, num_tokens, holds, accesses in snapshot:
            pairs = zip(holds[0::2], holds[1::2]) if type(holds) is tuple else holds
            by_key: dict[int, list] = {}
            for key_no, place_no in pairs:
                place = places[place_no]
                if ((tier == "all" or place[_TIER] == tier)
                        and (not instance_id or place[_INSTANCE] == instance_id)
                        and (not backend or place[_BACKEND] == backend)):
                    by_key.setdefault(key_no, []).append(place)
            for key_no, matching in by_key.items():
                if offset <= total < offset + limit:
                    matching.sort(key=_place_order)
                    page.append((chunk_hash, key_raw[key_no], matching, num_tokens,
                                 _access_count(accesses, key_no)))
                total += 1
        return total, page

    def _tokens_of(self, chunk_hash: bytes, binding: tuple) -> list[int]:
        """The tokens directory queries show for a chunk (see the module docstring)."""
        content, reported = binding[0], binding[4]
        if reported is not None:
            return np.frombuffer(reported, dtype=np.uint32).tolist()
        if content is None or type(content) is _OwnContent:
            return []
        if type(content) is bytes:
            return np.frombuffer(content, dtype=np.uint32).tolist()
        tokens = self._writer.tokens_of(chunk_hash) if self._writer is not None else None
        return [] if tokens is None else np.frombuffer(tokens, dtype=np.uint32).tolist()

    def totals(self) -> dict[str, int]:
        """Running totals, read without the lock (metrics scrapes must never wait for
        ingest): each value is one int, current as of some moment of ingest."""
        l1, l2 = self._tier_totals["l1"], self._tier_totals["l2"]
        return {"num_keys": self._num_keys, "num_placements": self._num_placements,
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
            l1, l2 = self._tier_totals["l1"], self._tier_totals["l2"]
            return {
                "num_keys": self._num_keys,
                "num_placements": self._num_placements,
                # An entry for every instance the gate has a stream for (LMCache: from its
                # first admitted batch until it is dropped).
                "l1_keys_by_instance": {instance_id: self._l1_by_instance.get(instance_id, 0)
                                        for instance_id in self._gate.instances()},
                "blend": blend,
                "l1_count": l1[0],
                "l1_size_bytes": l1[1],
                "l2_count": l2[0],
                "l2_size_bytes": l2[1],
                "num_bindings": len(self._bindings),
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


def _packed(token_ids: TokenIds, unchanged: bytes | None) -> bytes | None:
    """Token ids of any length as native uint32 bytes; `unchanged` if one is outside
    uint32 (LMCache then leaves the chunk's tokens as they were)."""
    return unchanged if type(token_ids) is list else token_ids.tobytes()


def _place_order(place: Place) -> tuple[str, str, str]:
    return place[_INSTANCE], place[_TIER], place[_BACKEND]


def _forget_accesses(accesses, gone: list[int]):
    """`accesses` without the counts of the keys in `gone` (a dict is updated in place)."""
    if type(accesses) is not tuple:  # a (journaled) dict
        for key_no in gone:
            accesses.pop(key_no, None)
        return accesses
    return tuple(value for i in range(0, len(accesses), 2) if accesses[i] not in gone
                 for value in accesses[i:i + 2])


def _access_count(accesses, key_no: int) -> int:
    if type(accesses) is not tuple:  # a (journaled) dict
        return accesses.get(key_no, 0)
    for i in range(0, len(accesses), 2):
        if accesses[i] == key_no:
            return accesses[i + 1]
    return 0
