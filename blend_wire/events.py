"""Cache-event batches (`POST /events`): object keys, entries, batches; a batch's token
lists are parsed at once when it is decoded. docs/WIRE.md.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import numpy as np

from blend_wire.codec import decode, encode
from blend_wire.tokens import (NO_TOKEN_IDS, BadTokenList, decode_tokens, kernels,
                               token_ids_of, token_lists_from_json)
from blend_wire.values import (MAX_INT64, MAX_KV_RANK, MAX_NAME_CHARS, MAX_OBJECT_GROUP_ID,
                               UNKNOWN_TOKEN_OFFSET, BlendNamespace,
                               HexOfLength, Name, NonNegative, TokenOffset, check_cache_salt,
                               check_model_name, check_token_offset, chunk_hash_of_hex,
                               WireError, hex_refusal, world_size_of)


# Keys and entries are not tracked by the cyclic GC (`gc=False`: they hold no cycles): a
# batch decodes two per entry, which would bring on young-generation collections.


class EncodedObjectKey(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """A stored object's key. Checked when decoded (field constraints, naming the field)
    and, decoded or built in code, by `__post_init__` (the hex rule in msgspec's words
    for `ChunkHashHex`), so a client cannot queue a key the coordinator would refuse."""

    chunk_hash_hex: HexOfLength  # and hex digit pairs, `__post_init__` (ChunkHashHex)
    model_name: Name
    kv_rank: Annotated[int, msgspec.Meta(ge=0, le=MAX_KV_RANK)]
    object_group_id: Annotated[int, msgspec.Meta(ge=0, le=MAX_OBJECT_GROUP_ID)] = 0
    cache_salt: str = ""

    def __post_init__(self) -> None:
        # Runs for decoded keys too (where the ranges were checked already: two compares).
        if chunk_hash_of_hex(self.chunk_hash_hex) is None:
            raise ValueError(hex_refusal(self.chunk_hash_hex, "chunk_hash_hex"))
        check_model_name(self.model_name)
        if not 0 <= self.kv_rank <= MAX_KV_RANK:
            raise ValueError(f"kv_rank {self.kv_rank} is outside [0, 2^32)")
        if not 0 <= self.object_group_id <= MAX_OBJECT_GROUP_ID:
            raise ValueError(f"object_group_id {self.object_group_id} is outside [0, 2^32)")
        if self.cache_salt:
            check_cache_salt(self.cache_salt)

    @property
    def namespace(self) -> BlendNamespace:
        return BlendNamespace(self.model_name, self.cache_salt, world_size_of(self.kv_rank))


class CacheEventEntry(msgspec.Struct, kw_only=True, gc=False):
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


EventType = Literal["store", "delete", "access", "config"]
#: Where a placement lives: a server's own memory (`l1`) or a second tier (`l2`). The one
#: definition: `typing.get_args(Tier)` is the list of tiers wherever one is checked.
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
    lists = [entry.token_ids for entry in entries]
    if not all(type(token_ids) is msgspec.Raw for token_ids in lists):
        raw = [i for i, token_ids in enumerate(lists) if type(token_ids) is msgspec.Raw]
        entries = [entries[i] for i in raw]
        lists = [lists[i] for i in raw]
    else:
        raw = range(len(entries))
    if not lists:
        return
    try:
        parsed = token_lists_from_json(lists)
    except BadTokenList as exc:  # path: `$.entries[i].token_ids[j]`
        raise ValueError(str(exc).replace(" - at `$", f" - at `$.entries[{raw[exc.index]}]",
                                          1)) from None
    for entry, token_ids in zip(entries, parsed):
        entry.token_ids = token_ids


class EventsRequest(msgspec.Struct, kw_only=True):
    batches: list[CacheEventBatch]


_BATCHES_KEY = np.frombuffer(b'"batches"', dtype=np.uint8)
_ENTRIES_KEY = np.frombuffer(b'"entries"', dtype=np.uint8)
_TOKEN_IDS_KEY = np.frombuffer(b'"token_ids"', dtype=np.uint8)


def decode_batch(raw: bytes | msgspec.Raw) -> CacheEventBatch:
    """`decode(raw, CacheEventBatch)`, faster: one kernel call cuts the entries' token lists
    out of the text as it parses them (msgspec would walk each list's bytes once more to
    find its end), msgspec decodes the rest, and each entry is given its list. A batch
    whose lists are not all plain lists of uint32 ids, or that the cut text does not
    decode to, is decoded as it is (so it is refused in the same words)."""
    cut = kernels().cut_token_lists(np.frombuffer(raw, dtype=np.uint8), _ENTRIES_KEY,
                                    _TOKEN_IDS_KEY)
    if cut is not None:
        text, ids, id_ends, entry_of = cut
        try:
            batch = decode(text, CacheEventBatch)
        except WireError:
            pass
        else:
            bounds = [0, *id_ends.tolist()]
            entries = batch.entries
            for k, entry in enumerate(entry_of.tolist()):
                entries[entry].token_ids = ids[bounds[k]:bounds[k + 1]]
            return batch
    return decode(raw, CacheEventBatch)


def batches_of(body: bytes) -> list[msgspec.Raw] | None:
    """An `EventsRequest` body's batches as raw JSON (views of it, no copy), found by one
    kernel scan (several times faster than msgspec's, which checks the JSON as it goes);
    None when the body is not plainly `{"batches": [...]}`. Not a JSON check: decoding
    each batch is, and a body any batch of which fails should be decoded whole for the
    error msgspec gives the body (its JSON may be broken elsewhere)."""
    bounds = kernels().array_items(np.frombuffer(body, dtype=np.uint8), _BATCHES_KEY)
    if bounds is None:
        return None
    view = memoryview(body)
    bounds = bounds.tolist()
    return [msgspec.Raw(view[bounds[k]:bounds[k + 1]]) for k in range(0, len(bounds), 2)]


class EventsReply(msgspec.Struct, kw_only=True):
    applied: int
    duplicates: int
    stale: int


def compile_decoding() -> None:
    """Compile (or load from numba's cache) every kernel a server's decoding of `/events`
    bodies and blend queries runs, so that no request waits for a compilation (a cold
    cache takes seconds; a server calls this before it listens)."""
    entry = {"key": {"chunk_hash_hex": "ab", "model_name": "m", "kv_rank": 0},
             "token_ids": [1, 2], "token_offset": 0}
    body = encode({"batches": [{"instance_id": "i", "seq": 1, "event_type": "store",
                                "tier": "l1", "backend": "b", "entries": [entry]}]})
    for raw in batches_of(body):
        decode_batch(raw)
    decode(body, EventsRequest)  # a batch decoded whole, as the event log's replay does
    decode_tokens("AAAAAA==")
