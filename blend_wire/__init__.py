"""The HTTP contract between serving processes and a coordinator (shared/WIRE.md).

A neutral package: the only place the wire shapes, their defaults and limits, the token
codec and the shared value types (`BlendNamespace`, and `BlendMatch` /
`UNKNOWN_TOKEN_OFFSET` from `local_matcher.types`) are written down. The plugin's client
and reporter and the bundled coordinator all import them from here, and importing it
loads neither side: no httpx, no aiohttp (tests/test_layering.py checks both). The shapes follow LMCache's MP coordinator
(0.5.x) field for field, so either side can talk to LMCache's other side.

Decoding is validation: `decode(body, Shape)` either returns a fully checked
value or raises `WireError` whose message names the offending field, e.g.
``Expected `int` >= 1 - at `$.batches[0].seq```. Nothing partial is returned.
"""

from __future__ import annotations

import base64
from typing import Annotated, Literal, NamedTuple, TypeVar

import msgspec
import numpy as np
from numba import njit

from local_matcher.index import as_tokens
from local_matcher.types import MAX_TOKEN_ID, UNKNOWN_TOKEN_OFFSET

BLEND_LOOKUP_PATH = "/directory/blend-lookup"
EVENTS_PATH = "/events"
STATS_PATH = "/directory/stats"
HEALTH_PATH = "/healthz"


NonNegative = Annotated[int, msgspec.Meta(ge=0)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]


class WireError(ValueError):
    """A body that breaks the wire contract. The message says which field and why."""


class BlendNamespace(NamedTuple):
    """Who may be offered a chunk: only requesters of the namespace that stored it."""

    model_name: str
    cache_salt: str
    world_size: int


# --- token codec -----------------------------------------------------------------


def encode_tokens(tokens) -> str:
    """Pack token ids as little-endian uint32, then standard base64 with padding."""
    try:
        array = as_tokens(tokens)
    except ValueError as exc:
        raise WireError(str(exc)) from None
    return base64.b64encode(array.astype("<u4", copy=False).tobytes()).decode("ascii")


_B64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_B64_VALUES = np.full(256, 255, dtype=np.uint8)
_B64_VALUES[np.frombuffer(_B64_ALPHABET, dtype=np.uint8)] = np.arange(64, dtype=np.uint8)
_PAD = ord("=")


@njit(cache=True, nogil=True)
def _b64_decode(text, values):
    """Strict base64 to bytes; returns (bytes, -1) or (empty, index of the first bad char).

    Runs without the GIL: a coordinator decodes every query on a worker thread while its
    event loop goes on serving.
    """
    n = text.shape[0]
    pad = 0
    if n >= 1 and text[n - 1] == _PAD:
        pad = 2 if n >= 2 and text[n - 2] == _PAD else 1
    out = np.empty(n // 4 * 3, dtype=np.uint8)
    for i in range(0, n, 4):
        acc = np.uint32(0)
        for j in range(4):
            c = text[i + j]
            v = values[c]
            if v == 255:
                if i + j < n - pad:
                    return out[:0], i + j
                v = 0  # padding, already checked to be only at the very end
            acc = (acc << np.uint32(6)) | np.uint32(v)
        out[i // 4 * 3] = (acc >> np.uint32(16)) & np.uint32(255)
        out[i // 4 * 3 + 1] = (acc >> np.uint32(8)) & np.uint32(255)
        out[i // 4 * 3 + 2] = acc & np.uint32(255)
    return out[: out.shape[0] - pad], -1


def decode_tokens(text: str) -> np.ndarray:
    """Inverse of `encode_tokens`: a native uint32 array, or `WireError` saying why not."""
    try:
        raw = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    except UnicodeEncodeError:
        raise WireError("tokens_b64 is not valid base64: it has non-ASCII characters") from None
    if raw.size % 4:
        raise WireError(f"tokens_b64 is not valid base64: its length {raw.size} is not a "
                        "multiple of 4 (padding missing?)")
    decoded, bad_at = _b64_decode(raw, _B64_VALUES)
    if bad_at >= 0:
        raise WireError(f"tokens_b64 is not valid base64: character {chr(raw[bad_at])!r} "
                        f"at position {bad_at}")
    if decoded.size % 4:
        raise WireError(f"tokens_b64 decodes to {decoded.size} bytes, not a multiple of 4")
    return decoded.view("<u4").astype(np.uint32, copy=False)


# --- kv_rank packing ---------------------------------------------------------------


def pack_kv_rank(world_size: int, global_rank: int = 0, local_world_size: int | None = None,
                 local_rank: int = 0) -> int:
    """`(world_size << 24) | (global_rank << 16) | (local_world_size << 8) | local_rank`."""
    if local_world_size is None:
        local_world_size = world_size
    for name, value in (("world_size", world_size), ("global_rank", global_rank),
                        ("local_world_size", local_world_size), ("local_rank", local_rank)):
        if not 0 <= value <= 0xFF:
            raise WireError(f"{name}={value} does not fit in one byte of kv_rank")
    return (world_size << 24) | (global_rank << 16) | (local_world_size << 8) | local_rank


def world_size_of(kv_rank: int) -> int:
    return (kv_rank >> 24) & 0xFF


# --- POST /directory/blend-lookup ---------------------------------------------------


class BlendLookupRequest(msgspec.Struct, kw_only=True):
    tokens_b64: str = ""
    model_name: str = ""
    world_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if self.tokens_b64 and not self.model_name:
            raise ValueError("model_name is required when tokens_b64 is non-empty")

    @property
    def namespace(self) -> BlendNamespace:
        return BlendNamespace(self.model_name, self.cache_salt, self.world_size)


class WireBlendMatch(msgspec.Struct, kw_only=True):
    chunk_hash: str
    old_st: int
    cur_st: int


class BlendLookupReply(msgspec.Struct, kw_only=True):
    matches: list[WireBlendMatch] = msgspec.field(default_factory=list)


# --- POST /events --------------------------------------------------------------------


class EncodedObjectKey(msgspec.Struct, kw_only=True, frozen=True):
    chunk_hash_hex: str
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if not self.chunk_hash_hex:
            raise ValueError("chunk_hash_hex must be non-empty hex")
        try:
            bytes.fromhex(self.chunk_hash_hex)
        except ValueError:
            raise ValueError(f"chunk_hash_hex {self.chunk_hash_hex[:64]!r} is not valid hex") from None

    @property
    def chunk_hash(self) -> bytes:
        return bytes.fromhex(self.chunk_hash_hex)

    @property
    def namespace(self) -> BlendNamespace:
        return BlendNamespace(self.model_name, self.cache_salt, world_size_of(self.kv_rank))


class CacheEventEntry(msgspec.Struct, kw_only=True):
    key: EncodedObjectKey
    size_bytes: NonNegative = 0
    token_ids: list[TokenId] = msgspec.field(default_factory=list)
    token_offset: int = UNKNOWN_TOKEN_OFFSET

    def __post_init__(self) -> None:
        if self.token_offset < UNKNOWN_TOKEN_OFFSET:
            raise ValueError(
                f"token_offset {self.token_offset} is invalid: use >= 0, or -1 for unknown")


EventType = Literal["store", "delete", "access", "config"]
Tier = Literal["l1", "l2"]


class CacheEventBatch(msgspec.Struct, kw_only=True):
    instance_id: Annotated[str, msgspec.Meta(min_length=1)]
    incarnation: NonNegative = 0
    seq: Annotated[int, msgspec.Meta(ge=1)]
    event_type: EventType
    tier: Tier
    backend: str = ""
    entries: list[CacheEventEntry] = msgspec.field(default_factory=list)
    shared: bool = False
    ts: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    capacity_bytes: NonNegative = 0
    capacity_revision: NonNegative = 0

    def __post_init__(self) -> None:
        if self.event_type in ("store", "delete", "config") and not self.backend:
            raise ValueError(f"backend must be non-empty for a {self.event_type} batch")
        if self.event_type == "config" and self.entries:
            raise ValueError("a config batch carries no entries")


class EventsRequest(msgspec.Struct, kw_only=True):
    batches: list[CacheEventBatch]


class EventsReply(msgspec.Struct, kw_only=True):
    applied: int
    duplicates: int
    stale: int


# --- encoding and validated decoding ----------------------------------------------------

T = TypeVar("T")
_decoders: dict[type, msgspec.json.Decoder] = {}
encode = msgspec.json.Encoder().encode


def decode(body: bytes | str, shape: type[T]) -> T:
    """Decode and validate a JSON body as `shape`, or raise `WireError` naming the field."""
    decoder = _decoders.get(shape)
    if decoder is None:
        decoder = _decoders[shape] = msgspec.json.Decoder(shape)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise WireError(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise WireError(f"body is not valid JSON: {exc}") from None
