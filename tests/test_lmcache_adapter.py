"""plugin.lmcache_adapter without a server: the pinned LMCache, the internals it uses, the
factory's refusals, the RPC signatures, and the tier rule for the local matcher.

The adapter in a running server is tests/test_lmcache_e2e.py.
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
from plugin.lmcache_adapter import (LMCACHE_VERSION, FleetBlendModule, TierWatcher,
                                    build_server_modules, missing_lmcache_internals)

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_lmcache_is_the_pinned_one():
    assert importlib.metadata.version("lmcache") == LMCACHE_VERSION
    pinned = re.search(r"^LMCACHE_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert pinned and pinned.group(1) == LMCACHE_VERSION


def test_every_lmcache_internal_the_adapter_uses_is_there():
    assert missing_lmcache_internals() == []


def test_a_missing_internal_is_named(monkeypatch):
    monkeypatch.delattr(LookupMixin, "_sparse_classify")  # where BlendModule gets it from
    assert missing_lmcache_internals() == [
        "lmcache.v1.multiprocess.modules.blend.BlendModule._sparse_classify"]
    blend = object.__new__(BlendModule)  # a live module's instance attributes, unset
    assert "BlendModule instance attribute _coordinator" in missing_lmcache_internals(blend)
    with pytest.raises(RuntimeError, match=r"lacks: .*BlendModule\._sparse_classify"):
        build_server_modules(_build(modules=(blend,)))


def test_the_replacement_handlers_match_lmcache_rpc_contract():
    # LMCache validates every handler against its RPC spec when the server starts; the same
    # check here names the RPC whose shape moved.
    validate_handler("cb_unified_lookup", FleetBlendModule.cb_unified_lookup)
    validate_handler("store", FleetBlendModule.store)


def test_the_factory_requires_the_blend_engine():
    with pytest.raises(ValueError, match="--engine-type blend"):
        build_server_modules(_build(engine_type="default"))


def test_the_factory_refuses_unknown_config_keys():
    blend = object.__new__(BlendModule)
    blend._coordinator, blend._segmented_prefix = None, False
    with pytest.raises(ValueError, match="blend_timout"):
        build_server_modules(_build(modules=(blend,), config={"blend_timout": 0.5}))


def _build(engine_type="blend", modules=(), config=None):
    return SimpleNamespace(mp_config=SimpleNamespace(engine_type=engine_type, instance_id="s"),
                           modules=modules, config=config or {},
                           coordinator_config=SimpleNamespace(url="", event_reporting=False))


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


def test_the_adapter_module_is_the_only_one_importing_lmcache_internals():
    offenders = []
    for path in list((ROOT / "plugin").glob("*.py")) + list((ROOT / "coordinator_stub").glob("*.py")):
        if path.name in ("lmcache_adapter.py", "lmcache_process.py"):
            continue
        if re.search(r"^\s*(from|import) lmcache\b", path.read_text(), re.M):
            offenders.append(path.name)
    assert offenders == []
    assert lmcache_adapter.__doc__ and "--server-module" in lmcache_adapter.__doc__


# --- the segmented prefix is carried through ------------------------------------------------

def test_the_segmented_prefix_tail_is_carried_into_the_result():
    # `--enable-segmented-prefix`: chunks the prefix leg retained after a gap come back at
    # their own positions, as LMCache's lookup returns them, next to our segments.
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.session import SessionManager
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    from plugin.lmcache_adapter import LMCacheHost, _Op
    from plugin.types import CBMatchResult, CBUnifiedLookupResult

    C = 4
    hasher = TokenHasher(chunk_size=C)
    sessions = SessionManager(hasher, cleanup_interval=None)
    context = SimpleNamespace(storage_manager=None, chunk_size=C, session_manager=sessions)
    host = LMCacheHost(SimpleNamespace(context=context))
    tokens = tuple(range(100, 100 + 5 * C + 2))
    key = IPCCacheServerKey(model_name="m", world_size=1, worker_id=None, token_ids=tokens,
                            start=0, end=len(tokens), request_id="r1", num_kv_readers=1)
    sessions.get_or_create("r1").set_tokens(list(tokens))
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
