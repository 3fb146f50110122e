"""The HTTP contract between serving processes and a coordinator (docs/WIRE.md).

A neutral package: the only place the wire shapes, their defaults and limits, the token
codec and the shared value types (`BlendNamespace`, and `BlendMatch` /
`UNKNOWN_TOKEN_OFFSET` from `local_matcher.types`) are written down. The plugin's client
and reporter and the bundled coordinator all import them from here, and importing it
loads neither side: no httpx, no aiohttp (tests/test_layering.py checks both). The shapes follow LMCache's MP coordinator
(0.5.x) field for field, so either side can talk to LMCache's other side.

Decoding is validation: `decode(body, Shape)` either returns a fully checked
value or raises `WireError` whose message names the offending field, e.g.
``Expected `int` >= 1 - at `$.batches[0].seq```. Nothing partial is returned, and no
body, however hostile (nested 100k deep, numbers of 40 digits), raises anything else.
A body that breaks several rules is refused naming one of them (a batch's token lists
are checked after its other fields, all at once).

Every field has a range the coordinator can hold (the `MAX_*` constants below): an
integer out of range is refused at decoding, naming the field, never half-way through
applying a batch. Strings that become keys are checked as LMCache's `ObjectKey` checks
them (and a little stricter): `chunk_hash_hex` is non-empty, even-length hex and nothing
else (no whitespace, so `"ab cd"` and `"abcd"` cannot name one chunk twice);
`model_name` has no `@`; `cache_salt` has none of `@ / \\ NUL` and at most 128
characters (`check_cache_salt`, shared with the blend-lookup request).

A `WireError` also carries the error in FastAPI's shape (`WireError.detail`: a list of
`{"type", "loc", "msg", "input"}`), which is how LMCache's coordinator answers a 422.

Submodules, each re-exported here: `blend_wire.tokens` (the token codec: base64 for
lookups, and the JSON token lists of event entries, parsed by one GIL-free kernel call per
batch into uint32 arrays), `blend_wire.fleet` (instance registry and directory query
shapes) and `blend_wire.chunk_keys` (LMCache's prefix-chained chunk hashes and per-rank
key fan-out).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal, NamedTuple, TypeVar

import msgspec
import numpy as np

from local_matcher.types import CANDIDATE_SPARE_CHUNKS, MAX_CANDIDATE_CHUNKS, UNKNOWN_TOKEN_OFFSET

BLEND_LOOKUP_PATH = "/directory/blend-lookup"
BLEND_SCORE_PATH = "/directory/blend-score"
EVENTS_PATH = "/events"
STATS_PATH = "/directory/stats"
HEALTH_PATH = "/healthz"
DIRECTORY_LOOKUP_PATH = "/directory/lookup"
DIRECTORY_KEYS_PATH = "/directory/keys"
INSTANCES_PATH = "/instances"
METRICS_PATH = "/metrics"
CHUNK_SIZE_PATH = "/config/chunk-size"  # LMCache 0.5.7


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

NonNegative = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT64)]
TokenOffset = Annotated[int, msgspec.Meta(ge=UNKNOWN_TOKEN_OFFSET, le=MAX_TOKEN_OFFSET)]
ChunkHashHex = Annotated[str, msgspec.Meta(min_length=2, max_length=MAX_CHUNK_HASH_HEX_CHARS,
                                           pattern=r"^(?:[0-9a-fA-F]{2})+\Z")]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]


class WireError(ValueError):
    """A request that breaks the wire contract. The message says which field and why.

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


def check_model_name(model_name: str) -> None:
    """Raise `ValueError` unless `model_name` follows LMCache's `ObjectKey` rule (no `@`)."""
    if "@" in model_name:
        raise ValueError(f"model_name must not contain '@' (got {model_name[:40]!r})")


def check_chunk_hash_hex(text: str) -> None:
    """Raise `ValueError` unless `text` is non-empty, even-length hex without whitespace."""
    if not text or len(text) > MAX_CHUNK_HASH_HEX_CHARS or len(text) % 2 \
            or not _HEX.fullmatch(text):
        raise ValueError(f"chunk_hash_hex {text[:64]!r} is not valid hex: use 2 to "
                         f"{MAX_CHUNK_HASH_HEX_CHARS} hex digits, no whitespace")


_HEX = re.compile(r"[0-9a-fA-F]+")


class BlendNamespace(NamedTuple):
    """Who may be offered a chunk: only requesters of the namespace that stored it."""

    model_name: str
    cache_salt: str
    world_size: int


# --- token codec (blend_wire.tokens; it builds on WireError above) ---------------------

from blend_wire.tokens import (  # noqa: E402
    NO_TOKEN_IDS,
    BadTokenList,
    TokenIds,
    decode_tokens,
    encode_tokens,
    token_ids_of,
    token_lists_from_json,
    token_lists_to_json,
)


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


class BlendQuery(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A request's tokens and namespace: the body of a blend lookup (and of a blend score,
    which adds to it)."""

    tokens_b64: str = ""
    model_name: Name = ""
    world_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_WORLD_SIZE)] = 1
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if self.tokens_b64 and not self.model_name:
            raise ValueError("model_name is required when tokens_b64 is non-empty")
        # Nothing can be stored under such a salt, so LMCache's answer would be empty;
        # saying why is kinder, and keeps one rule for salts everywhere.
        check_cache_salt(self.cache_salt)

    @property
    def namespace(self) -> BlendNamespace:
        return BlendNamespace(self.model_name, self.cache_salt, self.world_size)


class BlendLookupRequest(BlendQuery, kw_only=True, omit_defaults=True):
    # Ours, opt-in: answer `BlendCandidatesReply` instead. LMCache's coordinator ignores an
    # unknown field and answers its default form, which is how a client tells them apart.
    candidates: bool = False


# Replies a serving process decodes on every lookup are not tracked by Python's cyclic GC
# (`gc=False`: they hold no cycles). Thousands of tracked objects per lookup push young
# objects into the old generation of a process whose heap is large (an engine's), and its
# full collections cost far more than the lookup.


class WireBlendMatch(msgspec.Struct, kw_only=True, gc=False):
    chunk_hash: str
    old_st: int
    cur_st: int


class BlendLookupReply(msgspec.Struct, kw_only=True, gc=False):
    matches: list[WireBlendMatch] = msgspec.field(default_factory=list)


class WireChunkOffer(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """A chunk holding a found content: its stored offset and where it is held (in the
    requester's namespace): the instances whose L1 has it, and whether a shared tier does."""

    chunk_hash: str
    old_st: int
    l1: tuple[str, ...] = ()
    shared: bool = False


class WireFoundContent(msgspec.Struct, kw_only=True, gc=False):
    """One content found in the query: every position it occurs at, ascending, and up to
    `min(len(positions) + CANDIDATE_SPARE_CHUNKS, MAX_CANDIDATE_CHUNKS)` chunks holding it,
    first indexed first."""

    positions: tuple[int, ...]
    chunks: list[WireChunkOffer]


class BlendCandidatesReply(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """The reply to a blend lookup that asked for `candidates` (docs/WIRE.md).

    A client decodes every blend-lookup reply with this shape: `candidates` is None when
    the coordinator answered the default form (`matches`), as LMCache's does."""

    chunk_size: int | None = None
    candidates: list[WireFoundContent] | None = None
    matches: list[WireBlendMatch] = msgspec.field(default_factory=list)


# --- POST /directory/blend-score (ours) ----------------------------------------------

#: `instance_ids` of one blend-score request at most.
MAX_SCORE_INSTANCES = 4096


class BlendScoreRequest(BlendQuery, kw_only=True, omit_defaults=True):
    """`POST /directory/blend-score`: a blend-lookup body, plus which instances to score
    (None: every registered one; an id not registered is not listed)."""

    instance_ids: Annotated[list[Name], msgspec.Meta(max_length=MAX_SCORE_INSTANCES)] | None \
        = None


class InstanceScore(msgspec.Struct, kw_only=True):
    """What one instance would reuse of the request, by where the KV is held (tokens), and
    the score a router ranks by (docs/WIRE.md, "Blend score")."""

    instance_id: str
    prefix_tokens: int
    l1_tokens: int
    shared_tokens: int
    peer_tokens: int
    score: float


class BlendScoreReply(msgspec.Struct, kw_only=True):
    chunk_size: int
    instances: list[InstanceScore] = msgspec.field(default_factory=list)


# --- POST /events --------------------------------------------------------------------


class EncodedObjectKey(msgspec.Struct, kw_only=True, frozen=True):
    """A stored object's key. Checked when decoded (field constraints, naming the field)
    and when built in code (`__post_init__`), so a client cannot queue a key the
    coordinator would refuse."""

    chunk_hash_hex: ChunkHashHex
    model_name: Name
    kv_rank: Annotated[int, msgspec.Meta(ge=0, le=MAX_KV_RANK)]
    object_group_id: Annotated[int, msgspec.Meta(ge=0, le=MAX_OBJECT_GROUP_ID)] = 0
    cache_salt: str = ""

    def __post_init__(self) -> None:
        check_chunk_hash_hex(self.chunk_hash_hex)
        check_model_name(self.model_name)
        if not 0 <= self.kv_rank <= MAX_KV_RANK:
            raise ValueError(f"kv_rank {self.kv_rank} is outside [0, 2^32)")
        if not 0 <= self.object_group_id <= MAX_OBJECT_GROUP_ID:
            raise ValueError(f"object_group_id {self.object_group_id} is outside [0, 2^32)")
        check_cache_salt(self.cache_salt)

    @property
    def namespace(self) -> BlendNamespace:
        return BlendNamespace(self.model_name, self.cache_salt, world_size_of(self.kv_rank))


class CacheEventEntry(msgspec.Struct, kw_only=True):
    key: EncodedObjectKey
    size_bytes: NonNegative = 0
    # On the wire a JSON list of any integers. Decoded as raw JSON (no Python int per
    # token), then `TokenIds`: a uint32 array, or, when an id is outside uint32 (not a
    # validation error: LMCache answers 200; the coordinator records the placement and
    # treats the content as unknown, WIRE.md), the ints as a list. Entries decoded in a
    # batch are converted by the batch, all at once; entries built in code, here.
    token_ids: msgspec.Raw = NO_TOKEN_IDS
    token_offset: TokenOffset = UNKNOWN_TOKEN_OFFSET

    def __post_init__(self) -> None:
        check_token_offset(self.token_offset)
        if type(self.token_ids) is not msgspec.Raw:
            self.token_ids = token_ids_of(self.token_ids)


def check_token_offset(offset: int) -> None:
    """Raise `ValueError` unless `offset` is -1 (unknown) or in `[0, MAX_TOKEN_OFFSET]`."""
    if not UNKNOWN_TOKEN_OFFSET <= offset <= MAX_TOKEN_OFFSET:
        raise ValueError(f"token_offset {offset} is invalid: use 0..2^53-1, or -1 for "
                         "unknown")


EventType = Literal["store", "delete", "access", "config"]
Tier = Literal["l1", "l2"]


class CacheEventBatch(msgspec.Struct, kw_only=True):
    instance_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
    incarnation: NonNegative = 0
    seq: Annotated[int, msgspec.Meta(ge=1, le=MAX_INT64)]
    event_type: EventType
    tier: Tier
    backend: Name = ""
    entries: list[CacheEventEntry] = msgspec.field(default_factory=list)
    shared: bool = False
    ts: Annotated[float, msgspec.Meta(ge=0, le=1e18)] = 0.0  # finite: epoch seconds
    capacity_bytes: NonNegative = 0
    capacity_revision: NonNegative = 0
    # LMCache 0.5.7: entries this emitter incarnation dropped before they reached the
    # coordinator, cumulative (0 from emitters that do not count them, e.g. LMCache 0.5.6).
    dropped_events: NonNegative = 0

    def __post_init__(self) -> None:
        _parse_token_lists(self.entries)
        if self.event_type in ("store", "delete", "config") and not self.backend:
            raise ValueError(f"backend must be non-empty for a {self.event_type} batch")
        if self.event_type == "config" and self.entries:
            raise ValueError("a config batch carries no entries")


def _parse_token_lists(entries: list[CacheEventEntry]) -> None:
    """The batch's token lists still raw JSON, parsed at once (one kernel call)."""
    raw = [entry for entry in entries if type(entry.token_ids) is msgspec.Raw]
    if not raw:
        return
    try:
        parsed = token_lists_from_json([entry.token_ids for entry in raw])
    except BadTokenList as exc:  # path: `$.entries[i].token_ids[j]`
        where = next(i for i, entry in enumerate(entries) if entry is raw[exc.index])
        raise ValueError(str(exc).replace(" - at `$", f" - at `$.entries[{where}]", 1)) \
            from None
    for entry, token_ids in zip(raw, parsed):
        entry.token_ids = token_ids


class EventsRequest(msgspec.Struct, kw_only=True):
    batches: list[CacheEventBatch]


class EventsReply(msgspec.Struct, kw_only=True):
    applied: int
    duplicates: int
    stale: int


# --- encoding and validated decoding ----------------------------------------------------

T = TypeVar("T")
_decoders: dict[type, msgspec.json.Decoder] = {}


def _encode_more(value: Any) -> Any:
    """What msgspec cannot encode itself: token ids held as an array."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


encode = msgspec.json.Encoder(enc_hook=_encode_more).encode


def decode(body: bytes | str, shape: type[T]) -> T:
    """Decode and validate a JSON body as `shape`, or raise `WireError` naming the field."""
    decoder = _decoders.get(shape)
    if decoder is None:
        decoder = _decoders[shape] = msgspec.json.Decoder(shape)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise _validation_error(exc, "body", body) from None
    except msgspec.DecodeError as exc:
        raise WireError(f"body is not valid JSON: {exc}", kind="json_invalid") from None
    except RecursionError:
        # msgspec skips unknown fields recursively: a value nested ~100k deep runs out of
        # stack. No wire shape nests more than a few levels, so such a body is malformed.
        raise WireError("body is nested too deeply to be any wire shape",
                        kind="json_invalid") from None


def convert_query(params: dict[str, str], shape: type[T]) -> T:
    """Validate URL query parameters as `shape` (numbers given as text are converted)."""
    try:
        return msgspec.convert(params, shape, strict=False)
    except msgspec.ValidationError as exc:
        raise _validation_error(exc, "query", params) from None


# --- validation errors in FastAPI's shape (cold path: only a rejected request gets here) ---

_AT = re.compile(r" - at `\$(.*)`$")
_NESTED_AT = re.compile(r" - at `\$([^`]*)` - at `\$([^`]*)`$")
_STEP = re.compile(r"\.([^.\[]+)|\[(-?\d+)\]|\[([^\]]*)\]")
_TYPE_NAMES = {"int": "int_type", "str": "string_type", "float": "float_type",
               "bool": "bool_type", "array": "list_type", "object": "dict_type"}


def _validation_error(exc: msgspec.ValidationError, where: str, raw: Any) -> WireError:
    # A rule that names a field inside its struct (`$.entries[2].token_ids[3]`) is reported
    # by msgspec at the struct (`... - at `$.batches[0]``): one path, outer then inner.
    message = _NESTED_AT.sub(r" - at `$\2\1`", str(exc))
    path: list = []
    at = _AT.search(message)
    if at:
        for name, index, other in _STEP.findall(at.group(1)):
            path.append(name if name else int(index) if index else other)
    missing = re.match(r"Object missing required field `([^`]+)`", message)
    if missing:
        kind = "missing"
        path.append(missing.group(1))
    elif message.startswith("Invalid enum value"):
        kind = "literal_error"
    elif re.match(r"Expected `\w+` >=", message):
        kind = "greater_than_equal"
    elif re.match(r"Expected `\w+` <=", message):
        kind = "less_than_equal"
    elif re.match(r"Expected `str` of length", message):
        kind = "string_too_short" if ">=" in message else "string_too_long"
    elif re.match(r"Expected `str` matching regex", message):
        kind = "string_pattern_mismatch"
    elif (typed := re.match(r"Expected `(\w+)`(?: \| `\w+`)*, got", message)):
        kind = _TYPE_NAMES.get(typed.group(1), "type_error")
    else:
        kind = "value_error"  # a rule of the shape (`__post_init__`)
    return WireError(message, loc=(where, *path), kind=kind,
                     input=_value_at(raw, path, missing is not None))


def _value_at(raw: Any, path: list, parent: bool) -> Any:
    """The offending value, found by walking the request again (None if not found)."""
    try:
        value = (msgspec.json.decode(raw) if isinstance(raw, (bytes, str, msgspec.Raw))
                 else raw)
        for step in path[:-1] if parent else path:
            value = value[step]
    except Exception:  # the input is illustration only: never fail the error path
        return None
    if isinstance(value, str) and len(value) > 256:
        return value[:256]
    if isinstance(value, (list, dict)) and len(value) > 16:
        return None  # FastAPI echoes it; we spare the reply a copy of a huge body
    return value


# The rest of the contract, one module per concern (imported last: they build on the above).
from blend_wire.chunk_keys import MAX_TOKEN_IDS, lookup_kv_ranks, prefix_chunk_hashes  # noqa: E402
from blend_wire.fleet import (  # noqa: E402
    BlendIndexStats,
    ChunkSizeBindReply,
    ChunkSizeBindRequest,
    DirectoryKeyInfo,
    DirectoryKeysQuery,
    DirectoryKeysReply,
    DirectoryLookupReply,
    DirectoryLookupRequest,
    DirectoryStats,
    HealthReply,
    HeartbeatReply,
    InstanceInfo,
    InstancesReply,
    KeyPlacements,
    MAX_METADATA_CHARS,
    MAX_REGISTRATION_BODY_BYTES,
    RegisterReply,
    RegisterRequest,
    WirePlacement,
)
