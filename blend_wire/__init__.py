"""The HTTP contract between serving processes and a coordinator (docs/WIRE.md).

A neutral package: the only place the wire shapes, their defaults and limits, the token
codec and the shared value types are written down. The plugin's client and reporter, the
bundled coordinator and the local matcher import them from here; importing it loads none
of them, nor httpx, aiohttp or numba (tests/test_layering.py). The shapes follow LMCache's
MP coordinator (0.5.x) field for field, so either side can talk to LMCache's other side.

Decoding is validation: `decode(body, Shape)` returns a fully checked value or raises
`WireError` naming the offending field (and `WireError.detail`, FastAPI's 422 shape);
nothing partial is returned, and no body, however hostile, raises anything else.

Submodules, their public names gathered here: `errors` (`Refusal` and its subclasses, one
per status: what either server answers a request it refuses), `values` (`WireError`,
ranges, key-string rules, `BlendNamespace`, kv_rank), `paths`, `tokens` (the token codec,
`as_tokens`), `lookup` (blend lookup and score), `events` (`POST /events`), `fleet`
(instance registry and directory queries), `chunk_keys` (LMCache's chunk hashes) and `codec`
(`encode`, `decode`, `convert_query`); `version` (the project's installed version, for
`--version`) is imported from its module.
"""

from __future__ import annotations

from blend_wire.chunk_keys import MAX_TOKEN_IDS, lookup_kv_ranks, prefix_chunk_hashes
from blend_wire.codec import convert_query, decode, encode
from blend_wire.errors import (RETRY_AFTER_S, BadRequest, Conflict, Forbidden, Refusal,
                               RequestTimeout, ServiceUnavailable, ShuttingDown, TooLarge,
                               TooManyRequests, Unauthorized, Unprocessable)
from blend_wire.events import (CacheEventBatch, CacheEventEntry, EncodedObjectKey, EventsReply,
                               EventsRequest, EventType, Tier, batches_of, compile_decoding,
                               decode_batch)
from blend_wire.fleet import (ENGINE_URL_KEY, MAX_CHUNK_SIZE, MAX_METADATA_CHARS,
                              MAX_REGISTRATION_BODY_BYTES, BlendIndexStats, EngineAddress,
                              engine_address,
                              ChunkSizeBindReply, ChunkSizeBindRequest, DirectoryKeyInfo,
                              DirectoryKeysQuery, DirectoryKeysReply, DirectoryLookupReply,
                              DirectoryLookupRequest, DirectoryStats, HealthReply,
                              HeartbeatReply, InstanceInfo, InstancesReply, KeyPlacements,
                              RegisterReply, RegisterRequest, WirePlacement)
from blend_wire.lookup import (MAX_SCORE_INSTANCES, BlendCandidatesReply, BlendLookupReply,
                               BlendLookupRequest, BlendQuery, BlendScoreReply,
                               BlendScoreRequest, InstanceScore, WireBlendMatch,
                               WireCandidateColumns, WireChunkOffer, WireFoundContent)
from blend_wire.paths import (BLEND_LOOKUP_PATH, BLEND_SCORE_PATH, CHUNK_SIZE_PATH,
                              DIRECTORY_KEYS_PATH, DIRECTORY_LOOKUP_PATH, EVENTS_PATH,
                              HEALTH_PATH, INSTANCES_PATH, METRICS_PATH, STATS_PATH)
from blend_wire.tokens import (NO_TOKEN_IDS, BadTokenList, TokenIds, as_tokens, decode_b64,
                               decode_tokens, decode_uints, encode_b64, encode_tokens,
                               encode_uints, token_ids_of, token_lists_from_json,
                               token_lists_to_json, uints_in)
from blend_wire.values import (CACHE_SALT_FORBIDDEN, CANDIDATE_SPARE_CHUNKS,
                               MAX_CACHE_SALT_CHARS, MAX_CANDIDATE_CHUNKS,
                               MAX_CANDIDATE_POSITIONS, MAX_REPLY_ENTRIES,
                               MAX_CHUNK_HASH_HEX_CHARS, MAX_INT64, MAX_KV_RANK, MAX_NAME_CHARS,
                               MAX_OBJECT_GROUP_ID, MAX_TOKEN_ID, MAX_TOKEN_OFFSET,
                               MAX_WORLD_SIZE, UNKNOWN_TOKEN_OFFSET, BlendNamespace,
                               ChunkHashHex, HexOfLength, Name, NonNegative, TokenOffset,
                               WireError, check_cache_salt, check_chunk_hash_hex, parse_salt_list,
                               check_lookup_namespace, check_model_name, chunk_hash_of_hex,
                               hex_refusal,
                               check_token_offset, is_loopback_host, pack_kv_rank,
                               world_size_of)
