"""The wire's values and their rules: `WireError`, the ranges every field is held to, the
key-string rules LMCache's `ObjectKey` applies (`check_*`), `BlendNamespace`, kv_rank
packing and the loopback rule. docs/WIRE.md.
"""

from __future__ import annotations

import binascii
import ipaddress
from typing import Annotated, Any, NamedTuple

import msgspec

from blend_wire.errors import Unprocessable

# --- ranges: what the directory and the index can hold ----------------------------------
#: Sequence numbers, incarnations, sizes and capacities: signed 64-bit, as every store of
#: them (numpy, Prometheus, LMCache's own SQL persistence) can hold.
MAX_INT64 = 2**63 - 1
#: `kv_rank` packs four bytes (`pack_kv_rank`); `object_group_id` is a 32-bit index.
MAX_KV_RANK = 2**32 - 1
MAX_OBJECT_GROUP_ID = 2**32 - 1
#: A chunk's stored position. Tighter than int64 so that `old_st + chunk_size` never
#: overflows the index's int64 offsets, and exact in any JSON reader (2^53).
MAX_TOKEN_OFFSET = 2**53 - 1
#: LMCache's `ObjectKey` rules for a salt (it is embedded in file names and C strings).
MAX_CACHE_SALT_CHARS = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
#: Generous bounds on strings that are interned per key or per instance.
MAX_CHUNK_HASH_HEX_CHARS = 1024
MAX_NAME_CHARS = 1024
#: `world_size` of a lookup: at most what kv_rank's byte can hold is ever stored, but a
#: larger one is only a query that finds nothing (as in LMCache), so the bound is loose.
MAX_WORLD_SIZE = 2**32 - 1

#: `old_st` of a chunk whose stored position was never reported; never read as 0.
UNKNOWN_TOKEN_OFFSET = -1
#: Token ids are uint32 everywhere: in the index, on the wire.
MAX_TOKEN_ID = 2**32 - 1
#: The candidates form names, per content, at most this many chunks beyond one per
#: position it occurs at (so a caller preferring some placements has a choice), and at most
#: `MAX_CANDIDATE_CHUNKS` in all. A chunk can serve one position of a result, so more than
#: one per position is only ever a choice, never more reuse.
CANDIDATE_SPARE_CHUNKS = 4
MAX_CANDIDATE_CHUNKS = 64
#: Bounded work per lookup (WIRE.md, "Limits"): the candidates form names at most this many
#: positions per content, its leftmost (a content serves at most `MAX_CANDIDATE_CHUNKS`
#: positions of a result anyway, and the selection is leftmost-greedy) ...
MAX_CANDIDATE_POSITIONS = 1024
#: ... and at most this many entries (positions plus chunks) in all: the occurrences at the
#: query's left end up to a position, the reply's later ones cut. Either cut sets
#: `truncated`. The JSON reply then stays near 3.5 MB or less (a chunk ~100 bytes with a
#: 32-byte hash and one L1 name, a position ~7), under the plugin's 4 MiB reply limit.
MAX_REPLY_ENTRIES = 32768

NonNegative = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT64)]
#: One token id as msgspec checks it (`MAX_TOKEN_ID`, the one limit).
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
TokenOffset = Annotated[int, msgspec.Meta(ge=UNKNOWN_TOKEN_OFFSET, le=MAX_TOKEN_OFFSET)]
#: The wire's hex rule as a type. Keys decode with its lengths only (`HexOfLength`) and are
#: held to the rest by `chunk_hash_of_hex` (Python's `re` took 2 µs per key), refused in
#: msgspec's words for this type (`hex_refusal`).
ChunkHashHex = Annotated[str, msgspec.Meta(min_length=2, max_length=MAX_CHUNK_HASH_HEX_CHARS,
                                           pattern=r"^(?:[0-9a-fA-F]{2})+\Z")]
HexOfLength = Annotated[str, msgspec.Meta(min_length=2, max_length=MAX_CHUNK_HASH_HEX_CHARS)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]


class WireError(Unprocessable, ValueError):
    """A request that breaks the wire contract (422). The message says which field and why.

    `detail` is the same error in FastAPI's 422 shape: `[{"type", "loc", "msg",
    "input"}]`, `loc` a path like `["body", "batches", 0, "seq"]`.
    """

    def __init__(self, message: str, *, loc: tuple = ("body",), kind: str = "value_error",
                 input: Any = None) -> None:
        super().__init__(message)
        self.loc, self.kind, self.input = loc, kind, input

    @property
    def detail(self) -> list[dict]:
        return [{"type": self.kind, "loc": list(self.loc), "msg": str(self), "input": self.input}]


def is_loopback_host(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is this machine
    only: where a bearer token may travel over plain HTTP without crossing a network.
    Both sides warn when a token would go in clear anywhere else."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_cache_salt(cache_salt: str) -> None:
    """Raise `ValueError` unless `cache_salt` follows LMCache's `ObjectKey` rules."""
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt of {len(cache_salt)} characters exceeds "
                         f"{MAX_CACHE_SALT_CHARS}")
    if not CACHE_SALT_FORBIDDEN.isdisjoint(cache_salt):
        bad = sorted(CACHE_SALT_FORBIDDEN.intersection(cache_salt))
        raise ValueError(f"cache_salt must not contain {bad!r} (got {cache_salt[:40]!r})")


def parse_salt_list(value: str) -> frozenset[str]:
    """The salts of a token file's `salts=S[,S...]` (WIRE.md, "Access control"): comma-
    separated, `""` the empty salt, each a valid cache salt. `ValueError` says why not."""
    items = value.split(",")
    if not value or not all(items):
        raise ValueError('salts= has an empty item; write the empty salt as "" (e.g. '
                         'salts="",tenant-a)')
    salts = frozenset("" if item == '""' else item for item in items)
    for salt in salts:
        check_cache_salt(salt)
        if '"' in salt:
            raise ValueError(f'salt {salt[:40]!r} holds a quote; only "" (the empty salt) is '
                             'written with quotes')
    return salts


def check_model_name(model_name: str) -> None:
    """Raise `ValueError` unless `model_name` follows LMCache's `ObjectKey` rule (no `@`)."""
    if "@" in model_name:
        raise ValueError(f"model_name must not contain '@' (got {model_name[:40]!r})")


def chunk_hash_of_hex(text: str) -> bytes | None:
    """The chunk hash `text` names on the wire, or None unless it is 2 to
    `MAX_CHUNK_HASH_HEX_CHARS` hex digits, an even number, nothing else (no whitespace, so
    `"ab cd"` and `"abcd"` cannot name one chunk twice). The one hex rule of the wire."""
    if type(text) is not str:
        raise TypeError(f"a chunk hash's hex is a str, not {type(text).__name__}")
    if not 2 <= len(text) <= MAX_CHUNK_HASH_HEX_CHARS:
        return None
    try:
        return binascii.unhexlify(text)  # ASCII hex digit pairs only (bytes.fromhex
    except ValueError:                   # skips spaces, and takes twice as long)
        return None


def hex_refusal(value: Any, field: str) -> str:
    """Why `value` is not a `ChunkHashHex`, as msgspec says it of the field `field` (the
    message of a 422, once the decoder has put the path of the field's struct after it)."""
    try:
        msgspec.convert(value, ChunkHashHex)
    except msgspec.ValidationError as exc:
        return f"{exc} - at `$.{field}`"
    raise AssertionError(f"{value!r} is a ChunkHashHex")


def check_chunk_hash_hex(text: str) -> None:
    """Raise `ValueError` unless `text` names a chunk hash (`chunk_hash_of_hex`)."""
    if chunk_hash_of_hex(text) is None:
        raise ValueError(f"chunk_hash_hex {text[:64]!r} is not valid hex: use 2 to "
                         f"{MAX_CHUNK_HASH_HEX_CHARS} hex digits, no whitespace")


class BlendNamespace(NamedTuple):
    """Who may be offered a chunk: only requesters of the namespace that stored it."""

    model_name: str
    cache_salt: str
    world_size: int


def check_lookup_namespace(namespace: BlendNamespace) -> None:
    """Raise `ValueError` unless a coordinator answers a blend lookup in `namespace`: a
    model name, a world size of at least 1 and a salt keys may carry (a 422 otherwise)."""
    if not namespace.model_name:
        raise ValueError("model_name is required when tokens_b64 is non-empty")
    if not 1 <= namespace.world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size={namespace.world_size} is outside [1, 2^32)")
    check_cache_salt(namespace.cache_salt)


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


def check_token_offset(offset: int) -> None:
    """Raise `ValueError` unless `offset` is -1 (unknown) or in `[0, MAX_TOKEN_OFFSET]`."""
    if not UNKNOWN_TOKEN_OFFSET <= offset <= MAX_TOKEN_OFFSET:
        raise ValueError(f"token_offset {offset} is invalid: use 0..2^53-1, or -1 for "
                         "unknown")

#: What the token-list kernel (blend_wire.token_kernels) says of one list; here, below both
#: the kernels and their caller (blend_wire.tokens), so neither imports the other for them.
LIST_OK, LIST_OUT_OF_RANGE, LIST_NOT_PLAIN = 0, 1, -1
