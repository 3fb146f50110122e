"""The coordinator's request logic, free of HTTP: request bodies in, reply values or bodies
out (endpoints: docs/WIRE.md; structure: docs/DESIGN.md, "Coordinator layout").

Contract:
- Reads: `parse_lookup(body, shape, scope)` validates a blend-lookup (or blend-score) body
  once (shape, salt against the reader's `Scope`, size from the text: `TooLarge`) and
  `matches` / `scores` take the parsed request (`lookup` / `score` do both, for large
  bodies parsed off the loop). `directory_lookup(body)`, `directory_keys(query)`,
  `stats()`: the operators' queries, reply bodies.
- Registry: `parse_register(body, scope)` (a scoped emitter's `chunk_size` must be the
  coordinator's, `ChunkSizeConflict` otherwise, and is dropped: it binds nothing),
  `check_registration` (binds the chunk size a registration carries), `register`, `heartbeat`, `deregister`, `drop_instance` (fences an
  instance's L1 under the directory lock), `release_ghosts(timeout)`, `instances_listing`.
  The write paths (`coordinator_stub.writes`) call these.
- `bind_chunk_size(body)` / `bind(size)`: LMCache 0.5.7's rules against `--chunk-size`
  (`ChunkSizeConflict` otherwise; replicas keep their `--chunk-size`); all or nothing (a
  bind that raises leaves the size, the index and the binding as they were).
- Refusals are `coordinator_stub.errors`' and `blend_wire.WireError`; none changes state.
  Everything here may block (locks, CPU): the HTTP layer runs it off the event loop,
  except `matches` / `scores` of a small body with `wait=False`, which never wait for a
  lock (`IndexBusy` instead) and so may run on the loop.

Ready means compiled: `Coordinator(config)` compiles the wire's decoding kernels
(`blend_wire.compile_decoding`: `/events` bodies and blend queries) and, with blend lookup
on, rehearses every directory and index operation on a scratch directory, so each numba
kernel the coordinator uses is compiled (or loaded from numba's cache) before the first
request. On a cold cache that takes seconds (about 20 s of CPU for the wire's kernels on
the 2-core AMD EPYC VM of docs/BENCHMARKS.md, load not recorded, 2026-12-02); numba caches them beside the sources, so it is once per checkout.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import numpy as np

from blend_wire import (
    MAX_TOKEN_IDS,
    BlendCandidatesReply,
    BlendLookupReply,
    BlendLookupRequest,
    BlendQuery,
    BlendScoreReply,
    BlendScoreRequest,
    CacheEventBatch,
    ChunkSizeBindReply,
    ChunkSizeBindRequest,
    DirectoryKeyInfo,
    DirectoryKeysQuery,
    DirectoryKeysReply,
    DirectoryLookupReply,
    DirectoryLookupRequest,
    EncodedObjectKey,
    EventsRequest,
    KeyPlacements,
    WireCandidateColumns,
    WireChunkOffer,
    WireFoundContent,
    RegisterReply,
    RegisterRequest,
    WireBlendMatch,
    WirePlacement,
    check_cache_salt,
    check_model_name,
    compile_decoding,
    convert_query,
    decode,
    decode_tokens,
    encode,
    encode_b64,
    encode_tokens,
    encode_uints,
    lookup_kv_ranks,
    pack_kv_rank,
    prefix_chunk_hashes,
)
from coordinator_stub.config import CoordinatorConfig
from coordinator_stub.errors import BadRequest, ChunkSizeConflict, Forbidden, TooLarge
from coordinator_stub.scopes import ANY, Scope
from coordinator_stub.directory import KeyDirectory, Tally
from coordinator_stub.directory.queries import PlaceColumns
from coordinator_stub.service.instances import InstanceRegistry
from coordinator_stub.service.quotas import InstanceQuota, capped
from coordinator_stub.service.score import prefix_places, score_instances
from local_matcher.chunk_hashes import hash_block
from local_matcher.types import CandidateColumns


log = logging.getLogger(__name__)


_EMPTY_DIRECTORY_LOOKUP = encode(DirectoryLookupReply(chunks=0, results=[]))


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        fresh = self.fresh_state()
        self.directory: KeyDirectory = fresh["directory"]
        self.instances: InstanceRegistry = fresh["instances"]
        self.quota = InstanceQuota(config.max_instances_per_scope, self._keeps,
                                   retry_after_s=round(config.instance_timeout))
        self._chunk_size_bound = False
        self._bind_lock = threading.Lock()
        compile_decoding()  # before any request, which would otherwise wait for it
        if config.enable_blend_lookup:
            _rehearse(config)

    # --- ingest: both write paths end here (directory/pipeline.py) -------------------------

    def ingest(self, batches: list[CacheEventBatch], scope: Scope | None = None) -> Tally:
        """Validated batches, in order, through the gate to the directory's consumers.
        `scope`: the poster's token's (None: any); a shared pool's placement another
        reporter holds changes only if the scope names that reporter."""
        speaks_for = None if scope is None or scope.instances is None else scope.allows_instance
        return self.directory.ingest(batches, speaks_for)

    # --- blend lookups -------------------------------------------------------------------------

    def lookup(self, body: bytes, scope: Scope = ANY) -> BlendLookupReply:
        return self.matches(self.parse_lookup(body, scope=scope))

    def parse_lookup(self, body: bytes, shape: type[BlendQuery] = BlendLookupRequest,
                     scope: Scope = ANY) -> BlendQuery:
        """Validate a blend-lookup (or blend-score) body's shape, its salt against the
        reader's `scope` (`Forbidden`), and its size from the text alone."""
        request = decode(body, shape)
        scope.check_salt(request.cache_salt, "$.cache_salt")
        # Base64 carries 3 bytes per 4 characters (padding aside): refuse an oversized
        # query from its text length, before spending time and memory decoding it.
        cap = self.config.max_query_tokens
        if (len(request.tokens_b64) // 4 * 3 - 2) // 4 > cap:
            raise TooLarge(f"query exceeds {cap} tokens (--max-query-tokens)")
        return request

    def _tokens(self, request: BlendQuery) -> np.ndarray:
        """The query's tokens (WireError if they are not valid), within the size cap."""
        tokens = decode_tokens(request.tokens_b64)
        if tokens.size > self.config.max_query_tokens:
            raise TooLarge(f"query of {tokens.size} tokens exceeds "
                           f"{self.config.max_query_tokens} (--max-query-tokens)")
        return tokens

    def matches(self, request: BlendLookupRequest, *, wait: bool = True) -> BlendLookupReply:
        """Decode the query's tokens (WireError if they are not valid) and match them.
        `wait=False`: `IndexBusy` rather than wait while ingest writes the index."""
        tokens = self._tokens(request)
        if request.candidates:
            return self._candidates(tokens, request.namespace, wait, request.columns)
        if not self.directory.blend_enabled or tokens.size < self.directory.chunk_size:
            return BlendLookupReply(matches=[])
        return BlendLookupReply(matches=[
            WireBlendMatch(chunk_hash=m.chunk_hash.hex(), old_st=m.old_st, cur_st=m.cur_st)
            for m in self.directory.match(tokens, request.namespace, wait=wait)])

    def _candidates(self, tokens, namespace, wait: bool, columns: bool = False
                    ) -> BlendCandidatesReply:
        directory = self.directory
        found, places = self._found_and_placed(tokens, namespace, wait)
        reply = BlendCandidatesReply(chunk_size=directory.chunk_size,
                                     blend_lookup=directory.blend_enabled,
                                     truncated=found.truncated)
        wire = _wire_columns(found, places) if columns else None
        if wire is not None:
            reply.columns = wire
        else:
            reply.candidates = _wire_objects(found, places)
        return reply

    def _found_and_placed(self, tokens: np.ndarray, namespace, wait: bool
                          ) -> tuple[CandidateColumns, PlaceColumns]:
        """The contents found in `tokens` (columns) and where each of their chunks is held
        in `namespace`: what the candidates form and the score are both built from."""
        found = self.directory.candidate_columns(tokens, namespace, wait=wait)
        return found, self.directory.place_columns(found.chunk_hashes, namespace, found.slots)

    def score(self, body: bytes, scope: Scope = ANY, *, everyone: bool = True
              ) -> BlendScoreReply:
        return self.scores(self.parse_lookup(body, BlendScoreRequest, scope),
                           everyone=everyone)

    def scores(self, request: BlendScoreRequest, *, wait: bool = True,
               everyone: bool = True) -> BlendScoreReply:
        """WIRE.md's `/directory/blend-score`: every registered instance asked for (all by
        default) scored by what its unified lookup would reuse (`coordinator_stub.service.score`).
        `wait` as `matches`. `everyone` False (a caller that may not list the registry):
        only the instances whose L1 holds some of the request in its namespace."""
        tokens = self._tokens(request)
        namespace = request.namespace
        directory = self.directory
        size = directory.chunk_size
        instance_ids = self.instances.ids()
        if request.instance_ids is not None:
            asked = set(request.instance_ids)
            instance_ids = [i for i in instance_ids if i in asked]
        found, places = self._found_and_placed(tokens, namespace, wait)
        prefix = prefix_places(directory, tokens, namespace, size)
        if not everyone:
            holders = set(places.instances).union(prefix.instances)
            instance_ids = [i for i in instance_ids if i in holders]
        return BlendScoreReply(chunk_size=size, instances=score_instances(
            instance_ids, found, places, prefix, size, self.config.score_shared_weight,
            self.config.score_peer_weight))

    # --- directory queries ------------------------------------------------------------------

    def directory_lookup(self, body: bytes) -> bytes:
        request = decode(body, DirectoryLookupRequest)
        if request.keys:
            keys = [(bytes.fromhex(k.chunk_hash_hex), _raw_key(k)) for k in request.keys]
            chunks = len(keys)
        else:
            keys = self._resolve_tokens(request)
            if not keys:
                return _EMPTY_DIRECTORY_LOOKUP
            chunks = len(keys) // request.world_size
            keys = self.directory.with_other_groups(keys)
        results = [
            KeyPlacements(key=_encoded_key(chunk_hash, raw),
                          placements=[_wire_placement(p) for p in placements],
                          token_ids=tokens, access_count=access_count)
            for (chunk_hash, raw), (placements, tokens, access_count)
            in zip(keys, self.directory.placements_of(keys))]
        return encode(DirectoryLookupReply(chunks=chunks, results=results))

    def _resolve_tokens(self, request: DirectoryLookupRequest) -> list[tuple[bytes, tuple]]:
        """The object keys (object group 0) of every complete chunk, chunk-major."""
        if len(request.token_ids) > MAX_TOKEN_IDS:
            raise BadRequest(f"too many token_ids in a single request "
                             f"(limit={MAX_TOKEN_IDS}, got={len(request.token_ids)})")
        try:
            check_model_name(request.model_name)
            check_cache_salt(request.cache_salt)
            pack_kv_rank(request.world_size)
        except ValueError as exc:  # WireError is one: a world size beyond a kv_rank byte
            raise BadRequest(str(exc)) from None
        tokens = np.asarray(request.token_ids, dtype=np.uint32)
        ranks = lookup_kv_ranks(request.world_size)
        return [(chunk_hash, (request.model_name, request.cache_salt, kv_rank, 0))
                for chunk_hash in prefix_chunk_hashes(tokens, self.directory.chunk_size)
                for kv_rank in ranks]

    def directory_keys(self, query: dict[str, str]) -> bytes:
        params = convert_query(query, DirectoryKeysQuery)
        total, page = self.directory.list_keys(params.tier, params.instance_id,
                                               params.backend, params.offset, params.limit)
        return encode(DirectoryKeysReply(total=total, keys=[
            DirectoryKeyInfo(key=_encoded_key(chunk_hash, raw),
                             placements=[_wire_placement(p) for p in placements],
                             num_tokens=num_tokens, access_count=access_count)
            for chunk_hash, raw, placements, num_tokens, access_count in page]))

    def stats(self) -> bytes:
        return encode(self.directory.stats())

    # --- the instance registry (event loop) ------------------------------------------------

    def bind_chunk_size(self, body: bytes) -> bytes:
        """`PUT /config/chunk-size` (the module doc says the rules)."""
        chunk_size = self.bind(decode(body, ChunkSizeBindRequest).chunk_size)
        return encode(ChunkSizeBindReply(chunk_size=chunk_size))

    def bind(self, chunk_size: int) -> int:
        """Bind the fleet's chunk size (the module doc's rules); the bound size, or
        ChunkSizeConflict."""
        with self._bind_lock:
            current = self.directory.chunk_size
            if self._chunk_size_bound:
                if chunk_size == current:
                    return current
                raise ChunkSizeConflict(
                    f"coordinator is already bound to chunk size {current}; use a separate "
                    f"coordinator for a fleet requiring chunk size {chunk_size}")
            minimum = self.config.chunk_size
            if chunk_size < minimum:
                raise ChunkSizeConflict(
                    f"chunk size {chunk_size} is smaller than the coordinator's configured "
                    f"minimum {minimum} (--chunk-size)")
            if self.config.cluster is not None and chunk_size != minimum:
                raise ChunkSizeConflict(
                    f"coordinator replicas over an event log keep their --chunk-size "
                    f"({minimum}); restart every replica with --chunk-size {chunk_size}")
            if self.directory.bind_chunk_size(chunk_size):
                log.info("chunk size bound to %d (configured minimum %d)", chunk_size,
                         minimum)
            self._chunk_size_bound = True
            return chunk_size

    def parse_register(self, body: bytes, scope: Scope = ANY) -> RegisterRequest:
        """A `POST /instances` body, validated (`WireError`) and checked against the
        emitter's `scope` (`Forbidden`); off the event loop (a body may be large)."""
        request = decode(body, RegisterRequest)
        if scope.instances is not None:
            if not request.instance_id:
                raise Forbidden(f"this token may register only instances matching "
                                f"{','.join(scope.instances)}: name one in instance_id "
                                "(an empty one would be assigned at random)")
            scope.check_instance(request.instance_id, "$.instance_id")
        if not scope.unrestricted:
            self.quota.admit(scope, request.instance_id, "$.instance_id")
        if request.chunk_size is not None and not scope.unrestricted:
            request = self._unbound_by_scoped(request)
        return request

    def _unbound_by_scoped(self, request: RegisterRequest) -> RegisterRequest:
        """A registration of a scoped emitter does not bind the fleet's chunk size (as
        `PUT /config/chunk-size` needs an unscoped emitter: the size applies to every
        tenant). Its size must be the coordinator's, bound or not (else
        `ChunkSizeConflict`); it is registered without it (WIRE.md, "Instances")."""
        current = self.directory.chunk_size
        if request.chunk_size != current:
            raise ChunkSizeConflict(
                f"this server's chunk size is {request.chunk_size} and the coordinator's is "
                f"{current}; a token scoped by instances= or salts= cannot bind the fleet's "
                f"chunk size: start the coordinator with --chunk-size {request.chunk_size}, "
                "or bind it with an unscoped emitter token (PUT /config/chunk-size)")
        return msgspec.structs.replace(request, chunk_size=None)

    def capped(self, scope: Scope) -> Scope:
        """`scope` as `/events` checks it: its emitters counted (`service.quotas`)."""
        return capped(scope, self.quota)

    def _keeps(self, instance_id: str) -> bool:
        """Whether the coordinator keeps anything of the id (registered, a cursor, a
        placement): what an instance quota counts."""
        return instance_id in self.instances or self.directory.tracks(instance_id)

    def check_registration(self, request: RegisterRequest) -> RegisterRequest:
        """Bind the chunk size a registration carries (ChunkSizeConflict)."""
        if request.chunk_size is not None:
            self.bind(request.chunk_size)
        return request

    def register(self, request: RegisterRequest) -> bytes:
        """`POST /instances`: bind the size it carries, register, take its L1 again."""
        self.check_registration(request)
        return self.admit(request)

    def admit(self, request: RegisterRequest, at: float | None = None) -> bytes:
        """Register an instance whose chunk size was checked (a replica's log record:
        `at` is log time) and take its L1 batches again (gate.py): the reply body."""
        instance_id, re_registered = self.instances.register(request, at=at)
        self.directory.readmit(instance_id)
        return encode(RegisterReply(instance_id=instance_id, re_registered=re_registered))

    def heartbeat(self, instance_id: str, at: float | None = None) -> bool:
        """Whether the instance is registered (False: it must re-register)."""
        return self.instances.heartbeat(instance_id, at=at)

    def registered(self, instance_id: str) -> bool:
        return instance_id in self.instances

    def registered_ids(self) -> list[str]:
        return self.instances.ids()

    def silent(self, timeout: float, now: float | None = None) -> list[str]:
        """Registered ids not heard of for over `timeout` s (by `now`, default now)."""
        return self.instances.silent(timeout, now=now)

    def deregister(self, instance_id: str) -> None:
        """Forget the registration; the caller then runs `drop_instance`."""
        self.instances.deregister(instance_id)

    def drop_instance(self, instance_id: str) -> None:
        """The instance's L1 fenced and its cursor forgotten (`KeyDirectory.drop_instance`)."""
        self.directory.drop_instance(instance_id)

    def depart(self, instance_id: str) -> None:
        """The instance leaves: deregistered, then dropped."""
        self.deregister(instance_id)
        self.drop_instance(instance_id)

    def release_ghosts(self, timeout: float, now: float | None = None) -> list[str]:
        """The reaper's sweep of ids that are not registered and hold nothing: those that
        sent no batch for over `timeout` lose their gate cursor and capacity rows
        (`KeyDirectory.release_ghosts`; `now`: monotonic seconds, by default now)."""
        return self.directory.release_ghosts(self.instances.__contains__,
                                             time.monotonic() if now is None else now,
                                             timeout)

    def has_ghosts(self) -> bool:
        """Whether some id with an ingest cursor is not registered and holds nothing."""
        return self.directory.has_ghosts(self.instances.__contains__)

    # --- state (a replica's snapshot) -------------------------------------------------------

    def state(self) -> dict:
        """What a snapshot holds of this coordinator (take it between two batches)."""
        return {"directory": self.directory, "instances": self.instances}

    def take_state(self, state: dict) -> None:
        """Take a loaded snapshot's state in place (whoever holds the directory and the
        registry sees it)."""
        self.directory.restore_from(state["directory"])
        self.instances.restore_from(state["instances"])

    def fresh_state(self) -> dict:
        """The state of a coordinator that has applied nothing."""
        config = self.config
        return {"directory": KeyDirectory(chunk_size=config.chunk_size,
                                          probe_stride=config.blend_probe_stride,
                                          enable_blend_lookup=config.enable_blend_lookup,
                                          trust_shared_hashes=config.trust_shared_hashes),
                "instances": InstanceRegistry()}

    def instances_listing(self) -> bytes:
        return encode(self.instances.listing())


def _wire_columns(found: CandidateColumns, places: PlaceColumns) -> WireCandidateColumns | None:
    """The candidates as columns (WIRE.md, "The columns form"), built from the columns the
    index and the placements give: no Python object per content or chunk. None when the
    form cannot say them (hashes of different lengths, an offset never reported): the
    caller answers the objects form, which the client reads as well."""
    block = hash_block(found.chunk_hashes)
    if block is None or (found.old_st.size and found.old_st.min() < 0):
        return None
    counts = lambda starts: starts[1:] - starts[:-1]  # noqa: E731
    return WireCandidateColumns(
        position_counts=encode_uints(counts(found.position_start)),
        positions=encode_uints(found.positions),
        chunk_counts=encode_uints(counts(found.chunk_start)),
        hash_bytes=block[0], chunk_hashes=encode_b64(block[1]),
        old_st=encode_uints(found.old_st),
        holder_counts=encode_uints(counts(places.holder_start)),
        holders=encode_uints(places.holders), instances=places.instances,
        shared=encode_b64(np.packbits(places.shared, bitorder="little")))


def _wire_objects(found: CandidateColumns, places: PlaceColumns) -> list[WireFoundContent]:
    """The candidates as one JSON object per content and chunk (the objects form: per-chunk
    work the form asks for)."""
    names, shared = places.instances, places.shared.tolist()
    holder_start, holders = places.holder_start.tolist(), places.holders.tolist()
    offers = [WireChunkOffer(chunk_hash=chunk_hash.hex(), old_st=old_st, l1=tuple(
                  names[k] for k in holders[holder_start[i]:holder_start[i + 1]]),
                  shared=bool(shared[i]))
              for i, (chunk_hash, old_st) in enumerate(zip(found.chunk_hashes,
                                                           found.old_st.tolist()))]
    positions = found.positions.tolist()
    pos, chunks = found.position_start.tolist(), found.chunk_start.tolist()
    return [WireFoundContent(positions=positions[pos[i]:pos[i + 1]],
                             chunks=offers[chunks[i]:chunks[i + 1]])
            for i in range(found.num_contents)]


def _raw_key(key: EncodedObjectKey) -> tuple[str, str, int, int]:
    return key.model_name, key.cache_salt, key.kv_rank, key.object_group_id


def _encoded_key(chunk_hash: bytes, raw: tuple[str, str, int, int]) -> EncodedObjectKey:
    model_name, cache_salt, kv_rank, object_group_id = raw
    return EncodedObjectKey(chunk_hash_hex=chunk_hash.hex(), model_name=model_name,
                            kv_rank=kv_rank, object_group_id=object_group_id,
                            cache_salt=cache_salt)


def _wire_placement(place: tuple) -> WirePlacement:
    instance_id, incarnation, tier, backend, shared, size_bytes = place
    return WirePlacement(instance_id=instance_id, incarnation=incarnation, tier=tier,
                         backend=backend, size_bytes=size_bytes, shared=shared)


def _rehearse(config: CoordinatorConfig) -> None:
    """Run every directory/index operation once on a scratch directory, through the same
    decoding as real requests, so every kernel specialisation they use is compiled."""
    chunk_size = config.chunk_size
    scratch = KeyDirectory(chunk_size=chunk_size, probe_stride=config.blend_probe_stride,
                           enable_blend_lookup=True)
    first = np.arange(chunk_size, dtype=np.uint32)
    second = first + np.uint32(chunk_size)

    def batch(seq: int, event_type: str, entries: list[dict], incarnation: int = 0,
              instance: str = "rehearsal") -> dict:
        return {"instance_id": instance, "incarnation": incarnation, "seq": seq,
                "event_type": event_type, "tier": "l1", "backend": "dram",
                "entries": entries}

    def entry(chunk_hash: str, tokens: np.ndarray | None, salt: str = "") -> dict:
        key = {"chunk_hash_hex": chunk_hash, "model_name": "m", "kv_rank": pack_kv_rank(1),
               "cache_salt": salt}
        return {"key": key, "size_bytes": 1,
                "token_ids": [] if tokens is None else tokens.tolist(), "token_offset": 0}

    def ingest(*batches: dict) -> None:
        scratch.ingest(decode(encode({"batches": list(batches)}), EventsRequest).batches)

    ingest(batch(1, "store", [entry("01", first), entry("02", second)]),
           batch(2, "store", [entry("01", None, salt="s")]),     # claim known content
           batch(3, "store", [entry("02", first)]),               # new content, same hash
           batch(4, "access", [entry("01", None)]))
    query = decode(encode({"tokens_b64": encode_tokens(np.concatenate([second, first])),
                           "model_name": "m"}), BlendLookupRequest)
    scratch.match(decode_tokens(query.tokens_b64), query.namespace)
    tokens, namespace = decode_tokens(query.tokens_b64), query.namespace
    found = scratch.candidate_columns(tokens, namespace)
    # The score's kernels too: compiled (or loaded) at the first score otherwise, which
    # then took seconds and held every lookup queued behind it.
    score_instances(["rehearsal"], found, scratch.place_columns(found.chunk_hashes, namespace),
                    prefix_places(scratch, tokens, namespace, chunk_size), chunk_size, 0.5, 0.25)
    scratch.placements_of([(bytes.fromhex("01"), ("m", "", pack_kv_rank(1), 0))])
    ingest(batch(5, "delete", [entry("01", None, salt="s")]),    # one claim goes
           batch(1, "store", [entry("03", second)], incarnation=1))  # fence the rest
    scratch.drop_instance("rehearsal")
    if scratch.stats()["num_keys"] != 0:
        raise RuntimeError("coordinator self-test failed: the scratch directory kept keys")


__all__ = ["Coordinator"]

