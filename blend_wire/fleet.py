"""Wire shapes of what an LMCache MP server and LMCache's tools call besides events and
blend lookups (WIRE.md, "What an LMCache MP server and LMCache's tools call"): the
instance registry, the key-directory queries, stats and health.

Field names, defaults and limits are LMCache 0.5.6's (`mp_coordinator/schemas.py` and
`http_apis/*.py`). Request shapes validate themselves (a `__post_init__` states each rule
that is not a plain type or range), so `blend_wire.decode` returns a checked value or a
`WireError` naming the field. Reply shapes only describe; the coordinator fills them.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal, NamedTuple
from urllib.parse import urlsplit

import msgspec

from blend_wire.events import EncodedObjectKey, Tier
from blend_wire.values import MAX_WORLD_SIZE, Name, NonNegative, TokenId

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
OptionalPort = Annotated[int, msgspec.Meta(ge=0, le=65535)]
#: The largest chunk size the coordinator binds or is configured with (ours; LMCache
#: checks only `ge=1`). LMCache's chunk sizes are 256 by default and a few thousand tokens
#: at most (0.5.7 rounds the configured size up to a multiple of the engine's block
#: size); 65,536 leaves a 16x margin over 4,096 while the blend index's storage block
#: (16,384 chunks) stays 4 GiB of address space, mapped as written. At 10^6 it was
#: 61 GiB, and a bind failed allocating it (WIRE.md, "PUT /config/chunk-size (LMCache
#: 0.5.7)").
MAX_CHUNK_SIZE = 65_536
#: A chunk size a server binds (LMCache 0.5.7: `ge=1`), at most `MAX_CHUNK_SIZE`.
ChunkSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_CHUNK_SIZE)]


# --- /instances -------------------------------------------------------------------------

#: A `POST /instances` body larger than this is refused (413) before it is read: the
#: registry keeps every record in memory and `GET /instances` lists them all.
MAX_REGISTRATION_BODY_BYTES = 64 * 1024
#: `metadata` keys and values together, in characters (422 beyond).
MAX_METADATA_CHARS = 16 * 1024


#: The registration `metadata` key naming where the instance's engine serves its
#: OpenAI-compatible API (ours; LMCache registers the address of its own HTTP front end,
#: which does not serve completions). A router dials only the host and port it holds.
ENGINE_URL_KEY = "engine_url"
_HOST_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                        r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


class EngineAddress(NamedTuple):
    """An engine's OpenAI server: scheme, host (a name, an IPv4 address, or an IPv6 address
    without brackets) and port; `url` is the one form a router dials."""

    scheme: str
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def engine_address(url: str) -> EngineAddress:
    """`http(s)://HOST:PORT` (a trailing `/` allowed) as an `EngineAddress`; `ValueError`
    saying why for anything else: another scheme, no port, a path, a query, a fragment,
    user info, or a host that is neither a DNS name nor an IP address."""
    refusal = (f"an engine URL must be http(s)://HOST:PORT, nothing more (no path, query, "
               f"fragment or user info); got {url[:200]!r}")
    if not isinstance(url, str) or len(url) > 300 or url != url.strip() \
            or not url.isascii() or not url.isprintable():
        raise ValueError(refusal)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(refusal) from None
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or port is None or not 1 <= port <= 65535 \
            or parts.path not in ("", "/") or parts.query or parts.fragment \
            or "?" in url or "#" in url or "@" in parts.netloc:
        raise ValueError(refusal)
    if parts.netloc.startswith("["):
        try:
            if "%" in host or ipaddress.ip_address(host).version != 6:
                raise ValueError
        except ValueError:
            raise ValueError(refusal) from None
        expected = f"[{host}]:{port}"
    else:
        if not _HOST_NAME.fullmatch(host) or ":" in host:
            raise ValueError(refusal)
        expected = f"{host}:{port}"
    if parts.netloc.lower() != expected.lower():  # e.g. a port written `08080` or `+80`
        raise ValueError(refusal)
    return EngineAddress(parts.scheme, host.lower(), port)


class RegisterRequest(msgspec.Struct, kw_only=True):
    """`POST /instances`. An empty `instance_id` asks the coordinator to assign one."""

    instance_id: Name = ""
    ip: Name
    http_port: Port
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    p2p_advertised_url: Name = ""
    mq_port: OptionalPort = 0
    # LMCache 0.5.7: the server's final chunk size, bound as `PUT /config/chunk-size` is.
    chunk_size: ChunkSize | None = None

    def __post_init__(self) -> None:
        self.instance_id = self.instance_id.strip()
        self.ip = self.ip.strip()
        self.p2p_advertised_url = self.p2p_advertised_url.strip()
        if not self.ip:
            raise ValueError("ip must be a non-empty address (the coordinator calls it)")
        size = sum(len(name) + len(value) for name, value in self.metadata.items())
        if size > MAX_METADATA_CHARS:
            raise ValueError(f"metadata holds {size} characters (keys and values), more than "
                             f"{MAX_METADATA_CHARS}; keep registration hints short")
        if ENGINE_URL_KEY in self.metadata:
            engine_address(self.metadata[ENGINE_URL_KEY])


class RegisterReply(msgspec.Struct, kw_only=True):
    instance_id: str
    re_registered: bool


class HeartbeatReply(msgspec.Struct, kw_only=True):
    instance_id: str


class InstanceInfo(msgspec.Struct, kw_only=True):
    """One registered MP server as `GET /instances` lists it."""

    instance_id: str
    ip: str
    http_port: int
    registration_time: float  # epoch seconds
    metadata: dict[str, str]
    p2p_advertised_url: str
    mq_port: int


class InstancesReply(msgspec.Struct, kw_only=True):
    instances: list[InstanceInfo]


# --- /directory/lookup and /directory/keys -------------------------------------------------


class DirectoryLookupRequest(msgspec.Struct, kw_only=True):
    """`POST /directory/lookup`: exactly one of `keys` or `token_ids` (the request's whole
    sequence from position 0, with `model_name`, `world_size` and `cache_salt` naming the
    keys it resolves to)."""

    keys: list[EncodedObjectKey] = msgspec.field(default_factory=list)
    token_ids: list[TokenId] = msgspec.field(default_factory=list)
    model_name: Name = ""
    world_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_WORLD_SIZE)] = 1
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if bool(self.keys) == bool(self.token_ids):
            raise ValueError("supply exactly one of 'keys' or 'token_ids'")
        if self.token_ids and not self.model_name:
            raise ValueError("'model_name' is required with 'token_ids'")



class WirePlacement(msgspec.Struct, kw_only=True):
    """One place a key is held. A `shared` placement (a fleet-shared pool) is one per
    `(tier, backend)` fleet-wide; its `instance_id` is the latest to report it."""

    instance_id: str
    incarnation: int
    tier: Tier
    backend: str
    size_bytes: int
    shared: bool = False


class KeyPlacements(msgspec.Struct, kw_only=True):
    """One result of `/directory/lookup`: unknown keys have empty lists and 0."""

    key: EncodedObjectKey
    placements: list[WirePlacement] = msgspec.field(default_factory=list)
    token_ids: list[int] = msgspec.field(default_factory=list)
    access_count: int = 0


class DirectoryLookupReply(msgspec.Struct, kw_only=True):
    chunks: int = 0
    results: list[KeyPlacements] = msgspec.field(default_factory=list)


class DirectoryKeysQuery(msgspec.Struct, kw_only=True):
    """`GET /directory/keys` query parameters."""

    tier: Literal[Tier, "all"] = "all"
    instance_id: Name = ""
    backend: Name = ""
    offset: NonNegative = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 1000


class DirectoryKeyInfo(msgspec.Struct, kw_only=True):
    key: EncodedObjectKey
    placements: list[WirePlacement] = msgspec.field(default_factory=list)
    num_tokens: int = 0
    access_count: int = 0


class DirectoryKeysReply(msgspec.Struct, kw_only=True):
    total: int = 0
    keys: list[DirectoryKeyInfo] = msgspec.field(default_factory=list)


# --- /config/chunk-size (LMCache 0.5.7) --------------------------------------------------


class ChunkSizeBindRequest(msgspec.Struct, kw_only=True):
    """`PUT /config/chunk-size`: the final chunk size a server fleet negotiated."""

    chunk_size: ChunkSize


class ChunkSizeBindReply(msgspec.Struct, kw_only=True):
    chunk_size: int


# --- /directory/stats and /healthz ------------------------------------------------------------


class BlendIndexStats(msgspec.Struct, kw_only=True):
    num_contents: int
    num_chunks: int
    num_claims: int
    num_namespaces: int
    table_size: int


class DirectoryStats(msgspec.Struct, kw_only=True):
    """LMCache's stats fields, in LMCache's order; the coordinator adds its own after."""

    num_keys: int
    num_placements: int
    l1_keys_by_instance: dict[str, int]
    blend: BlendIndexStats
    l1_count: int
    l1_size_bytes: int
    l2_count: int
    l2_size_bytes: int


class HealthReply(msgspec.Struct, kw_only=True):
    status: str = "healthy"
