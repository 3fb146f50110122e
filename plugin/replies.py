"""Blend-lookup replies, trusted for nothing: read under a size cap, decoded, validated and
converted where they enter (the client's round-trip calls `read_capped` and `found_in`).

- `read_capped` reads the body decoded (gzip/deflate inflated here, no further than the
  cap: a small gzip bomb costs at most `max_reply_bytes`).
- `found_in` turns a reply into `FoundContent`s. The candidates form: a chunk size other
  than ours fails the reply; a content whose positions are not ascending inside the query
  is dropped; a chunk whose hash is not the wire's hex (`blend_wire.chunk_hash_of_hex`),
  whose `old_st` is outside `[0, MAX_TOKEN_OFFSET]`, or that was already named is dropped;
  an `l1` naming this instance makes the chunk `Place.THIS_SERVER`, `shared` `SHARED`.
  The default form (LMCache's): one position and one chunk each, a `cur_st + C` beyond
  the query dropped. Dropped entries are counted by the caller.
- Every failure is a `QueryFailed` saying why; `unhealthy` says whether it counts toward
  the circuit breaker (connection, timeout, 5xx: yes; a bad reply: no).
Design: docs/DESIGN.md, "Plugin"; the shapes: docs/WIRE.md.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import httpx
import numpy as np

from blend_wire import (MAX_CANDIDATE_CHUNKS, MAX_TOKEN_OFFSET, BlendCandidatesReply, WireError,
                        chunk_hash_of_hex, decode)
from plugin.lookup import columns_of
from plugin.types import FoundColumns, FoundContent, Place

THIS_SERVER, SHARED, PEER = Place.THIS_SERVER, Place.SHARED, Place.PEER
_INFLATE_WBITS = {"gzip": 31, "x-gzip": 31, "deflate": 15}


class QueryFailed(Exception):
    """One round-trip did not produce a usable reply; the message says why.

    `unhealthy`: the failure says the coordinator is down or struggling (connection error,
    timeout, 5xx) and counts toward the circuit breaker.
    """

    def __init__(self, reason: str, *, unhealthy: bool) -> None:
        super().__init__(reason)
        self.unhealthy = unhealthy


@dataclass
class Found:
    """What a reply holds that can be used, and what was dropped from it."""

    contents: FoundColumns
    default_form: bool = False  # the coordinator answered LMCache's form, not candidates
    dropped: int = 0
    first_reason: str = ""  # why the first dropped entry was dropped
    blend_lookup_off: bool = False  # the coordinator said its blend lookup is off


def read_capped(response: httpx.Response, cap: int, url: str) -> bytes:
    """The response body, decoded, refused as soon as it would exceed `cap` bytes.

    Decoded here (not by httpx) so that a compressed body is inflated no further than the
    cap: a small gzip bomb costs at most `cap` bytes and the time to inflate them."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    wbits = _INFLATE_WBITS.get(encoding)
    if wbits is None and encoding not in ("", "identity"):
        raise QueryFailed(f"reply from {url} has content-encoding {encoding!r}, which this "
                          "client does not decode", unhealthy=False)
    inflate = zlib.decompressobj(wbits) if wbits else None
    parts, size = [], 0
    try:
        for raw in response.iter_raw():
            data = raw if inflate is None else inflate.decompress(raw, cap + 1 - size)
            size += len(data)
            if size > cap or (inflate is not None and inflate.unconsumed_tail):
                raise QueryFailed(f"reply from {url} exceeds {cap} bytes (max_reply_bytes)",
                                  unhealthy=False)
            parts.append(data)
    except zlib.error as exc:
        raise QueryFailed(f"reply from {url} is not valid {encoding}: {exc}",
                          unhealthy=False) from None
    return b"".join(parts)


def found_in(content: bytes, url: str, *, chunk_size: int, instance_id: str,
             num_tokens: int) -> Found:
    """The usable part of a blend-lookup reply body (module doc), or `QueryFailed`."""
    try:
        reply = decode(content, BlendCandidatesReply)
    except WireError as exc:
        raise QueryFailed(f"reply from {url} is not a blend-lookup reply: {exc}",
                          unhealthy=False) from None
    if reply.candidates is not None:
        if reply.chunk_size != chunk_size:
            raise QueryFailed(f"{url} matches {reply.chunk_size}-token chunks, this server "
                              f"stores {chunk_size}: set both to one chunk size",
                              unhealthy=False)
        found = _candidates(reply, chunk_size, instance_id, num_tokens)
        found.blend_lookup_off = not reply.blend_lookup
        return found
    if not reply.matches and b'"matches"' not in content:
        # The shape defaults `matches` to empty; a reply without it at all is some other
        # service answering, not "nothing found".
        raise QueryFailed(f"reply from {url} has no `matches`: {content[:200]!r}",
                          unhealthy=False)
    return _matches(reply, chunk_size, num_tokens)


def _candidates(reply: BlendCandidatesReply, chunk_size: int, instance_id: str,
                num_tokens: int) -> Found:
    """The candidates form's valid entries as columns, each chunk with its place."""
    me, last = instance_id, num_tokens - chunk_size
    positions: list[int] = []
    position_start, chunk_start = [0], [0]
    hashes: list[bytes] = []
    offsets: list[int] = []
    places: list[int] = []
    seen: set[bytes] = set()
    dropped, first_reason = 0, ""
    for content in reply.candidates:
        found = content.positions
        if not (found and 0 <= found[0] and found[-1] <= last
                and all(a < b for a, b in zip(found, found[1:]))):
            dropped += 1
            first_reason = first_reason or (
                f"positions {found[:8]} are not ascending inside the "
                f"{num_tokens}-token query")
            continue
        named = len(hashes)
        for entry in content.chunks[:MAX_CANDIDATE_CHUNKS]:
            # The checks of `_why_unusable`, inline: this loop runs per chunk named.
            chunk_hash = chunk_hash_of_hex(entry.chunk_hash)
            if (chunk_hash is None or chunk_hash in seen
                    or not 0 <= entry.old_st <= MAX_TOKEN_OFFSET):
                dropped += 1
                first_reason = first_reason or _why_unusable(
                    entry.chunk_hash, chunk_hash, entry.old_st, seen)
                continue
            seen.add(chunk_hash)
            hashes.append(chunk_hash)
            offsets.append(entry.old_st)
            places.append(THIS_SERVER if me and me in entry.l1 else
                          SHARED if entry.shared else PEER)
        if len(hashes) > named:
            positions.extend(found)
            position_start.append(len(positions))
            chunk_start.append(len(hashes))
    as_int = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
    return Found(FoundColumns(as_int(position_start), as_int(positions), as_int(chunk_start),
                              as_int(offsets), hashes, as_int(places)),
                 False, dropped, first_reason)


def _matches(reply: BlendCandidatesReply, chunk_size: int, num_tokens: int) -> Found:
    """The default form's valid matches, one position and one chunk each."""
    last = num_tokens - chunk_size
    found: list[FoundContent] = []
    seen: set[bytes] = set()
    dropped, first_reason = 0, ""
    for entry in reply.matches:
        chunk_hash = chunk_hash_of_hex(entry.chunk_hash)
        reason = _why_unusable(entry.chunk_hash, chunk_hash, entry.old_st, seen) or (
            "" if 0 <= entry.cur_st <= last else
            f"cur_st={entry.cur_st} + chunk_size {chunk_size} lies outside the "
            f"{num_tokens}-token query")
        if reason:
            dropped += 1
            first_reason = first_reason or reason
            continue
        seen.add(chunk_hash)
        found.append(FoundContent((entry.cur_st,), PEER, ((chunk_hash, entry.old_st),)))
    found.sort(key=lambda content: content.positions[0])
    return Found(columns_of(found), True, dropped, first_reason)


def _why_unusable(text: str, chunk_hash: bytes | None, old_st: int, seen: set[bytes]) -> str:
    """Why a reply's chunk cannot be used (empty when it can)."""
    if chunk_hash is None:
        return f"chunk_hash {text[:40]!r} is not a chunk hash (an even number of hex digits)"
    if not 0 <= old_st <= MAX_TOKEN_OFFSET:
        return f"old_st={old_st} is outside [0, 2^53-1]"
    if chunk_hash in seen:
        return "chunk reported twice"
    return ""
