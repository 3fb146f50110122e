"""The RPC codec: LMCache's request keys on either supported version, and the payloads of
the adapter's server-module methods (`STATUS_METHOD`, `BUILTIN_LOOKUP_METHOD`).

0.5.6 carries a key's tokens as `token_ids` (a tuple of int); 0.5.7rc2 packs them into
`token_bytes` (big-endian uint32). `key_tokens` reads either as one uint32 array;
`make_key` builds a key from ids on either. The test harness (plugin.harness) calls the
methods with these payloads. Design: docs/DESIGN.md, "Inside a real LMCache MP server".
"""

from __future__ import annotations

import msgspec
import numpy as np

from lmcache.v1.multiprocess.custom_types import CBUnifiedLookupResult, IPCCacheServerKey

from plugin.lmcache.internals import LMCACHE_057

if LMCACHE_057:
    from lmcache.v1.multiprocess.token_codec import pack_token_ids

STATUS_METHOD = "fleet_blend.status"
BUILTIN_LOOKUP_METHOD = "fleet_blend.builtin_cb_unified_lookup"


def key_tokens(key: IPCCacheServerKey) -> np.ndarray:
    """The key's token ids as uint32 (0.5.7 packs them big-endian: one vectorised swap)."""
    if LMCACHE_057:
        return np.frombuffer(key.token_bytes, dtype=">u4").astype(np.uint32)
    return np.asarray(key.token_ids, dtype=np.uint32)


def key_num_tokens(key: IPCCacheServerKey) -> int:
    return key.num_tokens if LMCACHE_057 else len(key.token_ids)


def make_key(**fields) -> IPCCacheServerKey:
    """An `IPCCacheServerKey` from `token_ids` (a sequence of int), on either version."""
    tokens = fields.pop("token_ids")
    if LMCACHE_057:
        return IPCCacheServerKey(token_bytes=pack_token_ids(tokens), **fields)
    return IPCCacheServerKey(token_ids=tuple(int(t) for t in tokens), **fields)


def session_tokens(key: IPCCacheServerKey):
    """What `Session.set_tokens` takes on this version."""
    return key.token_bytes if LMCACHE_057 else list(key.token_ids)


# --- payloads of the server-module methods ---------------------------------------------------

def encode_lookup_call(key: IPCCacheServerKey, tp_size: int) -> bytes:
    return msgspec.msgpack.encode((key, tp_size))


def decode_lookup_call(payload: bytes) -> tuple[IPCCacheServerKey, int]:
    return msgspec.msgpack.decode(payload, type=tuple[IPCCacheServerKey, int])


def encode_lookup_result(result: CBUnifiedLookupResult | None) -> bytes:
    return msgspec.msgpack.encode(result)


def decode_lookup_result(payload: bytes) -> CBUnifiedLookupResult | None:
    return msgspec.msgpack.decode(payload, type=CBUnifiedLookupResult | None)

