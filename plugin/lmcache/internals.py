"""The one module of the adapter that touches LMCache's private parts, and the pin on them.

Everything here beyond LMCache's documented server-module API is listed in
`LMCACHE_INTERNALS` / `VERSION_INTERNALS` (checked at start-up by the factory, and by
tests/serving/test_lmcache_adapter.py); `MOVED_IN_057` says what 0.5.7rc2 moved and where it is
found now. Every underscore name of LMCache the adapter reads is read here and nowhere
else (tests/serving/test_plugin_http.py checks it): `BlendInternals` over a live `BlendModule`
(its prefix leg, sparse prefetch and coordinator client), `prefix_leg_hits` /
`prefetched_keys` (releasing a prefix leg's read locks) and `front_end_http_config`.
Design: docs/DESIGN.md, "Inside a real LMCache MP server".
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from lmcache._version import __version__ as LMCACHE_VERSION
from lmcache.v1.distributed.bitmap_ops.fold import fold_unfold_grouped
from lmcache.v1.mp_coordinator.blend_client import BlendCoordinatorClient
from lmcache.v1.multiprocess import ext_server_module as _ext_server_module
from lmcache.v1.multiprocess.modules.blend import BlendModule
from lmcache.v1.multiprocess.modules.blend.lookup import _CBUnifiedJob
from lmcache.v1.multiprocess.modules.lookup import resolve_prefetched_obj_keys

SUPPORTED_VERSIONS = ("0.5.6", "0.5.7rc2")
#: 0.5.7's module API (`DiscoverableModule`, packed `token_bytes`); 0.5.6's otherwise.
LMCACHE_057 = hasattr(_ext_server_module, "load_server_module_classes")

# Every LMCache name this adapter uses beyond its documented server-module API, as
# (module, dotted attribute). Checked at start-up and by tests/serving/test_lmcache_adapter.py; an
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
FRONT_END = "lmcache.v1.multiprocess.http_server"


def missing_lmcache_internals(blend: object | None = None, *, loaded_front_end_only: bool = False
                              ) -> list[str]:
    """Names of `LMCACHE_INTERNALS` (and, given a live BlendModule, its instance attributes)
    that this LMCache installation lacks. Empty when the adapter can run."""
    missing = []
    for module_name, dotted in LMCACHE_INTERNALS + VERSION_INTERNALS.get(LMCACHE_VERSION, ()):
        if dotted in _INSTANCE_ONLY:
            continue
        if module_name == FRONT_END and loaded_front_end_only and module_name not in sys.modules:
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



class BlendInternals:
    """The private parts of a live `BlendModule` the host and the module use."""

    def __init__(self, blend: BlendModule) -> None:
        self._blend = blend

    # --- the prefix leg and the sparse prefetch (LMCacheHost) -----------------------------

    def read_layouts(self, model_name: str, world_size: int):
        """The CB KV-cache layouts registered for the model (None when there are none)."""
        return self._blend._resolve_cb_read_layouts(model_name, world_size)

    def segmented_prefix(self, resolved) -> bool:
        """Whether the prefix leg is segmented (`--enable-segmented-prefix`): as LMCache, off
        for recurrent layouts (a gap would hole the recurrence scan)."""
        return bool(self._blend._segmented_prefix) and not (
            resolved is not None and resolved[0].recurrent_gids)

    def submit_prefix_leg(self, key, tp_size: int, num_tokens: int):
        """LMCache's prefix leg, submitted; the job (prefix fields only) it is polled with."""
        handle, gids, windows, num_chunks, no_context = self._blend._submit_prefix_leg(
            key, tp_size)
        return _CBUnifiedJob(matches=[], num_tokens=num_tokens, prefix_handle=handle,
                             prefix_lock_gids=gids, prefix_windows=windows,
                             prefix_num_chunks=num_chunks, no_gpu_context=no_context)

    def poll_prefix_leg(self, job, request_id: str, segmented: bool):
        """(leading chunks, retained chunk indices) once the prefix leg landed, else None."""
        return self._blend._poll_prefix_leg(job, request_id, segmented)

    def submit_sparse_prefetch(self, key, resolved, matches):
        """(handle, per-hash object keys, hash -> bitmap column) of the sparse prefetch."""
        return self._blend._sparse_prefetch_submit(key, resolved, matches)

    def classify_sparse(self, key, matches, status, per_hash, hash_to_col):
        """LMCache's classification of a landed sparse prefetch: the found matches stay
        read-locked, stashed in the session for the retrieve; partial ones are released."""
        return self._blend._sparse_classify(
            key, matches, status.hit_cells, per_hash, hash_to_col, status.found_cells,
            l1_owners=status.l1_owners)

    @staticmethod
    def pop_unretrieved(session) -> dict | None:
        """The read locks a classified sparse prefetch stashed in the session, taken out."""
        return session.extras.pop(BlendModule.UNRETRIEVED_KEYS_EXTRA, None)

    # --- LMCache's own coordinator client ---------------------------------------------------

    @property
    def coordinator_client_open(self) -> bool:
        return self._blend._coordinator is not None

    def close_coordinator_client(self) -> None:
        """Close LMCache's lookup client: its lookup is not served any more."""
        if self._blend._coordinator is not None:
            self._blend._coordinator.close()
            self._blend._coordinator = None

    def reopen_coordinator_client(self, url: str, *, timeout: float,
                                  match_concurrency: int) -> None:
        """LMCache's lookup client rebuilt on one URL (it breaks on a list)."""
        if self._blend._coordinator is None:
            return
        self._blend._coordinator.close()
        self._blend._coordinator = BlendCoordinatorClient.maybe_create(
            url, timeout=timeout, match_concurrency=match_concurrency)


def prefix_leg_hits(hit_cells, windows) -> int:
    """How many leading chunks a landed prefix prefetch found, as LMCache folds them."""
    leading, _ = fold_unfold_grouped(hit_cells, list(windows))
    return leading


def prefetched_keys(context, locked_key, leading: int, lock_gids) -> list:
    """The object keys a prefix leg read-locked for its `leading` chunks."""
    return resolve_prefetched_obj_keys(context, locked_key, leading, lock_gids)


def front_end_http_config():
    """The HTTP front end's config under `lmcache server` (None under the ZMQ-only entry
    point, or before LMCache loaded its front end)."""
    http_server = sys.modules.get(FRONT_END)
    return http_server._configs.get("http") if http_server is not None else None
