"""What a serving process loads for fleet-wide CacheBlend reuse.

    config = PluginConfig.from_env()
    host = InMemoryHost(chunk_size=config.chunk_size)   # or the engine's own ServingHost
    plugin = BlendPlugin(config, host)
    plugin.on_store(key, chunk_hashes, start)           # after the engine saved a range
    plugin.on_evict(chunk_hashes)                       # after the engine dropped chunks
    result = plugin.cb_unified_lookup(key, tp_size)     # None while pending, then a result
    plugin.close()

`blend_wire` owns every wire shape and the token codec; `plugin.http` the one HTTP policy;
`plugin.types` every value and state type the parts hand each other.
"""

from plugin.client import BlendCoordinatorClient, ClientStats
from plugin.config import ConfigError, PluginConfig
from plugin.host import InMemoryHost, ServingHost, chunk_hashes
from plugin.plugin import BlendPlugin, LookupTrace, PluginStats
from plugin.registrar import InstanceRegistrar, RegistrarStats
from plugin.reporter import CacheEventReporter, ReporterStats
from plugin.types import (BlendMatch, BlendNamespace, BreakerState, CBMatchResult,
                          CBUnifiedLookupResult, FleetReply, FleetStatus,
                          FoundColumns, FoundContent, LookupKey, MatchState, Place, Source)

__all__ = [
    "BlendCoordinatorClient",
    "BlendMatch",
    "BlendNamespace",
    "BlendPlugin",
    "BreakerState",
    "CBMatchResult",
    "CBUnifiedLookupResult",
    "CacheEventReporter",
    "ClientStats",
    "ConfigError",
    "FleetReply",
    "FleetStatus",
    "FoundColumns",
    "FoundContent",
    "InMemoryHost",
    "InstanceRegistrar",
    "LookupKey",
    "LookupTrace",
    "MatchState",
    "Place",
    "PluginConfig",
    "PluginStats",
    "RegistrarStats",
    "ReporterStats",
    "ServingHost",
    "Source",
    "chunk_hashes",
]
