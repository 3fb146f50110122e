"""What a serving process loads for fleet-wide CacheBlend reuse.

    config = PluginConfig.from_env()
    host = InMemoryHost(chunk_size=config.chunk_size)   # or the engine's own ServingHost
    plugin = BlendPlugin(config, host)
    plugin.on_store(key, chunk_hashes, start)           # after the engine saved a range
    plugin.on_evict(chunk_hashes)                       # after the engine dropped chunks
    result = plugin.cb_unified_lookup(key, tp_size)     # None while pending, then a result
    plugin.close()

`blend_wire` owns every wire shape and the token codec; the other modules import it.
"""

from plugin.client import PENDING, BlendCoordinatorClient, MatchList
from plugin.config import ConfigError, PluginConfig
from plugin.host import InMemoryHost, ServingHost, chunk_hashes
from plugin.plugin import BlendPlugin, LookupTrace
from plugin.reporter import CacheEventReporter
from plugin.types import BlendMatch, BlendNamespace, CBMatchResult, CBUnifiedLookupResult, LookupKey

__all__ = [
    "PENDING",
    "MatchList",
    "BlendCoordinatorClient",
    "BlendMatch",
    "BlendNamespace",
    "BlendPlugin",
    "CBMatchResult",
    "CBUnifiedLookupResult",
    "CacheEventReporter",
    "ConfigError",
    "InMemoryHost",
    "LookupKey",
    "LookupTrace",
    "PluginConfig",
    "ServingHost",
    "chunk_hashes",
]
