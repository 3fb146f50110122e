"""Registration takeover: with several coordinator URLs (replicas over one event log), or
an engine URL to register (`LMCACHE_COORDINATOR_ENGINE_URL`), the plugin's registrar and
reporter take the place of LMCache's, which take one URL and send no metadata.

LMCache 0.5.6's own coordinator components break on a list (its registrar task dies on the
invalid URL, its cache-event sink fails every flush), so the URL LMCache's HTTP front end
reads after the modules are built is cleared: LMCache starts neither. The plugin's reporter
and, under `lmcache server`, `plugin.registrar` fail over between the replicas. With
`builtin_lookup`, LMCache's lookup client is rebuilt on the first URL; P2P peer discovery
with several URLs is warned about, not supported. On LMCache 0.5.7 the plugin's registrar
also carries the negotiated chunk size (LMCache's own bind goes to its one URL). Design:
docs/DESIGN.md, "Inside a real LMCache MP server".
"""

from __future__ import annotations

import logging

from lmcache.v1.rpc_utils import get_ip

from plugin.config import PluginConfig
from plugin.lmcache.internals import (LMCACHE_057, LMCACHE_VERSION, BlendInternals,
                                      front_end_http_config)
from plugin.registrar import InstanceRegistrar

log = logging.getLogger(__name__)


def take_over_replicas(build, config: PluginConfig, blend,
                       builtin_lookup: bool) -> InstanceRegistrar | None:
    """Several coordinator URLs, or an engine URL (module doc): LMCache's registrar and
    event sink are kept from starting, and the plugin's registrar (under `lmcache server`)
    is returned."""
    coordinator = build.coordinator_config
    urls = config.coordinator_urls
    if build.mp_config.p2p_config.enabled and len(urls) > 1:
        log.warning("P2P peer discovery in LMCache %s takes one coordinator URL and cannot "
                    "use the list %s: P2P lookups will not find peers", LMCACHE_VERSION,
                    config.coordinator_url)
    if builtin_lookup:
        BlendInternals(blend).reopen_coordinator_client(
            urls[0], timeout=coordinator.blend_timeout,
            match_concurrency=coordinator.blend_match_concurrency)
    http = front_end_http_config()
    coordinator.url = ""  # read by LMCache's front end after this factory returns
    log.info("%d coordinator URL(s)%s: the plugin registers and reports cache events, "
             "failing over between them (LMCache's own registrar and event sink take one "
             "URL and send no metadata)", len(urls),
             f", engine at {config.engine_url}" if config.engine_url else "")
    if http is None:  # the ZMQ-only entry point registers nowhere, as LMCache's
        return None
    registrar = InstanceRegistrar(
        urls, instance_id=build.mp_config.instance_id,
        ip=coordinator.advertise_ip or get_ip(), http_port=http.http_port,
        heartbeat_interval=coordinator.heartbeat_interval,
        timeout=min(10.0, max(1.0, coordinator.heartbeat_interval)),
        p2p_advertised_url=build.mp_config.p2p_config.advertise_url,
        mq_port=build.mp_config.port if build.mp_config.p2p_config.enabled else 0,
        metadata=config.registration_metadata,
        token=config.coordinator_token, ca_file=config.coordinator_ca_file,
        breaker_threshold=config.breaker_threshold,
        breaker_cooldown_s=config.breaker_cooldown_s)
    if LMCACHE_057:
        # LMCache 0.5.7 binds a negotiated chunk size at its one URL (cleared above, so
        # it does not): the plugin's registrar sends it to the replicas instead.
        build.server_context.add_chunk_size_bind_listener(registrar.bind_chunk_size)
    return registrar
