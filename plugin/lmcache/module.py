"""`FleetBlendModule`: the engine module LMCache's server runs in place of its blend
module's `cb_unified_lookup` and `store` handlers.

`cb_unified_lookup` is `BlendPlugin`'s (local matcher + coordinator leg in one budget) over
`LMCacheHost`; `store` runs LMCache's blend store unchanged, then (worker 0) registers the
stored full chunks in the local matcher. LMCache's own coordinator client is closed unless
`builtin_lookup` keeps LMCache's lookup reachable as `BUILTIN_LOOKUP_METHOD`;
`STATUS_METHOD` answers what the plugin holds. Built by `plugin.lmcache.factory`.
Design: docs/DESIGN.md, "Inside a real LMCache MP server".
"""

from __future__ import annotations

import dataclasses
import json
import logging

from lmcache.v1.multiprocess.custom_types import CBUnifiedLookupResult, IPCCacheServerKey
from lmcache.v1.multiprocess.ext_server_module import server_module_handler
from lmcache.v1.multiprocess.request_handler import HandlerType, request_handler
from lmcache.v1.multiprocess.token_hasher import TokenHasher

from blend_wire.version import project_version
from plugin.config import PluginConfig
from plugin.lmcache.host import LMCacheHost
from plugin.lmcache.internals import LMCACHE_VERSION, BlendInternals
from plugin.lmcache.rpc import (BUILTIN_LOOKUP_METHOD, STATUS_METHOD, decode_lookup_call,
                                encode_lookup_result, key_tokens, session_tokens)
from plugin.lmcache.tiers import TierWatcher
from plugin.plugin import BlendPlugin
from plugin.registrar import InstanceRegistrar
from plugin.reporter import CacheEventReporter
from plugin.types import LookupKey

log = logging.getLogger(__name__)


class FleetBlendModule:
    """Engine module serving `cb_unified_lookup` and `store` in place of LMCache's blend."""

    def __init__(self, blend, config: PluginConfig, *, lmcache_reports: bool,
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
        self._internals = BlendInternals(blend)
        lmcache_client = self._internals.coordinator_client_open
        if lmcache_client and not builtin_lookup:
            self._internals.close_coordinator_client()  # its lookup is not served any more
        self.loaded = {
            "name": "fleet-blend", "version": project_version(),
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
                session.set_tokens(session_tokens(key))
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
            "lmcache_coordinator_client": ("open" if self._internals.coordinator_client_open
                                           else "closed"),
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
