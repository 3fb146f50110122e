"""The LMCache adapter (plugin.lmcache, loaded as plugin.lmcache_adapter) without a server:
the pinned LMCache, the internals it uses (and what moved between the supported versions),
the factory's refusals, the RPC signatures, and the tier rule for the local matcher.

Runs against whichever supported LMCache is importable: 0.5.6 in the suite's own process,
0.5.7rc2 in the child run of tests/e2e/test_lmcache057.py. The adapter in a running server is
tests/e2e/test_lmcache_e2e.py.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from lmcache.v1.distributed.api import L1BackendType, ObjectKey
from lmcache.v1.distributed.internal_api import L1ObjectMeta
from lmcache.v1.multiprocess.modules.blend import BlendModule
from lmcache.v1.multiprocess.modules.blend.lookup import LookupMixin
from lmcache.v1.multiprocess.request_handler import validate_handler

from plugin import lmcache_adapter
from plugin.lmcache.factory import FleetBuild, build_fleet_blend
from plugin.lmcache.internals import (LMCACHE_057, LMCACHE_VERSION, MOVED_IN_057,
                                      SUPPORTED_VERSIONS, VERSION_INTERNALS, _has,
                                      missing_lmcache_internals)
from plugin.lmcache.module import FleetBlendModule
from plugin.lmcache.rpc import make_key
from plugin.lmcache.tiers import TierWatcher

LANE = "lmcache"

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_lmcache_is_a_pinned_one():
    assert importlib.metadata.version("lmcache") == LMCACHE_VERSION
    assert LMCACHE_VERSION in SUPPORTED_VERSIONS
    makefile = (ROOT / "Makefile").read_text()
    pinned = re.findall(r"^LMCACHE(?:_057)?_VERSION := (\S+)$", makefile, re.M)
    assert sorted(pinned) == sorted(SUPPORTED_VERSIONS)


def test_every_lmcache_internal_the_adapter_uses_is_there():
    assert missing_lmcache_internals() == []


def test_what_moved_between_the_versions_is_named():
    """Each version's own internals are there and the other's are not: what MOVED_IN_057
    states, checked on the installed LMCache (the other version checks it the other way)."""
    other = next(v for v in SUPPORTED_VERSIONS if v != LMCACHE_VERSION)
    assert [f"{m}.{d}" for m, d in VERSION_INTERNALS[LMCACHE_VERSION] if not _has(m, d)] == []
    assert [f"{m}.{d}" for m, d in VERSION_INTERNALS[other] if _has(m, d)] == []
    assert LMCACHE_057 == (LMCACHE_VERSION == "0.5.7rc2")
    assert len(MOVED_IN_057) == 4 and all(MOVED_IN_057.values())

def test_a_missing_internal_is_named(monkeypatch):
    monkeypatch.delattr(LookupMixin, "_sparse_classify")  # where BlendModule gets it from
    assert missing_lmcache_internals() == [
        "lmcache.v1.multiprocess.modules.blend.BlendModule._sparse_classify"]
    blend = object.__new__(BlendModule)  # a live module's instance attributes, unset
    assert "BlendModule instance attribute _coordinator" in missing_lmcache_internals(blend)
    with pytest.raises(RuntimeError, match=r"lacks: .*BlendModule\._sparse_classify"):
        build_fleet_blend(_build(modules=(blend,)))


def test_the_replacement_handlers_match_lmcache_rpc_contract():
    # LMCache validates every handler against its RPC spec when the server starts; the same
    # check here names the RPC whose shape moved.
    validate_handler("cb_unified_lookup", FleetBlendModule.cb_unified_lookup)
    validate_handler("store", FleetBlendModule.store)


def test_the_factory_requires_the_blend_engine():
    with pytest.raises(ValueError, match="--engine-type blend"):
        build_fleet_blend(_build(engine_type="default"))


def test_the_factory_refuses_separate_object_groups():
    with pytest.raises(ValueError, match="--separate-object-groups"):
        build_fleet_blend(_build(modules=(_blend(),), separate_object_groups=True))


def test_the_factory_refuses_unknown_config_keys():
    with pytest.raises(ValueError, match="blend_timout"):
        build_fleet_blend(_build(modules=(_blend(),), config={"blend_timout": 0.5}))


def _blend():
    blend = object.__new__(BlendModule)
    blend._coordinator, blend._segmented_prefix = None, False
    return blend


def _build(engine_type="blend", modules=(), config=None, separate_object_groups=False):
    return FleetBuild(server_context=SimpleNamespace(chunk_size=256),
                      mp_config=SimpleNamespace(engine_type=engine_type, instance_id="s",
                                                separate_object_groups=separate_object_groups),
                      coordinator_config=SimpleNamespace(url="", event_reporting=False),
                      config=config or {}, blends=list(modules))


# --- the tier rule -----------------------------------------------------------------------------

class Recorder:
    """Stands in for CacheEventReporter: records what would be posted."""

    def __init__(self):
        self.calls = []

    def report_store(self, namespace, hashes, token_chunks, offsets, *, tier, backend):
        self.calls.append(("store", tier, backend, list(hashes),
                           [None if t is None else len(t) for t in token_chunks], list(offsets)))

    def report_delete(self, namespace, hashes, *, tier, backend):
        self.calls.append(("delete", tier, backend, list(hashes)))


def key(chunk_hash: bytes, rank: int = 0) -> ObjectKey:
    return ObjectKey(chunk_hash=chunk_hash, model_name="m", kv_rank=(1 << 24) | rank,
                     cache_salt="")


def l1(kind, *keys):
    meta = [L1ObjectMeta(size_bytes=1, backend=L1BackendType.DRAM) for _ in keys]
    return SimpleNamespace(event_type=kind, metadata={"keys": list(keys), "meta": meta})


def l2(kind, *keys):
    return SimpleNamespace(event_type=kind, metadata={"keys": list(keys), "backend": "fs"})


def watcher():
    gone, reporter = [], Recorder()
    tiers = TierWatcher(gone.extend, reporter)
    tiers.track([b"h0", b"h1"], np.arange(8, dtype=np.uint32), 0, 4)
    return tiers, gone, reporter


def test_an_l1_eviction_with_an_l2_copy_is_not_a_loss():
    tiers, gone, reporter = watcher()
    tiers._on_l1_write(l1("w", key(b"h0"), key(b"h1")))
    tiers._on_l2_stored(l2("s", key(b"h0"), key(b"h1")))
    tiers._on_l1_evicted(l1("e", key(b"h0"), key(b"h1")))
    assert gone == [] and tiers.tracked == 2
    tiers._on_l2_deleted(l2("d", key(b"h0")))
    assert gone == [b"h0"] and tiers.tracked == 1
    # One event per (tier, backend) change, tokens with the first L1 store only.
    assert reporter.calls == [
        ("store", "l1", "dram", [b"h0", b"h1"], [4, 4], [0, 4]),
        ("store", "l2", "fs", [b"h0", b"h1"], [None, None], [-1, -1]),
        ("delete", "l1", "dram", [b"h0", b"h1"]),
        ("delete", "l2", "fs", [b"h0"]),
    ]


def test_a_chunk_stays_while_any_rank_holds_it_and_foreign_chunks_are_ignored():
    tiers, gone, reporter = watcher()
    tiers._on_l1_write(l1("w", key(b"h0", 0), key(b"h0", 1), key(b"peer")))
    tiers._on_l1_evicted(l1("e", key(b"h0", 0)))
    assert gone == []
    tiers._on_l1_evicted(l1("e", key(b"h0", 1), key(b"peer")))
    assert gone == [b"h0"]
    assert [c[:4] for c in reporter.calls] == [("store", "l1", "dram", [b"h0"]),
                                               ("delete", "l1", "dram", [b"h0"])]


def test_only_the_adapter_and_the_harness_import_lmcache():
    allowed = (ROOT / "plugin" / "lmcache", ROOT / "plugin" / "harness")
    offenders = []
    for path in list((ROOT / "plugin").rglob("*.py")) + list((ROOT / "coordinator_stub").rglob("*.py")):
        if path.name == "lmcache_adapter.py" or any(p in path.parents for p in allowed):
            continue
        if re.search(r"^\s*(from|import) lmcache\b", path.read_text(), re.M):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
    assert lmcache_adapter.__doc__ and "--server-module" in lmcache_adapter.__doc__


def test_private_lmcache_names_are_imported_by_the_internals_module_only():
    # Its attributes are checked by tests/serving/test_plugin_http.py (no `x._name` outside it).
    import ast
    offenders = []
    for path in [ROOT / "plugin" / "lmcache_adapter.py", *(ROOT / "plugin").rglob("*.py")]:
        if path == ROOT / "plugin" / "lmcache" / "internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lmcache"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private or any(p.startswith("_") for p in node.module.split(".")):
                    offenders.append(f"{path.relative_to(ROOT)}: {node.module} {private}")
    assert offenders == []


# --- the segmented prefix is carried through ------------------------------------------------

def test_the_segmented_prefix_tail_is_carried_into_the_result():
    # `--enable-segmented-prefix`: chunks the prefix leg retained after a gap come back at
    # their own positions, as LMCache's lookup returns them, next to our segments.
    from lmcache.v1.multiprocess.session import SessionManager
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    from plugin.lmcache.host import LMCacheHost, _Op
    from plugin.lmcache.rpc import session_tokens
    from plugin.types import CBMatchResult, CBUnifiedLookupResult

    C = 4
    hasher = TokenHasher(chunk_size=C)
    sessions = SessionManager(hasher, cleanup_interval=None)
    context = SimpleNamespace(storage_manager=None, chunk_size=C, session_manager=sessions)
    host = LMCacheHost(SimpleNamespace(context=context))
    tokens = tuple(range(100, 100 + 5 * C + 2))
    key = make_key(model_name="m", world_size=1, worker_id=None, token_ids=tokens,
                   start=0, end=len(tokens), request_id="r1", num_kv_readers=1)
    sessions.get_or_create("r1").set_tokens(session_tokens(key))
    hashes = [TokenHasher.hash_to_bytes(h) for h in sessions.get("r1").get_hashes(0, 5 * C)]
    # Prefix: chunk 0, then a gap at chunk 1; chunks 2 and 4 retained behind it.
    host._ops["r1"] = _Op(key, 1, segmented=True, prefix_done=True, leading=1, retained=[0, 2, 4])
    ours = CBMatchResult(0, C, 3 * C, 4 * C, b"peer")
    result = host.finish("r1", CBUnifiedLookupResult(C, [ours]))
    assert result.prefix_coverage_tokens == C
    assert [(s.old_st, s.cur_st, s.hash) for s in result.non_prefix_segments] == [
        (0, 3 * C, b"peer")]
    assert [(s.old_st, s.old_ed, s.cur_st, s.cur_ed, s.hash)
            for s in result.segmented_prefix_segments] == [
        (2 * C, 3 * C, 2 * C, 3 * C, hashes[2]), (4 * C, 5 * C, 4 * C, 5 * C, hashes[4])]
    assert host.stats()["in_flight"] == 0 and host.stats()["releasing"] == 0


# --- a chunk size LMCache binds later (0.5.7 negotiates it) ----------------------------------

def test_a_bound_chunk_size_rebuilds_the_plugin_empty_at_that_size():
    """LMCache 0.5.7 binds its chunk size when the first engine registers; the adapter's
    listener moves the plugin (its local matcher, its host) to that size, empty."""
    from plugin.config import PluginConfig

    bus = SimpleNamespace(enabled=True, subscribers=[])
    bus.register_subscriber = bus.subscribers.append
    context = SimpleNamespace(storage_manager=None, chunk_size=4, event_bus=bus,
                              session_manager=SimpleNamespace(destroy_listeners=[]))
    blend = SimpleNamespace(context=context, _coordinator=None)
    module = FleetBlendModule(blend, PluginConfig(chunk_size=4), lmcache_reports=False,
                              builtin_lookup=False)
    try:
        first = module.plugin
        module.tiers.track([b"h0"], np.arange(4, dtype=np.uint32), 0, 4)
        module.rebind_chunk_size(4)  # the size it was built with: nothing changes
        assert module.plugin is first and module.tiers.tracked == 1
        module.rebind_chunk_size(8)
        assert module.plugin is not first and first._closed
        assert module.plugin.chunk_size == module.host.chunk_size == 8
        assert module.tiers.tracked == 0
        # The tier watcher reaches the new plugin (evictions land where chunks now live).
        module.tiers.track([b"h1"], np.arange(8, dtype=np.uint32), 0, 8)
        module.tiers._on_l1_write(l1("w", key(b"h1")))
        module.tiers._on_l1_evicted(l1("e", key(b"h1")))
        assert module.tiers.tracked == 0
    finally:
        module.close()
