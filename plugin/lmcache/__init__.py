"""The LMCache adapter: the plugin inside a real LMCache 0.5.6 / 0.5.7rc2 MP server.

One job per module: `internals` (the LMCache version pin and every private LMCache name
the adapter reads), `rpc` (LMCache's keys on either version, the server-module payloads),
`host` (`LMCacheHost`: LMCache's prefix leg and sparse prefetch as the plugin's host),
`tiers` (`TierWatcher`: which tiers hold each indexed chunk), `module`
(`FleetBlendModule`: the RPC handlers), `factory` (the checks and the build),
`replicas` (several coordinator URLs). LMCache loads `plugin.lmcache_adapter`, which hands
over to the factory. Nothing here is imported by `import plugin`.
Design: docs/DESIGN.md, "Inside a real LMCache MP server".
"""
