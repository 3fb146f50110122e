"""The factory: checks a server can run the adapter, then builds `FleetBlendModule` from
what either LMCache version hands over (`FleetBuild`).

Refuses (naming why) an engine type other than `blend`, `--separate-object-groups`, an
unsupported LMCache version or one lacking an internal the adapter uses, and unknown module
config keys. The plugin's configuration: the server's coordinator settings, then
`PluginConfig`'s environment, then the module's JSON `config`. The entry points LMCache
calls are in `plugin.lmcache_adapter`. Design: docs/DESIGN.md, "Inside a real LMCache MP
server".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lmcache.logging import init_logger

from plugin.config import PluginConfig
from plugin.lmcache.internals import (LMCACHE_057, LMCACHE_VERSION, SUPPORTED_VERSIONS,
                                      front_end_http_config, missing_lmcache_internals)
from plugin.lmcache.module import FleetBlendModule
from plugin.lmcache.replicas import take_over_replicas

_ADAPTER_KEYS = {"builtin_lookup"}


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
    front_end = front_end_http_config() is not None
    coordinator = build.coordinator_config
    return front_end and bool(coordinator.url) and bool(coordinator.event_reporting)


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
    if len(config.coordinator_urls) > 1 or (config.coordinator_urls and config.engine_url):
        registrar = take_over_replicas(build, config, blends[0], builtin)
    module = FleetBlendModule(blends[0], config, lmcache_reports=lmcache_reports_events(build),
                              builtin_lookup=builtin, registrar=registrar)
    if LMCACHE_057:
        build.server_context.add_chunk_size_bind_listener(module.rebind_chunk_size)
    return module

