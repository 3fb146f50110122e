"""The plugin inside a real LMCache 0.5.6 or 0.5.7rc2 MP server: the one module that
touches LMCache.

Load it into a stock server (CPU or GPU) with

    python -m lmcache.v1.multiprocess.server --engine-type blend ... \\
        --server-module '{"module_path": "plugin.lmcache_adapter"}'

(or `lmcache server ...` with the same flag), the same line on both versions. LMCache
0.5.6 calls the factory `build_server_modules` (its default factory name); 0.5.7 accepts
only `{"module_path", "config"}` and builds the `DiscoverableModule` subclasses it finds
here: `FleetBlend` (module name `fleet_blend`, built after LMCache's `blend`, whose
`cb_unified_lookup` and `store` handlers it then overrides, as 0.5.6's factory modules
did). The module's JSON `config` holds `PluginConfig` field overrides (they win over the
server's coordinator flags and the environment) plus `builtin_lookup` (see below).

Contract:
- Requires `--engine-type blend` (ValueError otherwise), no `--separate-object-groups`
  (ValueError: object groups split one server's layout into several keys per chunk, and
  the fleet's namespace leaves them out, so a chunk could not be found by a peer whose
  groups differ), and exactly the internals of one supported LMCache version
  (`SUPPORTED_VERSIONS`): at start-up every name in `LMCACHE_INTERNALS` plus that
  version's `VERSION_INTERNALS` is checked and a missing one fails the server with a
  message naming it (`missing_lmcache_internals`); another version fails naming both
  supported ones. `MOVED_IN_057` says what 0.5.7 moved and where the adapter finds it.
- LMCache 0.5.7 negotiates its chunk size when the first engine registers (the configured
  `--chunk-size` is a minimum, rounded up to the model's block alignment). When the bound
  size differs from the one the plugin was built with, the plugin's local matcher is
  rebuilt at it, empty, as LMCache empties its own matcher (nothing is stored before the
  binding: LMCache refuses to rebind once sessions exist).
- Replaces the `cb_unified_lookup` RPC with `BlendPlugin`'s: local matcher + coordinator leg in
  one budget, prefix filter, leftmost-greedy, one sparse prefetch. The host side
  (`LMCacheHost`) is LMCache's own prefix leg and sparse prefetch, so found chunks stay
  read-locked for the `cb_retrieve_pre_computed` that follows, stashed exactly where LMCache's
  lookup leaves them, and `segmented_prefix_segments` (`--enable-segmented-prefix`) is filled
  as LMCache fills it.
- Wraps the `store` RPC: LMCache's blend store runs unchanged, then (worker 0) the stored full
  chunks are registered in the local matcher under the request's namespace. A chunk leaves the
  local matcher only when it is gone from every tier this server reads: the event bus's L1 and
  L2 placement events are tracked per chunk, so an L1 eviction with an L2 copy is not a loss.
- One cache-event reporter per server. Under `lmcache server` with event reporting on,
  LMCache's own (tier-aware) subscriber reports and the plugin starts none. Under the ZMQ-only
  entry point (`python -m lmcache.v1.multiprocess.server`), which has none, the adapter reports
  every L1/L2 placement and removal with its tier and backend, STOREs with tokens and offsets.
- LMCache's own coordinator client is closed (its lookup is no longer served), unless the
  config says `"builtin_lookup": true`: then LMCache's lookup stays reachable, unchanged, as
  the server-module method `fleet_blend.builtin_cb_unified_lookup`, for side-by-side demos and
  benchmarks on the same server.
- Several coordinator URLs (replicas over one event log, comma-separated): LMCache 0.5.6's
  own coordinator components take one URL and break on a list (its registrar task dies on
  the invalid URL: the server never registers and its shutdown fails; its cache-event sink
  fails every flush: no event reaches any replica). So the adapter clears LMCache's URL on
  the coordinator config it shares with the HTTP front end, which reads it only after the
  modules are built: LMCache starts neither its registrar nor its event sink. The plugin's
  own take their place, failing over between replicas: the reporter (tier-aware, as for
  the ZMQ-only entry point) and, under `lmcache server`, `plugin.registrar` (register,
  heartbeat every `--coordinator-heartbeat-interval`, deregister on close, with LMCache's
  instance id, advertised ip and HTTP port). What LMCache's sink sent besides placements
  (ACCESS events, L2 capacity declarations) is not reported then. With `builtin_lookup`,
  LMCache's lookup client is rebuilt on the first URL. LMCache's P2P peer discovery (built
  before the adapter runs) keeps the list it cannot use: P2P with several URLs is warned
  about, not supported.
- An abandoned lookup releases what it holds: when the request's session ends (END_SESSION or
  LMCache's session TTL) or nobody polls it for `abandoned_lookup_s`, its prefix and sparse
  read locks are released through `LMCacheHost.cancel`; a prefetch still in flight is
  released as soon as it lands (`LMCacheHost.settle`). Neither needs a later RPC: the
  plugin's sweep task releases abandoned lookups and settles on its worker pool.
- Says it is there: at start-up one INFO line in the server's log, `fleet-blend plugin
  VERSION loaded into LMCache VERSION: cb_unified_lookup is ours (local matcher + coordinator URLS, budget S s);
  cache events reported by WHO; LMCache's own blend coordinator client (its 'Blend
  coordinator client enabled' line) is closed` (the plugin's loggers print through
  LMCache's, at `LMCACHE_LOG_LEVEL`). LMCache's `GET /status` (HTTP front end) has a
  `fleet_blend` section with the same facts (`name`, `version`, `coordinator_urls`,
  `budget_s`, `event_reporting`) and the figures below.
- `fleet_blend.status` (server-module method) answers JSON: plugin stats, L1 read-locked
  objects, lookups in flight, tracked chunks, which reporter runs.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import importlib.metadata
import json
import logging
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Collection, Hashable, Sequence

import msgspec
import numpy as np

from lmcache.logging import init_logger
from lmcache.v1.distributed.bitmap_ops.fold import fold_unfold_grouped
from lmcache.v1.mp_coordinator.blend_client import BlendCoordinatorClient
from lmcache.v1.mp_observability.event import EventType
from lmcache.v1.mp_observability.event_bus import EventSubscriber
from lmcache.v1.multiprocess.custom_types import CBMatchResult as LMCacheMatch
from lmcache.v1.multiprocess.custom_types import CBUnifiedLookupResult, IPCCacheServerKey
from lmcache.v1.multiprocess import ext_server_module as _ext_server_module
from lmcache.v1.multiprocess.ext_server_module import server_module_handler
from lmcache.v1.multiprocess.modules.blend import BlendModule
from lmcache.v1.multiprocess.modules.blend.lookup import _CBUnifiedJob
from lmcache.v1.multiprocess.modules.lookup import resolve_prefetched_obj_keys
from lmcache.v1.multiprocess.request_handler import HandlerType, request_handler
from lmcache.v1.multiprocess.token_hasher import TokenHasher
from lmcache.v1.rpc_utils import get_ip

from blend_wire import BlendNamespace
from plugin.config import PluginConfig
from plugin.plugin import BlendPlugin
from plugin.registrar import InstanceRegistrar
from plugin.reporter import CacheEventReporter
from plugin.types import CBMatchResult, CBUnifiedLookupResult as PluginResult, LookupKey

log = logging.getLogger(__name__)

from lmcache._version import __version__ as LMCACHE_VERSION  # noqa: E402

SUPPORTED_VERSIONS = ("0.5.6", "0.5.7rc2")
#: 0.5.7's module API (`DiscoverableModule`, packed `token_bytes`); 0.5.6's otherwise.
LMCACHE_057 = hasattr(_ext_server_module, "load_server_module_classes")
if LMCACHE_057:
    from lmcache.v1.multiprocess.engine_module import DiscoverableModule, ModuleBuildContext
    from lmcache.v1.multiprocess.token_codec import pack_token_ids

STATUS_METHOD = "fleet_blend.status"
BUILTIN_LOOKUP_METHOD = "fleet_blend.builtin_cb_unified_lookup"

# Every LMCache name this adapter uses beyond its documented server-module API, as
# (module, dotted attribute). Checked at start-up and by tests/test_lmcache_adapter.py; an
# upgrade that moves one fails loudly, naming it.
LMCACHE_INTERNALS: tuple[tuple[str, str], ...] = (
    ("lmcache.v1.multiprocess.modules.blend", "BlendModule.cb_unified_lookup"),
    ("lmcache.v1.multiprocess.modules.blend", "BlendModule.store"),
    ("lmcache.v1.multiprocess.modules.blend", "BlendModule.UNRETRIEVED_KEYS_EXTRA"),
    ("lmcache.v1.multiprocess.modules.blend", "BlendModule._submit_prefix_leg"),
    ("lmcache.v1.multiprocess.modules.blend", "BlendModule._poll_prefix_leg"),
    ("lmcache.v1.multiprocess.modules.blend", "BlendModule._resolve_cb_read_layouts"),
    ("lmcache.v1.multiprocess.modules.blend", "BlendModule._sparse_prefetch_submit"),
    ("lmcache.v1.multiprocess.modules.blend", "BlendModule._sparse_classify"),
    ("lmcache.v1.multiprocess.modules.blend.lookup", "_CBUnifiedJob"),
    ("lmcache.v1.multiprocess.modules.lookup", "resolve_prefetched_obj_keys"),
    ("lmcache.v1.distributed.bitmap_ops.fold", "fold_unfold_grouped"),
    ("lmcache.v1.distributed.storage_manager", "StorageManager.query_prefetch_status"),
    ("lmcache.v1.distributed.storage_manager", "StorageManager.finish_read_prefetched"),
    ("lmcache.v1.distributed.storage_manager", "StorageManager.report_status"),
    ("lmcache.v1.multiprocess.session", "SessionManager.get_or_create"),
    ("lmcache.v1.multiprocess.session", "SessionManager.destroy_listeners"),
    ("lmcache.v1.multiprocess.session", "Session.get_hashes"),
    ("lmcache.v1.multiprocess.session", "Session.set_tokens"),
    ("lmcache.v1.multiprocess.session", "Session.get_prefetch_owners"),
    ("lmcache.v1.multiprocess.session", "Session.record_prefetch_result"),
    ("lmcache.v1.multiprocess.session", "SessionManager.get"),
    ("lmcache.v1.multiprocess.token_hasher", "TokenHasher.hash_to_bytes"),
    ("lmcache.v1.multiprocess.http_server", "_configs"),
    ("lmcache.v1.mp_observability.event", "EventType.L1_WRITE_FINISHED"),
    ("lmcache.v1.mp_observability.event", "EventType.L1_WRITE_FINISHED_AND_READ_RESERVED"),
    ("lmcache.v1.mp_observability.event", "EventType.L1_KEYS_EVICTED"),
    ("lmcache.v1.mp_observability.event", "EventType.L2_KEYS_STORED"),
    ("lmcache.v1.mp_observability.event", "EventType.L2_KEYS_DELETED"),
    # Several coordinator URLs: what LMCache's front end reads after the modules are built,
    # what the plugin's registrar advertises in its place, and LMCache's lookup client.
    ("lmcache.v1.multiprocess.config", "CoordinatorConfig.url"),
    ("lmcache.v1.multiprocess.config", "CoordinatorConfig.advertise_ip"),
    ("lmcache.v1.multiprocess.config", "CoordinatorConfig.heartbeat_interval"),
    ("lmcache.v1.rpc_utils", "get_ip"),
    ("lmcache.v1.mp_coordinator.blend_client", "BlendCoordinatorClient.maybe_create"),
    ("lmcache.v1.multiprocess.config", "MPServerConfig.separate_object_groups"),
    # The plugin's loggers print through LMCache's handler (`log_under_lmcache`).
    ("lmcache.logging", "init_logger"),
)
# What each version has that the other does not, as used here (`MOVED_IN_057` pairs them).
VERSION_INTERNALS: dict[str, tuple[tuple[str, str], ...]] = {
    "0.5.6": (
        ("lmcache.v1.multiprocess.ext_server_module", "ExtServerModuleBuildContext"),
        ("lmcache.v1.multiprocess.custom_types", "IPCCacheServerKey.token_ids"),
    ),
    "0.5.7rc2": (
        ("lmcache.v1.multiprocess.engine_module", "DiscoverableModule.create"),
        ("lmcache.v1.multiprocess.engine_module", "ModuleBuildContext.require"),
        ("lmcache.v1.multiprocess.engine_module", "ModuleBuildContext.config_for"),
        ("lmcache.v1.multiprocess.ext_server_module", "load_server_module_classes"),
        ("lmcache.v1.multiprocess.custom_types", "IPCCacheServerKey.token_bytes"),
        ("lmcache.v1.multiprocess.custom_types", "IPCCacheServerKey.num_tokens"),
        ("lmcache.v1.multiprocess.token_codec", "pack_token_ids"),
        ("lmcache.v1.multiprocess.engine_context",
         "MPCacheServerContext.add_chunk_size_bind_listener"),
    ),
}
#: What LMCache 0.5.7 moved, from 0.5.6's name to where the adapter finds it now.
MOVED_IN_057 = {
    "ext_server_module.ExtServerModuleBuildContext + build_server_modules factory":
        "engine_module.DiscoverableModule.create(ModuleBuildContext) (FleetBlend)",
    "IPCCacheServerKey.token_ids (tuple of int)":
        "IPCCacheServerKey.token_bytes (packed big-endian uint32, token_codec)",
    "Session.set_tokens(list of int)": "Session.set_tokens(packed bytes)",
    "chunk size fixed at start (--chunk-size)":
        "negotiated at the first engine registration "
        "(MPCacheServerContext.add_chunk_size_bind_listener)",
}
# Attributes LMCache sets on a live BlendModule in __init__ (not visible on the class).
BLEND_INSTANCE_INTERNALS = ("_coordinator", "_segmented_prefix")
# Set in SessionManager.__init__: checked on the live server, not on the class.
_INSTANCE_ONLY = {"SessionManager.destroy_listeners"}
# Imported by LMCache only under `lmcache server`; importing it elsewhere would build its
# FastAPI app, so the start-up check looks at it only when it is already loaded.
_FRONT_END = "lmcache.v1.multiprocess.http_server"

_TOKENS_STASH_LIMIT = 65536  # stored chunks awaiting their L1 write event (reporting only)
_ADAPTER_KEYS = {"builtin_lookup"}


def missing_lmcache_internals(blend: object | None = None, *, loaded_front_end_only: bool = False
                              ) -> list[str]:
    """Names of `LMCACHE_INTERNALS` (and, given a live BlendModule, its instance attributes)
    that this LMCache installation lacks. Empty when the adapter can run."""
    missing = []
    for module_name, dotted in LMCACHE_INTERNALS + VERSION_INTERNALS.get(LMCACHE_VERSION, ()):
        if dotted in _INSTANCE_ONLY:
            continue
        if module_name == _FRONT_END and loaded_front_end_only and module_name not in sys.modules:
            continue
        if not _has(module_name, dotted):
            missing.append(f"{module_name}.{dotted}")
    if blend is not None:
        missing += [f"BlendModule instance attribute {name}" for name in BLEND_INSTANCE_INTERNALS
                    if not hasattr(blend, name)]
    return missing


def _has(module_name: str, dotted: str) -> bool:
    """Whether `module_name` has `dotted` (an attribute, or a dataclass / msgspec field)."""
    try:
        target: Any = importlib.import_module(module_name)
        *path, last = dotted.split(".")
        for part in path:
            target = getattr(target, part)
    except (ImportError, AttributeError):
        return False
    return (hasattr(target, last) or last in getattr(target, "__struct_fields__", ())
            or last in getattr(target, "__dataclass_fields__", {}))


# --- LMCache's keys across versions --------------------------------------------------------

def key_tokens(key: IPCCacheServerKey) -> np.ndarray:
    """The key's token ids as uint32 (0.5.7 packs them big-endian: one vectorised swap)."""
    if LMCACHE_057:
        return np.frombuffer(key.token_bytes, dtype=">u4").astype(np.uint32)
    return np.asarray(key.token_ids, dtype=np.uint32)


def key_num_tokens(key: IPCCacheServerKey) -> int:
    return key.num_tokens if LMCACHE_057 else len(key.token_ids)


def make_key(**fields) -> IPCCacheServerKey:
    """An `IPCCacheServerKey` from `token_ids` (a sequence of int), on either version."""
    tokens = fields.pop("token_ids")
    if LMCACHE_057:
        return IPCCacheServerKey(token_bytes=pack_token_ids(tokens), **fields)
    return IPCCacheServerKey(token_ids=tuple(int(t) for t in tokens), **fields)


def _session_tokens(key: IPCCacheServerKey):
    """What `Session.set_tokens` takes on this version."""
    return key.token_bytes if LMCACHE_057 else list(key.token_ids)


# --- payloads of the server-module methods (the harness in plugin.lmcache_process uses them) --

def encode_lookup_call(key: IPCCacheServerKey, tp_size: int) -> bytes:
    return msgspec.msgpack.encode((key, tp_size))


def decode_lookup_call(payload: bytes) -> tuple[IPCCacheServerKey, int]:
    return msgspec.msgpack.decode(payload, type=tuple[IPCCacheServerKey, int])


def encode_lookup_result(result: CBUnifiedLookupResult | None) -> bytes:
    return msgspec.msgpack.encode(result)


def decode_lookup_result(payload: bytes) -> CBUnifiedLookupResult | None:
    return msgspec.msgpack.decode(payload, type=CBUnifiedLookupResult | None)


# --- the host: LMCache's prefix leg and sparse prefetch -------------------------------------

@dataclass(eq=False)
class _Op:
    """What the server holds for one lookup between its submit and its hand-out."""

    key: IPCCacheServerKey
    tp_size: int
    prefix_job: Any = None               # LMCache's _CBUnifiedJob, prefix fields only
    segmented: bool = False
    prefix_done: bool = False
    leading: int = 0
    prefix_owners: dict | None = None    # L1 owners of the prefix leg's read locks
    retained: list[int] | None = None
    sparse: tuple | None = None          # (handle, matches, per_hash_keys, hash_to_col)
    found: set | None = None             # set when the sparse leg has been classified


class LMCacheHost:
    """`ServingHost` over a live `BlendModule`: its prefix leg and sparse prefetch.

    The adapter hands each request's LMCache key in with `begin(key, tp)` before the plugin
    calls the protocol methods, and collects the LMCache result with `finish`.
    """

    def __init__(self, blend: BlendModule) -> None:
        self._blend = blend
        self._ctx = blend.context
        self._storage = self._ctx.storage_manager
        self.chunk_size: int = self._ctx.chunk_size
        self._lock = threading.Lock()
        self._keys: dict[str, tuple[IPCCacheServerKey, int]] = {}
        self._ops: dict[str, _Op] = {}
        # Cancelled lookups whose prefetch was still in flight: released when it lands.
        self._zombies: list[_Op] = []
        self._stats = collections.Counter()

    # --- what the adapter does around the plugin ---------------------------------------------

    def begin(self, key: IPCCacheServerKey, tp_size: int) -> None:
        with self._lock:
            self._keys[key.request_id] = (key, tp_size)

    def finish(self, request_id: str, result: PluginResult) -> CBUnifiedLookupResult:
        """The LMCache result for a completed plugin lookup; forgets the request."""
        with self._lock:
            self._keys.pop(request_id, None)
            op = self._ops.pop(request_id, None)
            if op is not None and not (
                    op.prefix_done and (op.sparse is None or op.found is not None)
                    and result.prefix_coverage_tokens == op.leading * self.chunk_size):
                # The plugin gave up part-way (an internal error answers "no reuse"): the
                # engine will not retrieve, so release what is held.
                self._zombies.append(op)
        tail: list[LMCacheMatch] = []
        if op is not None and op.segmented and op.retained:
            C = self.chunk_size
            hashes = self._hashes(op.key, key_num_tokens(op.key) // C * C)
            tail = [LMCacheMatch(i * C, (i + 1) * C, i * C, (i + 1) * C, hashes[i])
                    for i in op.retained if op.leading <= i < len(hashes)]
        return CBUnifiedLookupResult(
            prefix_coverage_tokens=result.prefix_coverage_tokens,
            non_prefix_segments=[LMCacheMatch(s.old_st, s.old_ed, s.cur_st, s.cur_ed, s.hash)
                                 for s in result.non_prefix_segments],
            segmented_prefix_segments=tail)

    def _hashes(self, key: IPCCacheServerKey, end: int) -> list[bytes]:
        session = self._ctx.session_manager.get_or_create(key.request_id)
        return [TokenHasher.hash_to_bytes(h) for h in session.get_hashes(0, end)]

    # --- ServingHost ----------------------------------------------------------------------------

    def submit_prefix_lookup(self, key: LookupKey, tp_size: int) -> None:
        with self._lock:
            ipc_key, tp = self._keys[key.request_id]
        blend = self._blend
        resolved = blend._resolve_cb_read_layouts(ipc_key.model_name, ipc_key.world_size)
        # As LMCache: a segmented prefix is off for recurrent layouts (a gap would hole the
        # recurrence scan).
        segmented = bool(blend._segmented_prefix) and not (
            resolved is not None and resolved[0].recurrent_gids)
        handle, gids, windows, num_chunks, no_context = blend._submit_prefix_leg(ipc_key, tp)
        job = _CBUnifiedJob(matches=[], num_tokens=key_num_tokens(ipc_key), prefix_handle=handle,
                            prefix_lock_gids=gids, prefix_windows=windows,
                            prefix_num_chunks=num_chunks, no_gpu_context=no_context)
        with self._lock:
            self._ops[key.request_id] = _Op(ipc_key, tp, prefix_job=job, segmented=segmented)

    def poll_prefix_lookup(self, request_id: str) -> Sequence[Hashable] | None:
        op = self._op(request_id)
        polled = self._blend._poll_prefix_leg(op.prefix_job, request_id, op.segmented)
        if polled is None:
            return None
        op.leading, op.retained = polled
        session = self._ctx.session_manager.get(request_id)
        op.prefix_owners = (session.get_prefetch_owners() or None) if session else None
        op.prefix_done = True
        return self._hashes(op.key, op.leading * self.chunk_size)

    def submit_prefetch(self, request_id: str, segments: Sequence[CBMatchResult]) -> None:
        op = self._op(request_id)
        C = self.chunk_size
        retained = set(op.retained or ()) if op.segmented else set()
        # As LMCache: a same-position match the segmented prefix already retained rides the
        # segmented tail, so it is not fetched (nor scattered) twice.
        matches = [LMCacheMatch(s.old_st, s.old_ed, s.cur_st, s.cur_ed, s.hash) for s in segments
                   if not (s.old_st == s.cur_st and s.cur_st // C in retained)]
        key = op.key
        resolved = self._blend._resolve_cb_read_layouts(key.model_name, key.world_size)
        if not matches or resolved is None:
            if resolved is None:
                log.error("no CB KV-cache layout registered for model %s world size %d: "
                          "nothing can be prefetched", key.model_name, key.world_size)
            op.found = set()
            return
        handle, per_hash, hash_to_col = self._blend._sparse_prefetch_submit(key, resolved, matches)
        op.sparse = (handle, matches, per_hash, hash_to_col)

    def poll_prefetch(self, request_id: str) -> Collection[Hashable] | None:
        op = self._op(request_id)
        if op.found is None:
            handle, matches, per_hash, hash_to_col = op.sparse
            status = self._storage.query_prefetch_status(handle)
            if status is None:
                return None
            # LMCache's classification: found chunks stay read-locked, stashed in the session
            # for the retrieve; partially loaded ones are released now.
            fetched = self._blend._sparse_classify(
                op.key, matches, status.hit_cells, per_hash, hash_to_col, status.found_cells,
                l1_owners=status.l1_owners)
            op.found = {m.hash for m in fetched}
        return op.found

    def cancel(self, request_id: str) -> None:
        """The lookup was abandoned: release its prefix and sparse read locks (now, or as
        soon as a prefetch still in flight lands)."""
        with self._lock:
            self._keys.pop(request_id, None)
            op = self._ops.pop(request_id, None)
            if op is not None:
                self._zombies.append(op)
                self._stats["cancelled"] += 1
        self.settle()

    def settle(self) -> int:
        """Release what cancelled lookups hold once their prefetches have landed; returns
        how many still wait for theirs (the plugin's sweep task calls again until none)."""
        with self._lock:
            zombies, self._zombies = self._zombies, []
        waiting = [op for op in zombies if not self._release(op)]
        with self._lock:
            self._zombies.extend(waiting)
            return len(self._zombies)

    def _release(self, op: _Op) -> bool:
        # True when everything the op held is released. Consumes each prefetch result once.
        job = op.prefix_job
        if job is not None:
            # The engine never got this lookup's answer, so it will neither retrieve the
            # prefix nor free its locks: release what the prefix leg locked.
            if op.prefix_done:
                leading, owners = op.leading, op.prefix_owners
                session = self._ctx.session_manager.get(op.key.request_id)
                if session is not None:
                    # Forget the recorded lock model, so a later free_lookup_locks for this
                    # request cannot release the same locks twice.
                    session.record_prefetch_result(-1, (), None)
            elif job.prefix_handle is None:
                leading, owners = 0, None
            else:
                status = self._storage.query_prefetch_status(job.prefix_handle)
                if status is None:
                    return False
                leading, _ = fold_unfold_grouped(status.hit_cells, list(job.prefix_windows))
                owners = status.l1_owners or None
            if leading:
                locked = dataclasses.replace(op.key, worker_id=None, start=0,
                                             end=leading * self.chunk_size)
                keys = resolve_prefetched_obj_keys(self._ctx, locked, leading,
                                                   job.prefix_lock_gids)
                self._storage.finish_read_prefetched(
                    keys, read_locks=op.key.require_num_kv_readers(), l1_owners=owners)
                self._stats["released_prefix_chunks"] += leading
            op.prefix_done = True
            op.prefix_job = None
        if op.sparse is not None and op.found is None:
            handle, matches, per_hash, hash_to_col = op.sparse
            status = self._storage.query_prefetch_status(handle)
            if status is None:
                return False
            keys = [keys_of_hash[row] for h, col in hash_to_col.items()
                    for keys_of_hash in (per_hash[h],)
                    for row, bitmap in enumerate(status.hit_cells) if bitmap.test(col)]
            if keys:
                self._storage.finish_read_prefetched(
                    keys, read_locks=op.key.require_num_kv_readers(),
                    l1_owners=status.l1_owners or None)
                self._stats["released_sparse_keys"] += len(keys)
            op.sparse = None
        elif op.found:
            # Classified: the found chunks' locks are stashed in the session for a retrieve
            # that will never come. Release them as LMCache does when a session ends.
            session = self._ctx.session_manager.get(op.key.request_id)
            stash = session.extras.pop(BlendModule.UNRETRIEVED_KEYS_EXTRA, None) if session else None
            if stash:
                keys = [k for ks in stash["per_hash"].values() for k in ks]
                self._storage.finish_read_prefetched(keys, read_locks=stash["read_locks"],
                                                     l1_owners=stash.get("l1_owners"))
                self._stats["released_sparse_keys"] += len(keys)
            op.found = set()
        return True

    def _op(self, request_id: str) -> _Op:
        with self._lock:
            op = self._ops.get(request_id)
        if op is None:
            raise KeyError(f"no lookup in progress for request {request_id!r}")
        return op

    def stats(self) -> dict:
        with self._lock:
            return {**self._stats, "in_flight": len(self._ops), "releasing": len(self._zombies)}


# --- tier tracking: which tiers hold each chunk the local matcher indexed -------------------

@dataclass(eq=False)
class _Chunk:
    # Each holder: (tier, backend, namespace, kv_rank, object_group_id) of one object key.
    holders: set = field(default_factory=set)


class TierWatcher(EventSubscriber):
    """Event-bus subscriber: L1/L2 placements of the chunks this server indexed.

    A chunk leaves the local matcher (`on_gone`) only when its last placement in any tier
    is gone. With a reporter, each placement's appearance / disappearance is reported per
    `(tier, backend)` (STORE with the chunk's tokens when the store path stashed them).
    Runs on the bus's drain thread; never calls out while holding its lock.
    """

    def __init__(self, on_gone, reporter: CacheEventReporter | None) -> None:
        self._on_gone = on_gone
        self._reporter = reporter
        self._lock = threading.Lock()
        self._chunks: dict[bytes, _Chunk] = {}
        # chunk hash -> (tokens, offset) from the store path, until its first L1 STORE report.
        self._tokens: collections.OrderedDict[bytes, tuple[np.ndarray, int]] = \
            collections.OrderedDict()

    def get_subscriptions(self) -> dict:
        return {
            EventType.L1_WRITE_FINISHED: self._on_l1_write,
            EventType.L1_WRITE_FINISHED_AND_READ_RESERVED: self._on_l1_write,
            EventType.L1_KEYS_EVICTED: self._on_l1_evicted,
            EventType.L2_KEYS_STORED: self._on_l2_stored,
            EventType.L2_KEYS_DELETED: self._on_l2_deleted,
        }

    def track(self, chunk_hashes: Sequence[bytes], tokens: np.ndarray, start: int, C: int) -> None:
        """Called by the store path before LMCache writes, so no placement event is missed."""
        with self._lock:
            for i, chunk_hash in enumerate(chunk_hashes):
                self._chunks.setdefault(chunk_hash, _Chunk())
                if self._reporter is not None:
                    at = start + i * C
                    self._tokens[chunk_hash] = (tokens[at:at + C], at)
                    self._tokens.move_to_end(chunk_hash)
            while len(self._tokens) > _TOKENS_STASH_LIMIT:
                self._tokens.popitem(last=False)

    @property
    def tracked(self) -> int:
        with self._lock:
            return len(self._chunks)

    def forget_all(self) -> None:
        with self._lock:
            self._chunks.clear()
            self._tokens.clear()

    def _on_l1_write(self, event) -> None:
        self._apply(True, [(k, "l1", m.backend.value) for k, m in
                           zip(event.metadata["keys"], event.metadata["meta"])])

    def _on_l1_evicted(self, event) -> None:
        self._apply(False, [(k, "l1", m.backend.value) for k, m in
                            zip(event.metadata["keys"], event.metadata["meta"])])

    def _on_l2_stored(self, event) -> None:
        backend = event.metadata["backend"]
        self._apply(True, [(k, "l2", backend) for k in event.metadata["keys"]])

    def _on_l2_deleted(self, event) -> None:
        backend = event.metadata["backend"]
        self._apply(False, [(k, "l2", backend) for k in event.metadata["keys"]])

    def _apply(self, placed: bool, keyed: list) -> None:
        stores: dict[tuple, list] = collections.defaultdict(list)
        deletes: dict[tuple, list] = collections.defaultdict(list)
        gone: list[bytes] = []
        with self._lock:
            for key, tier, backend in keyed:
                chunk = self._chunks.get(key.chunk_hash)
                if chunk is None:
                    continue  # not indexed here (e.g. a peer's chunk prefetched into L1)
                namespace = BlendNamespace(key.model_name, key.cache_salt, (key.kv_rank >> 24) & 0xFF)
                holder = (tier, backend, namespace, key.kv_rank, key.object_group_id)
                place = (tier, backend, namespace)
                had_place = any(h[:3] == place for h in chunk.holders)
                if placed:
                    chunk.holders.add(holder)
                    if not had_place:
                        tokens = self._tokens.pop(key.chunk_hash, None) if tier == "l1" else None
                        stores[place].append((key.chunk_hash, tokens))
                elif holder in chunk.holders:
                    chunk.holders.discard(holder)
                    if not any(h[:3] == place for h in chunk.holders):
                        deletes[place].append(key.chunk_hash)
                    if not chunk.holders:
                        del self._chunks[key.chunk_hash]
                        gone.append(key.chunk_hash)
        if gone:
            self._on_gone(gone)
        if self._reporter is None:
            return
        for (tier, backend, namespace), items in stores.items():
            self._reporter.report_store(
                namespace, [h for h, _ in items],
                [None if t is None else t[0] for _, t in items],
                [-1 if t is None else t[1] for _, t in items], tier=tier, backend=backend)
        for (tier, backend, namespace), hashes in deletes.items():
            self._reporter.report_delete(namespace, hashes, tier=tier, backend=backend)


# --- the engine module -------------------------------------------------------------------------

class FleetBlendModule:
    """Engine module serving `cb_unified_lookup` and `store` in place of LMCache's blend."""

    def __init__(self, blend: BlendModule, config: PluginConfig, *, lmcache_reports: bool,
                 builtin_lookup: bool, registrar: InstanceRegistrar | None = None) -> None:
        self._ctx = blend.context
        self._blend = blend
        self._builtin = builtin_lookup
        self.registrar = registrar  # registration by the plugin (several URLs), or None
        self.host = LMCacheHost(blend)
        self.plugin = BlendPlugin(config, self.host, report_events=False)
        self.reporter: CacheEventReporter | None = None
        if config.fleet_enabled and not lmcache_reports:
            # Its own flush thread, not the plugin's pool: the plugin closes its pool before
            # this module closes the reporter.
            self.reporter = CacheEventReporter.from_config(config)
        self.reporting = ("lmcache" if lmcache_reports and config.fleet_enabled
                          else "plugin" if self.reporter is not None else "off")
        self._config = config
        # Through self.plugin at call time: a chunk-size binding replaces the plugin.
        self.tiers = TierWatcher(lambda hashes: self.plugin.on_evict(hashes), self.reporter)
        bus = self._ctx.event_bus
        if not bus.enabled:
            log.warning("LMCache's event bus is disabled (--disable-observability): evicted "
                        "chunks stay in the local matcher (the prefetch then skips them) and "
                        "no placement events are reported")
        bus.register_subscriber(self.tiers)
        self._ctx.session_manager.destroy_listeners.append(self._session_ended)
        lmcache_client = blend._coordinator is not None
        if lmcache_client and not builtin_lookup:
            blend._coordinator.close()  # its lookup is not served any more
            blend._coordinator = None
        self.loaded = {
            "name": "fleet-blend", "version": plugin_version(),
            "coordinator_urls": list(config.coordinator_urls),
            "budget_s": config.match_budget_s,
            "event_reporting": self.reporting,
        }
        log.info(
            "fleet-blend plugin %s loaded into LMCache %s: cb_unified_lookup is ours "
            "(local matcher%s, budget %g s); cache events reported by %s%s",
            self.loaded["version"], LMCACHE_VERSION,
            f" + coordinator {','.join(config.coordinator_urls)}" if config.coordinator_urls
            else " only: no coordinator URL", config.match_budget_s,
            {"lmcache": "LMCache's subscriber", "plugin": "the plugin",
             "off": "nobody (event reporting off)"}[self.reporting],
            ("; LMCache's own blend coordinator client (its 'Blend coordinator client "
             "enabled' line) is closed" if lmcache_client and not builtin_lookup else
             "; LMCache's own lookup stays reachable as " + BUILTIN_LOOKUP_METHOD
             if builtin_lookup else ""))

    @property
    def context(self):
        return self._ctx

    def rebind_chunk_size(self, chunk_size: int) -> None:
        """LMCache 0.5.7 bound the server's chunk size (module doc): if it moved, a new,
        empty plugin at that size replaces the one built at the configured size."""
        if chunk_size == self.host.chunk_size:
            return
        previous = self.plugin
        self._config = dataclasses.replace(self._config, chunk_size=chunk_size)
        self.host.chunk_size = chunk_size
        self.plugin = BlendPlugin(self._config, self.host, report_events=False)
        self.tiers.forget_all()
        previous.close()
        log.info("fleet blend: LMCache bound the chunk size to %d; the local matcher starts "
                 "empty at that size", chunk_size)

    # --- RPCs ---------------------------------------------------------------------------------

    @request_handler(HandlerType.BLOCKING)
    def cb_unified_lookup(self, key: IPCCacheServerKey, tp_size: int
                          ) -> CBUnifiedLookupResult | None:
        """The unified lookup (DESIGN.md); None while pending, as LMCache's."""
        rid = key.request_id
        try:
            self.host.settle()
            self.host.begin(key, tp_size)
            result = self.plugin.cb_unified_lookup(
                LookupKey(rid, key_tokens(key), key.model_name, key.world_size,
                          key.cache_salt), tp_size)
            if result is None:
                return None
            return self.host.finish(rid, result)
        except Exception:
            log.exception("fleet blend lookup failed for %s; answering no reuse", rid)
            self.plugin.cancel(rid)
            return CBUnifiedLookupResult(0, [], [])

    @request_handler(HandlerType.BLOCKING, requires_client_affinity=True)
    def store(self, key: IPCCacheServerKey, instance_id: int, gpu_block_ids: list[list[int]],
              event_ipc_handle: bytes) -> tuple[bytes, bool]:
        """LMCache's blend store, then the stored chunks go to the local matcher."""
        registering = key.worker_id in (0, None)
        hashes: list[bytes] = []
        tokens = None
        if registering:
            try:
                session = self._ctx.session_manager.get_or_create(key.request_id)
                session.set_tokens(_session_tokens(key))
                hashes = [TokenHasher.hash_to_bytes(h)
                          for h in session.get_hashes(key.start, key.end)]
                tokens = key_tokens(key)
                self.tiers.track(hashes, tokens, key.start, self.host.chunk_size)
            except Exception:
                log.exception("fleet blend: could not prepare %s for the local matcher",
                              key.request_id)
                hashes = []
        handle, ok = self._blend.store(key, instance_id, gpu_block_ids, event_ipc_handle)
        if ok and hashes:
            self.plugin.on_store(
                LookupKey(key.request_id, tokens, key.model_name, key.world_size, key.cache_salt),
                hashes, key.start)
        return handle, ok

    @server_module_handler(STATUS_METHOD)
    def status(self, payload: bytes) -> bytes:
        """JSON: what the plugin holds and what LMCache's L1 has read-locked."""
        self.host.settle()
        return json.dumps(self.report_status()["fleet_blend"], default=str).encode()

    @server_module_handler(BUILTIN_LOOKUP_METHOD)
    def builtin_lookup(self, payload: bytes) -> bytes:
        """LMCache's own cb_unified_lookup, unchanged (config `builtin_lookup: true`)."""
        if not self._builtin:
            raise RuntimeError("LMCache's built-in lookup is not exposed: start the server "
                               "module with config {\"builtin_lookup\": true}")
        key, tp_size = decode_lookup_call(payload)
        return encode_lookup_result(self._blend.cb_unified_lookup(key, tp_size))

    # --- lifecycle ----------------------------------------------------------------------------

    def _session_ended(self, session) -> None:
        # END_SESSION or LMCache's session TTL: no poll will come for this request again.
        self.plugin.cancel(session.request_id)

    def report_status(self) -> dict:
        l1 = self._ctx.storage_manager.report_status()
        return {"fleet_blend": {
            **self.loaded,
            "lmcache_version": LMCACHE_VERSION,
            "chunk_size": self.host.chunk_size,
            "reporting": self.reporting,
            "plugin": dataclasses.asdict(self.plugin.stats()),
            "host": self.host.stats(),
            "tracked_chunks": self.tiers.tracked,
            "l1_read_locked": sum(m["read_locked_count"] for m in l1["l1_managers"].values()),
            "l1_objects": sum(m["total_object_count"] for m in l1["l1_managers"].values()),
            "builtin_lookup": self._builtin,
            "lmcache_coordinator_client": "open" if self._blend._coordinator else "closed",
            "registration": (dataclasses.asdict(self.registrar.stats())
                             if self.registrar is not None else None),
        }}

    def close(self) -> None:
        listeners = self._ctx.session_manager.destroy_listeners
        if self._session_ended in listeners:
            listeners.remove(self._session_ended)
        self.plugin.close()
        if self.reporter is not None:
            self.reporter.close()  # its last events go before the departure
        if self.registrar is not None:
            self.registrar.close()


# --- the factory LMCache calls ------------------------------------------------------------------

@dataclass
class FleetBuild:
    """What building the module needs, as either LMCache version hands it over."""

    server_context: Any       # LMCache's MPCacheServerContext
    mp_config: Any            # MPServerConfig
    coordinator_config: Any   # CoordinatorConfig
    config: dict              # the --server-module JSON `config`
    blends: list              # the server's BlendModule(s): exactly one is expected


def plugin_config(build: FleetBuild) -> PluginConfig:
    """The server's coordinator settings (flags and environment, as LMCache resolved them),
    then `PluginConfig`'s environment names, then the module config's field overrides."""
    coordinator = build.coordinator_config
    overrides = {k: v for k, v in build.config.items() if k not in _ADAPTER_KEYS}
    values = dict(coordinator_url=coordinator.url or None,
                  event_reporting=bool(coordinator.event_reporting),
                  event_flush_interval=coordinator.event_flush_interval,
                  blend_timeout=coordinator.blend_timeout,
                  match_concurrency=coordinator.blend_match_concurrency,
                  chunk_size=build.server_context.chunk_size,
                  instance_id=build.mp_config.instance_id)
    values.update(overrides)
    if values["chunk_size"] != build.server_context.chunk_size:
        raise ValueError(f"chunk_size={values['chunk_size']} differs from the server's "
                         f"--chunk-size {build.server_context.chunk_size}; leave it unset")
    return PluginConfig.from_env(**values)


def lmcache_reports_events(build: FleetBuild) -> bool:
    """True when LMCache's own cache-event subscriber reports to the coordinator: only under
    `lmcache server` (its HTTP front end), with a URL and event reporting on."""
    http_server = sys.modules.get("lmcache.v1.multiprocess.http_server")
    front_end = http_server is not None and http_server._configs.get("http") is not None
    coordinator = build.coordinator_config
    return front_end and bool(coordinator.url) and bool(coordinator.event_reporting)


def plugin_version() -> str:
    """fleet-blend's installed version ("unknown" when run from a checkout not installed)."""
    try:
        return importlib.metadata.version("fleet-blend")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def log_under_lmcache() -> None:
    """The plugin's loggers (`plugin.*`) print as LMCache's do, at `LMCACHE_LOG_LEVEL`:
    left alone they reach no handler in an LMCache server, and their INFO lines (the one
    saying the plugin loaded) are lost. Only inside a server: in other processes the
    `plugin` logger keeps propagating to the root logger."""
    init_logger("plugin")


def build_fleet_blend(build: FleetBuild) -> FleetBlendModule:
    """Our blend lookup in place of LMCache's, after every check (module doc)."""
    log_under_lmcache()
    if build.mp_config.engine_type != "blend":
        raise ValueError(f"plugin.lmcache_adapter replaces the blend module's lookup: start the "
                         f"server with --engine-type blend (got {build.mp_config.engine_type!r})")
    if getattr(build.mp_config, "separate_object_groups", False):
        raise ValueError("plugin.lmcache_adapter does not run with --separate-object-groups: "
                         "object groups split this server's layout into several keys per "
                         "chunk, and the fleet's namespace leaves them out, so peers with "
                         "other groups could not use its chunks; start the server without it")
    if LMCACHE_VERSION not in SUPPORTED_VERSIONS:
        raise RuntimeError(f"plugin.lmcache_adapter is written for LMCache "
                           f"{' or '.join(SUPPORTED_VERSIONS)}; this is LMCache "
                           f"{LMCACHE_VERSION}")
    blends = build.blends
    if len(blends) != 1:
        raise RuntimeError(f"expected one BlendModule among the server's modules, found "
                           f"{len(blends)}")
    missing = missing_lmcache_internals(blends[0], loaded_front_end_only=True)
    if missing:
        raise RuntimeError(f"plugin.lmcache_adapter is written for LMCache "
                           f"{' or '.join(SUPPORTED_VERSIONS)}; this LMCache "
                           f"{LMCACHE_VERSION} lacks: {', '.join(missing)}")
    unknown_adapter = set(build.config) - _ADAPTER_KEYS - {
        f.name for f in dataclasses.fields(PluginConfig)}
    if unknown_adapter:
        raise ValueError(f"unknown server-module config key(s): {', '.join(sorted(unknown_adapter))}"
                         f"; use PluginConfig field names or {sorted(_ADAPTER_KEYS)}")
    builtin = build.config.get("builtin_lookup", False)
    if not isinstance(builtin, bool):
        raise ValueError(f"builtin_lookup={builtin!r} must be true or false")
    config = plugin_config(build)
    registrar = None
    if len(config.coordinator_urls) > 1:
        registrar = take_over_replicas(build, config, blends[0], builtin)
    module = FleetBlendModule(blends[0], config, lmcache_reports=lmcache_reports_events(build),
                              builtin_lookup=builtin, registrar=registrar)
    if LMCACHE_057:
        build.server_context.add_chunk_size_bind_listener(module.rebind_chunk_size)
    return module


def build_server_modules(build) -> list[FleetBlendModule]:
    """LMCache 0.5.6's server-module factory (its `ExtServerModuleBuildContext`)."""
    return [build_fleet_blend(FleetBuild(
        server_context=build.server_context, mp_config=build.mp_config,
        coordinator_config=build.coordinator_config, config=dict(build.config),
        blends=[m for m in build.modules if isinstance(m, BlendModule)]))]


if LMCACHE_057:
    class FleetBlend(DiscoverableModule):
        """LMCache 0.5.7's module: built after `blend`, whose lookup and store it serves."""

        module_name = "fleet_blend"
        module_dependencies = (BlendModule,)

        @classmethod
        def create(cls, build_ctx: ModuleBuildContext) -> FleetBlendModule:
            engine_type = build_ctx.mp_config.engine_type
            blends = [build_ctx.require(BlendModule)] if engine_type == "blend" else []
            return build_fleet_blend(FleetBuild(
                server_context=build_ctx.engine_context, mp_config=build_ctx.mp_config,
                coordinator_config=build_ctx.coordinator_config,
                config=dict(build_ctx.config_for(cls)), blends=blends))


def take_over_replicas(build: FleetBuild, config: PluginConfig,
                       blend: BlendModule, builtin_lookup: bool) -> InstanceRegistrar | None:
    """Several coordinator URLs (module doc): LMCache's registrar and event sink are kept
    from starting, and the plugin's registrar (under `lmcache server`) is returned."""
    coordinator = build.coordinator_config
    urls = config.coordinator_urls
    if build.mp_config.p2p_config.enabled:
        log.warning("P2P peer discovery in LMCache %s takes one coordinator URL and cannot "
                    "use the list %s: P2P lookups will not find peers", LMCACHE_VERSION,
                    config.coordinator_url)
    if builtin_lookup and blend._coordinator is not None:
        blend._coordinator.close()
        blend._coordinator = BlendCoordinatorClient.maybe_create(
            urls[0], timeout=coordinator.blend_timeout,
            match_concurrency=coordinator.blend_match_concurrency)
    http_server = sys.modules.get(_FRONT_END)
    http = http_server._configs.get("http") if http_server is not None else None
    coordinator.url = ""  # read by LMCache's front end after this factory returns
    log.info("%d coordinator replicas: the plugin registers and reports cache events, "
             "failing over between them (LMCache's own registrar and event sink take one "
             "URL)", len(urls))
    if http is None:  # the ZMQ-only entry point registers nowhere, as LMCache's
        return None
    return InstanceRegistrar(
        urls, instance_id=build.mp_config.instance_id,
        ip=coordinator.advertise_ip or get_ip(), http_port=http.http_port,
        heartbeat_interval=coordinator.heartbeat_interval,
        timeout=min(10.0, max(1.0, coordinator.heartbeat_interval)),
        p2p_advertised_url=build.mp_config.p2p_config.advertise_url,
        mq_port=build.mp_config.port if build.mp_config.p2p_config.enabled else 0,
        token=config.coordinator_token, ca_file=config.coordinator_ca_file)
