"""The module LMCache is told to load: the plugin inside a real LMCache 0.5.6 or 0.5.7rc2
MP server (CPU or GPU), the same line on both versions:

    python -m lmcache.v1.multiprocess.server --engine-type blend ... \\
        --server-module '{"module_path": "plugin.lmcache_adapter"}'

(or `lmcache server ...` with the same flag). LMCache 0.5.6 calls `build_server_modules`
(its default factory name); 0.5.7 builds the `DiscoverableModule` classes defined here:
`FleetBlend` (module name `fleet_blend`, built after LMCache's `blend`, whose
`cb_unified_lookup` and `store` handlers it then overrides). The module's JSON `config`
holds `PluginConfig` field overrides plus `builtin_lookup`. Both entry points hand over to
`plugin.lmcache.factory`; the adapter itself is the `plugin.lmcache` sub-package. The
contract (what it requires, replaces, reports and says): docs/DESIGN.md, "Inside a real
LMCache MP server".
"""

from __future__ import annotations

from lmcache.v1.multiprocess.modules.blend import BlendModule

from plugin.lmcache.factory import FleetBuild, build_fleet_blend
from plugin.lmcache.internals import LMCACHE_057
from plugin.lmcache.module import FleetBlendModule

if LMCACHE_057:
    from lmcache.v1.multiprocess.engine_module import DiscoverableModule, ModuleBuildContext

__all__ = ["build_server_modules", "FleetBlendModule"] + (["FleetBlend"] if LMCACHE_057 else [])


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
