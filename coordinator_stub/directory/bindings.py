"""The binding lifecycle: what content and offset each chunk hash holds per namespace, and
the index updates each STORE, DELETE, ACCESS and fence makes (docs/DESIGN.md,
"Coordinator": the lifecycle table, one method per row; "Key directory internals": the
binding's representation; docs/WIRE.md, "Chunk hashes shared by namespaces").

Invariant, after every batch applied: a (chunk, namespace) claim is in the index iff that
namespace's content is known with an offset >= 0 and the namespace has a key on the chunk,
and then it is indexed with that content and offset. Not thread-safe: used under the
directory lock; index updates go through the `IndexWriter` only.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from blend_wire import (
    UNKNOWN_TOKEN_OFFSET,
    BlendNamespace,
    CacheEventBatch,
    CacheEventEntry,
    EncodedObjectKey,
    TokenIds,
)
from coordinator_stub.directory.binding_table import BindingTable
from coordinator_stub.directory.guard import foreign_place, what_stands
from coordinator_stub.directory.journal import Journal, JournaledDict
from coordinator_stub.directory.new_chunks import digest, shared_offset, store_batch
from coordinator_stub.directory.placements import (
    FEW,
    INSTANCE,
    TIER,
    Placements,
    holds_key,
    placements_in,
)
from coordinator_stub.directory.writer import IndexWriter

log = logging.getLogger(__name__)

_NO_ACCESSES: tuple = ()
#: Emitters remembered as warned of a chunk-size mismatch (forgotten when they leave).
_MAX_SIZE_WARNED = 4096

Content = bytes | int | None


def indexed(content: Content, offset: int) -> bool:
    return content is not None and offset >= 0


class OwnContent(JournaledDict):
    """The content of a chunk whose namespaces reported different tokens or offsets (or
    one reported none while another did): {namespace: (content, offset)}, `content` as
    for a binding (bytes, or the digest of indexed tokens). A namespace not in it has no
    content of its own for the chunk, and claims none. Journaled like the bindings; rare,
    so its GC tracking does not matter."""

    __slots__ = ()

    def __reduce__(self):
        return OwnContent, (self.journal, dict(self))


class Bindings:
    """One binding per chunk hash with a key, `(content, offset, holds, accesses,
    reported)`, and per instance the chunk hashes it holds a placement of."""

    #: While `KeyDirectory.ingest` applies batches: which reporters their token speaks
    #: for (its scope's instances); None: any. Set on the instance only meanwhile, so it
    #: is never part of a snapshot.
    speaks_for: Callable[[str], bool] | None = None

    def __init__(self, journal: Journal, placements: Placements, counters: dict[str, int],
                 trust_shared_hashes: bool) -> None:
        # LMCache's cross-namespace rules (DESIGN.md): one content per chunk hash, set by
        # whichever namespace stored it last, and claimed by a token-less STORE of any.
        self.trust_shared_hashes = trust_shared_hashes
        self._journal = journal
        self._placements = placements
        self._counters = counters  # the directory's: shared, restored by it on rollback
        # Journaled: what a batch changed here is undone if the batch fails.
        self.table = BindingTable(journal)
        # Per instance, the chunks of hot bindings it holds a placement of; the frozen
        # ones' are the table's to find (`BindingTable.thaw_instance`).
        self.held_by: dict[str, set[bytes]] = JournaledDict(journal)
        self.table.held_by, self.table.instance_of = self.held_by, placements.instance_of
        self._writer: IndexWriter | None = None  # blend lookup on: the index's one writer
        self.emitter = ""  # the instance whose batch is being applied
        self.size_warned: set[str] = set()  # emitters warned of a chunk-size mismatch

    @property
    def writer(self) -> IndexWriter | None:
        return self._writer

    @writer.setter
    def writer(self, writer: IndexWriter | None) -> None:
        self.table.use_index(None if writer is None else writer.index)
        self._writer = writer

    # --- the ingest pipeline's consumer (pipeline.py): admitted, journaled --------------

    def consume(self, batch: CacheEventBatch) -> None:
        """A STORE, DELETE or ACCESS batch (a `config` batch changes no binding)."""
        kind = batch.event_type
        placements = self._placements
        self.emitter = batch.instance_id  # named by a chunk-size mismatch warning
        if kind == "store":
            held = self.held_by.get(batch.instance_id)
            if held is None:
                self.held_by[batch.instance_id] = set()  # stored as a journaled set
                held = self.held_by[batch.instance_id]
            store_batch(batch, self.table, held, placements, self.writer, self._store)
            self._counters["entries_stored"] += len(batch.entries)
        elif kind == "delete":
            ident = placements.place_idents[placements.place_no(batch, 0)]
            for entry in batch.entries:
                self._delete(entry.key, ident)
            self._counters["entries_deleted"] += len(batch.entries)
        elif kind == "access":  # counted per key (recency, which it does not rank by)
            for entry in batch.entries:
                self._access(entry.key)
            self._counters["entries_accessed"] += len(batch.entries)

    def reindex(self, chunk_hashes: set[bytes]) -> None:
        """The index failed part-way through a batch: put back what the restored bindings
        say about the chunks it touched (best effort; logged if even that fails)."""
        _reindex(self.writer, self.table, self._placements, chunk_hashes)

    def unindex_all(self) -> None:
        """Every binding's content leaves the index (the chunk size changes); the tokens
        directory queries show are kept as `reported`."""
        writer = self.writer
        for chunk_hash, binding in list(self.table.items()):
            content, offset, holds, accesses, reported = binding
            if content is None:
                continue
            tokens = content if type(content) is bytes else writer.tokens_of(chunk_hash)
            self.table[chunk_hash] = (None, UNKNOWN_TOKEN_OFFSET, holds, accesses,
                                      reported if reported is not None else tokens)

    # --- the lifecycle table, one step per row ----------------------------------------

    def _store(self, entry: CacheEventEntry, chunk_hash: bytes, place_no: int,
               held: set[bytes]) -> None:
        """One STORE entry (of `chunk_hash`, its key's): record the placement, then the
        binding's content and offset. Unless shared hashes are trusted, what other
        instances reported stands (`guard.what_stands`)."""
        key_no = self._placements.key_no(entry.key)
        new_offset = shared_offset(entry.token_offset)
        binding = self.table.get(chunk_hash)
        content, offset, holds, accesses, reported = binding if binding is not None else (
            None, UNKNOWN_TOKEN_OFFSET, (), _NO_ACCESSES, None)
        # Blend lookup off: no content is recorded (or hashed).
        stamped = None if self.writer is None else self._stamped_tokens(entry)
        guarded = what_stands(self, chunk_hash, binding, key_no, place_no, stamped, new_offset)
        if guarded is None:
            return
        keep_place, stamped = guarded
        holds, new_claim = ((holds, False) if keep_place
                            else self._placements.add(holds, key_no, place_no))
        if self.writer is not None:
            namespace = self._placements.key_ns[key_no]
            if type(content) is OwnContent:
                self._store_own(chunk_hash, content, namespace, stamped, new_offset)
            elif (self.trust_shared_hashes or content is None and stamped is None
                  or self._placements.alone(holds, namespace)):
                # One namespace on the chunk (or LMCache's shared rules): the chunk's
                # content and offset are that namespace's.
                claimant = namespace if new_claim else None
                if stamped is not None:
                    content, offset = self._stamp(chunk_hash, content, offset, holds,
                                                  stamped, new_offset, claimant)
                elif claimant is not None and indexed(content, offset):
                    # STORE without tokens, content known: claim it for the key's namespace.
                    self._claim_for(chunk_hash, content, offset, claimant)
            elif (stamped is None and not new_claim) or (
                    stamped is not None and content is not None and offset == new_offset
                    and self._same_content(chunk_hash, content, stamped, None)):
                # Nothing new, or what every namespace here already holds.
                if new_claim and indexed(content, offset):
                    self._claim_for(chunk_hash, content, offset, namespace)
            else:
                # Namespaces part ways: from now on each keeps its own content.
                if reported is None and content is not None:
                    reported = (content if type(content) is bytes
                                else self.writer.tokens_of(chunk_hash))
                content = self._own_content(holds, content, offset,
                                            namespace if new_claim else None)
                offset = UNKNOWN_TOKEN_OFFSET
                self._store_own(chunk_hash, content, namespace, stamped, new_offset)
        if type(content) is OwnContent:
            if stamped is not None:  # displayed: the latest STORE's tokens, as LMCache
                reported = stamped
            elif len(entry.token_ids):
                reported = _packed(entry.token_ids, reported)
        elif stamped is not None:
            reported = None  # the content shows them
        elif len(entry.token_ids):
            reported = _packed(entry.token_ids, reported)
        self.table[chunk_hash] = (content, offset, holds, accesses, reported)
        if not keep_place and chunk_hash in self.table.hot:  # (the table counts frozen ones)
            held.add(chunk_hash)  # after the write: it thaws a frozen binding into `held`

    def _same_content(self, chunk_hash: bytes, content: Content, tokens: bytes,
                      namespace: BlendNamespace | None) -> bool:
        """Whether `tokens` are `content` (bytes, or a digest of indexed tokens: another
        process's digest differs for the same tokens, so a differing one is checked
        against the index)."""
        if type(content) is bytes:
            return tokens == content
        return (digest(tokens) == content
                or tokens == self.writer.tokens_of(chunk_hash, namespace))

    def _own_content(self, holds, content: Content, offset: int,
                     newcomer: BlendNamespace | None) -> OwnContent:
        """The shared content of a chunk as each namespace's own (but `newcomer`'s, new
        to the chunk: it had none): O(namespaces), once per chunk that parts ways."""
        own = OwnContent(self._journal)
        if content is not None:
            for namespace in self._placements.namespaces_of(holds):
                if namespace != newcomer:
                    own[namespace] = (content, offset)
        return own

    def _store_own(self, chunk_hash: bytes, own: OwnContent, namespace: BlendNamespace,
                   tokens: bytes | None, new_offset: int) -> None:
        """A STORE on a chunk whose namespaces keep their own content: with tokens they
        become the namespace's content and offset (the index moves only its claim);
        without, nothing changes (a namespace with no content of its own claims none)."""
        if tokens is None:
            return
        held = own.get(namespace)
        is_indexed = held is not None and held[1] >= 0
        if new_offset < 0:  # no position: its claim leaves the index
            if is_indexed:
                self.writer.remove_claim(chunk_hash, namespace)
            own[namespace] = (tokens, new_offset)
            return
        if not (is_indexed and self._same_content(chunk_hash, held[0], tokens, namespace)):
            if is_indexed:
                # Its claim leaves the old content first (what a failed batch restores).
                self.writer.remove_claim(chunk_hash, namespace)
            self.writer.add(tokens, chunk_hash, new_offset, namespace)
        elif held[1] != new_offset:  # the same content elsewhere: the claim moves in place
            self.writer.add(tokens, chunk_hash, new_offset, namespace)
        own[namespace] = (digest(tokens), new_offset)

    def _stamped_tokens(self, entry: CacheEventEntry) -> bytes | None:
        """The entry's tokens as native uint32 bytes, or None when it carries no usable
        content (then the STORE is handled as a token-less one)."""
        token_ids = entry.token_ids
        if not len(token_ids):
            return None
        if len(token_ids) != self.writer.chunk_size:  # not indexable at this chunk size
            self._counters["token_lists_wrong_length"] += 1
            _warn_chunk_size(self, len(token_ids))
            return None
        if type(token_ids) is list:  # an id outside uint32: a miss, not a failed batch
            self._counters["token_lists_out_of_range"] += 1
            return None
        return token_ids.tobytes()

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
            taken = digest(tokens)
            same = taken == content or tokens == self.writer.tokens_of(chunk_hash)
            content = taken if same else content
        if not same:
            # New text under a known hash: the old position belonged to the old text.
            if indexed(content, offset):
                self.writer.remove_chunk(chunk_hash)
            return self._fill_content(chunk_hash, holds, tokens, new_offset)
        if new_offset != offset:
            return self._move_offset(chunk_hash, holds, tokens, new_offset)
        if claimant is not None and indexed(content, offset):
            # Same content, same offset, a namespace new to the chunk: it claims it.
            self._claim_for(chunk_hash, content, offset, claimant)
        return content, offset

    def _fill_content(self, chunk_hash: bytes, holds, tokens: bytes, offset: int
                      ) -> tuple[Content, int]:
        """STORE that first fills a binding's content (or replaces it): with an offset,
        every namespace already on the binding claims it; -1 leaves it unindexed."""
        if offset < 0:
            return tokens, offset
        for namespace in self._placements.namespaces_of(holds):
            self.writer.add(tokens, chunk_hash, offset, namespace)
        return digest(tokens), offset

    def _move_offset(self, chunk_hash: bytes, holds, tokens: bytes, new_offset: int
                     ) -> tuple[Content, int]:
        """STORE with the same tokens at another offset: it becomes the chunk's offset;
        -1 un-indexes the chunk (a match needs a position)."""
        if new_offset < 0:
            self.writer.remove_chunk(chunk_hash)
            return tokens, new_offset
        # Indexed or not before, every namespace on the binding claims it at the new
        # offset (re-adding a claimed chunk only moves its offset).
        return self._fill_content(chunk_hash, holds, tokens, new_offset)

    def _claim_for(self, chunk_hash: bytes, content: Content, offset: int,
                   namespace: BlendNamespace) -> None:
        """Claim an indexed chunk for one more namespace (idempotent in the index)."""
        tokens = content if type(content) is bytes else self.writer.tokens_of(chunk_hash)
        if tokens is None:  # cannot happen while the invariant holds
            log.error("chunk %s is indexed but the index has no content for it",
                      chunk_hash.hex())
            return
        self.writer.add(tokens, chunk_hash, offset, namespace)

    def _access(self, key: EncodedObjectKey) -> None:
        """One ACCESS entry: the key's count grows, if the directory holds the key."""
        key_no = self._placements.known_key_no(key)
        chunk_hash = bytes.fromhex(key.chunk_hash_hex)
        binding = self.table.get(chunk_hash)
        if binding is None or key_no is None or not holds_key(binding[2], key_no):
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
            if len(accesses) < 2 * FEW:
                accesses += (key_no, 1)
            else:  # many keys accessed: a dict, O(1) per key from now on
                accesses = JournaledDict(self._journal, zip(accesses[0::2], accesses[1::2]))
                accesses[key_no] = 1
        self.table[chunk_hash] = binding[:3] + (accesses,) + binding[4:]

    def _delete(self, key: EncodedObjectKey, ident: int) -> None:
        """One DELETE entry: drop the placement of that identity; release what it was the
        last of. A shared pool's placement reported by an instance the emitter's token
        does not speak for stays (counted), unless shared hashes are trusted (LMCache:
        whoever deletes it)."""
        placements = self._placements
        key_no = placements.known_key_no(key)
        chunk_hash = bytes.fromhex(key.chunk_hash_hex)
        self.table.thaw(chunk_hash)  # into its instance's `held_by`, which this updates
        binding = self.table.get(chunk_hash)
        removed = place_no = None
        if binding is not None and key_no is not None:
            place_no = placements.held_place(binding[2], key_no, ident)
        if (place_no is not None and not self.trust_shared_hashes
                and foreign_place(self, place_no)):
            return
        if place_no is not None:
            removed = placements.remove(binding[2], key_no, place_no)
        if removed is None:
            self._counters["deletes_unknown"] += 1
            return
        holds, key_gone, claim_gone, instance_gone = removed
        if instance_gone:
            instance_id = placements.places[place_no][0]
            held = self.held_by[instance_id]
            held.discard(chunk_hash)
            if not held:  # nothing left: the instance costs nothing here any more
                del self.held_by[instance_id]
        self._release(chunk_hash, binding, holds,
                      [placements.key_ns[key_no]] if claim_gone else [],
                      [key_no] if key_gone else [])

    def holds_any(self, instance_id: str) -> bool:
        """Whether the instance holds a placement here (two dict reads: no lock needed)."""
        return instance_id in self.held_by or instance_id in self.table.frozen_of

    def fence(self, instance_id: str, departed: bool) -> None:
        """The instance restarted: drop its placements (and what they held); it `departed`:
        its L1 ones, and its chunk-size warning is forgotten."""
        if departed:
            self.size_warned.discard(instance_id)
        else:
            self._counters["instances_fenced"] += 1
        placements = self._placements
        places = placements.places
        self.table.thaw_instance(instance_id)
        # In creation order: index slots are freed in an order that does not depend on
        # how the set was filled (frozen chunks join it only now).
        for chunk_hash in self.table.in_creation_order(self.held_by.pop(instance_id, ())):
            binding = self.table.get(chunk_hash)
            if binding is None:  # its shared-pool placement went on with another reporter
                continue
            holds, lost, gone, kept, removed = binding[2], [], [], False, False
            for key_no, place_no in placements_in(holds):
                place = places[place_no]
                if place[INSTANCE] != instance_id:
                    continue
                if departed and place[TIER] != "l1":
                    kept = True
                    continue
                holds, key_gone, claim_gone, _ = placements.remove(holds, key_no, place_no)
                removed = True
                if key_gone:
                    gone.append(key_no)
                if claim_gone:
                    lost.append(placements.key_ns[key_no])
            if kept:
                self.held_by.setdefault(instance_id, set()).add(chunk_hash)
            if removed:
                self._release(chunk_hash, binding, holds, lost, gone)

    def _release(self, chunk_hash: bytes, binding: tuple, holds, lost: list, gone: list
                 ) -> None:
        """Placements gone: each namespace left without a key drops its claim (the last
        claim drops the occupant), and each key gone its access count; a binding without
        placements is forgotten. A chunk whose namespaces kept their own content and
        that one namespace is left on holds that one's again."""
        content, offset, _, accesses, reported = binding
        if type(content) is OwnContent:
            for namespace in lost:
                held = content.pop(namespace, None)
                if held is not None and held[1] >= 0:
                    self.writer.remove_claim(chunk_hash, namespace)
            if holds:
                left = self._placements.namespaces_of(holds) if type(holds) is tuple or len(
                    holds.keys_in) == 1 else ()
                if len(left) == 1:
                    content, offset = content.get(left[0], (None, UNKNOWN_TOKEN_OFFSET))
        elif self.writer is not None and indexed(content, offset):
            for namespace in lost:
                self.writer.remove_claim(chunk_hash, namespace)
        if holds:
            if accesses and gone:
                accesses = _forget_accesses(accesses, gone)
            self.table[chunk_hash] = (content, offset, holds, accesses, reported)
        else:
            del self.table[chunk_hash]


def _reindex(writer: IndexWriter, table: BindingTable, placements: Placements,
             chunk_hashes: set[bytes]) -> None:
    """`Bindings.reindex`."""
    index, replaced = writer.index, writer.replaced
    try:
        for chunk_hash in chunk_hashes:
            binding = table.get(chunk_hash)
            claims = [] if binding is None else _indexed_claims(placements, binding)
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
            index.remove_chunk(chunk_hash)
            for namespace, tokens, offset in restore:
                if tokens is None:
                    log.error("chunk %s cannot be re-indexed: its tokens are gone",
                              chunk_hash.hex())
                    continue
                index.add(tokens, chunk_hash, offset, namespace)
    except Exception:
        log.exception("re-indexing after a failed batch failed too; lookups may miss "
                      "chunks until they are stored again")


def _warn_chunk_size(bindings: Bindings, length: int) -> None:
    """Once per emitter (until it leaves): its STOREs are not indexed, say why."""
    emitter, chunk_size = bindings.emitter, bindings.writer.chunk_size
    if emitter in bindings.size_warned or len(bindings.size_warned) >= _MAX_SIZE_WARNED:
        return
    bindings.size_warned.add(emitter)
    bindings._counters["chunk_size_mismatched_emitters"] += 1
    log.warning("instance %s stores chunks of %d tokens but this coordinator's chunk "
                "size is %d: its STOREs are not indexed and blend lookups find none of "
                "them. Run the coordinator with --chunk-size %d (or the server with "
                "--chunk-size %d)", emitter, length, chunk_size, length, chunk_size)


def _indexed_claims(placements: Placements, binding: tuple
                    ) -> list[tuple[BlendNamespace, Content, int]]:
    """(namespace, content, offset) of every claim the binding says is indexed."""
    content, offset, holds = binding[:3]
    if type(content) is OwnContent:
        return [(namespace, held[0], held[1]) for namespace, held in content.items()
                if held[1] >= 0]
    if not indexed(content, offset):
        return []
    return [(namespace, content, offset) for namespace in placements.namespaces_of(holds)]


def _packed(token_ids: TokenIds, unchanged: bytes | None) -> bytes | None:
    """Token ids of any length as native uint32 bytes; `unchanged` if one is outside
    uint32 (LMCache then leaves the chunk's tokens as they were)."""
    return unchanged if type(token_ids) is list else token_ids.tobytes()


def _forget_accesses(accesses, gone: list[int]):
    """`accesses` without the counts of the keys in `gone` (a dict is updated in place)."""
    if type(accesses) is not tuple:  # a (journaled) dict
        for key_no in gone:
            accesses.pop(key_no, None)
        return accesses
    return tuple(value for i in range(0, len(accesses), 2) if accesses[i] not in gone
                 for value in accesses[i:i + 2])


def access_count(accesses, key_no: int) -> int:
    if type(accesses) is not tuple:  # a (journaled) dict
        return accesses.get(key_no, 0)
    for i in range(0, len(accesses), 2):
        if accesses[i] == key_no:
            return accesses[i + 1]
    return 0
