"""Ready means compiled: once `create_app` returns (and so before the process prints its
"listening on" line), no request compiles a numba kernel."""

from __future__ import annotations

import json
import subprocess
import sys

LANE = "coordinator"

_PROBE = r'''
import asyncio, json, sys
import numba.core.registry
import numpy as np

from coordinator_stub import COORDINATOR, CoordinatorConfig, create_app
from coordinator_stub.http.app import WRITES
from blend_wire import encode, encode_tokens, pack_kv_rank


def compiled():
    """Every numba dispatcher loaded, with how many specialisations it holds."""
    found = {}
    for name, module in list(sys.modules.items()):
        for attr, value in list(vars(module).items()) if module else ():
            if isinstance(value, numba.core.registry.CPUDispatcher):
                found[f"{name}.{attr}"] = len(value.signatures)
    return found


C = 256
app = create_app(CoordinatorConfig(enable_blend_lookup=True, chunk_size=C))
ready = compiled()
coordinator = app[COORDINATOR]
writes = app[WRITES]
writes.ingest_queue.start()  # what the running app does (its cleanup context)


def ingest(body):
    return writes.submit(body).result(60)
rng = np.random.default_rng(0)
docs = [rng.integers(0, 128_000, C, dtype=np.uint32) for _ in range(3)]


def key(h, salt=""):
    return {"chunk_hash_hex": h, "model_name": "m", "kv_rank": pack_kv_rank(1),
            "cache_salt": salt}


def events(seq, kind, entries, incarnation=0):
    return encode({"batches": [{"instance_id": "s0", "incarnation": incarnation, "seq": seq,
                                "event_type": kind, "tier": "l1", "backend": "dram",
                                "entries": entries}]})


ingest(events(1, "store", [
    {"key": key(f"{i:02x}"), "size_bytes": 8, "token_ids": d.tolist(), "token_offset": 256 * i}
    for i, d in enumerate(docs)]))
ingest(events(2, "store", [{"key": key("00", "t1")}]))
ingest(events(3, "store", [{"key": key("01"), "token_ids": docs[2].tolist(),
                                        "token_offset": 0}]))
query = np.concatenate([docs[1], docs[0], docs[2]])
coordinator.lookup(encode({"tokens_b64": encode_tokens(query), "model_name": "m"}))
coordinator.directory_lookup(encode({"token_ids": query.tolist(), "model_name": "m"}))
coordinator.directory_lookup(encode({"keys": [key("00")]}))
coordinator.directory_keys({})
ingest(events(4, "delete", [{"key": key("00", "t1")}]))
ingest(events(1, "store", [{"key": key("05"), "token_ids": docs[0].tolist(),
                                        "token_offset": 0}], incarnation=1))
coordinator.drop_instance("s0")
coordinator.stats()
writes.ingest_queue.close()
print(json.dumps({"ready": ready, "after": compiled()}))
'''


def test_no_kernel_compiles_after_the_coordinator_is_ready():
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    ready, after = report["ready"], report["after"]
    assert ready, "no numba kernel found loaded: the probe looks in the wrong place"
    compiled_late = {name: (ready.get(name, 0), count) for name, count in after.items()
                     if count != ready.get(name, 0)}
    assert not compiled_late, f"kernels compiled after ready: {compiled_late}"
