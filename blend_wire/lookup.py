"""The blend lookup and blend score bodies and replies (`POST /directory/blend-lookup`,
`POST /directory/blend-score`): docs/WIRE.md.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from blend_wire.values import (MAX_CHUNK_HASH_HEX_CHARS, MAX_WORLD_SIZE, BlendNamespace, Name,
                               check_cache_salt, check_lookup_namespace)


class BlendQuery(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A request's tokens and namespace: the body of a blend lookup (and of a blend score,
    which adds to it)."""

    tokens_b64: str = ""
    model_name: Name = ""
    world_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_WORLD_SIZE)] = 1
    cache_salt: str = ""

    def __post_init__(self) -> None:
        # A salt nothing can be stored under would get an empty answer from LMCache; saying
        # why is kinder, and keeps one rule for salts everywhere.
        if self.tokens_b64:
            check_lookup_namespace(self.namespace)
        else:
            check_cache_salt(self.cache_salt)

    @property
    def namespace(self) -> BlendNamespace:
        return BlendNamespace(self.model_name, self.cache_salt, self.world_size)


class BlendLookupRequest(BlendQuery, kw_only=True, omit_defaults=True):
    # Ours, opt-in: answer `BlendCandidatesReply` instead. LMCache's coordinator ignores an
    # unknown field and answers its default form, which is how a client tells them apart.
    candidates: bool = False
    # Ours, opt-in beside `candidates`: the candidates as columns (`WireCandidateColumns`).
    # A coordinator of ours without that form ignores it and answers the objects form.
    columns: bool = False


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


class WireCandidateColumns(msgspec.Struct, kw_only=True, gc=False):
    """The candidates as columns (docs/WIRE.md, "The columns form"): what
    `WireFoundContent`s say, without a JSON object per content or chunk. Integer columns
    are `blend_wire.tokens.encode_uints` text (a width digit, then little-endian base64);
    contents in order, each content's positions and chunks consecutive."""

    position_counts: str  # per content: how many positions
    positions: str        # every content's positions, ascending within a content
    chunk_counts: str     # per content: how many chunks
    hash_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHUNK_HASH_HEX_CHARS // 2)]
    chunk_hashes: str     # base64 of every chunk's hash, `hash_bytes` each, concatenated
    old_st: str           # per chunk
    holder_counts: str    # per chunk: how many instances' L1 hold it
    holders: str          # those instances, as indices into `instances`, sorted by name
    instances: list[str] = msgspec.field(default_factory=list)
    shared: str = ""      # base64 bitmap: bit c % 8 (least significant first) of byte c // 8


class BlendCandidatesReply(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """The reply to a blend lookup that asked for `candidates` (docs/WIRE.md).

    A client decodes every blend-lookup reply with this shape: `candidates` and `columns`
    are None when the coordinator answered the default form (`matches`), as LMCache's
    does; `columns` is None when it answered the objects form (a coordinator of ours
    without the columns form, or a reply whose hashes differ in length)."""

    chunk_size: int | None = None
    candidates: list[WireFoundContent] | None = None
    # The columns form: set instead of `candidates` when the request asked for `columns`.
    columns: WireCandidateColumns | None = None
    matches: list[WireBlendMatch] = msgspec.field(default_factory=list)
    # False (written only then) from a coordinator whose blend lookup is off: it can find
    # nothing, and says so, so that the client can tell its operator why reuse is zero.
    blend_lookup: bool = True
    # True (written only then) when a limit cut the candidates (docs/WIRE.md, "Limits"):
    # what is listed is right, but some positions or contents were left out.
    truncated: bool = False


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
    the score a router ranks by (docs/WIRE.md, "POST /directory/blend-score")."""

    instance_id: str
    prefix_tokens: int
    l1_tokens: int
    shared_tokens: int
    peer_tokens: int
    score: float


class BlendScoreReply(msgspec.Struct, kw_only=True):
    chunk_size: int
    instances: list[InstanceScore] = msgspec.field(default_factory=list)

