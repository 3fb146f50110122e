"""Test and demo harness: real LMCache servers loading the plugin, and an engine-side client
(`plugin.harness.lmcache_process`), for tests, examples and benchmarks. Never imported by
the product (tests/test_layering.py checks it).
"""
