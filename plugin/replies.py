"""Blend-lookup replies, trusted for nothing: read under a size cap, decoded, validated and
converted where they enter (the client's round-trip calls `read_capped` and `found_in`).

- `read_capped` reads the body decoded (gzip/deflate inflated here, no further than the
  cap: a small gzip bomb costs at most `max_reply_bytes`).
- `found_in` turns a reply into `FoundContent`s. The candidates form: a chunk size other
  than ours fails the reply; a content whose positions are not ascending inside the query
  is dropped; a chunk whose hash is not the wire's hex (`blend_wire.chunk_hash_of_hex`),
  whose `old_st` is outside `[0, MAX_TOKEN_OFFSET]`, or that was already named is dropped;
  an `l1` naming this instance makes the chunk `Place.THIS_SERVER`, `shared` `SHARED`.
  The columns form: the same rules as array operations (`_columns`), and a column that is
  not its codec's text, or columns whose lengths disagree, fail the reply.
  The default form (LMCache's): one position and one chunk each, a `cur_st + C` beyond
  the query dropped. Dropped entries are counted by the caller.
- Every failure is a `QueryFailed` saying why, with its `verdict` by the plugin's one
  fail-over policy (`plugin.http.Verdict`): a bad reply is `ANSWERED` (the replica is not
  unwell: no other replica is asked, its breaker is left as it was).
Design: docs/DESIGN.md, "Plugin"; the shapes: docs/WIRE.md.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from itertools import compress

import httpx
import numpy as np

from blend_wire import (MAX_CANDIDATE_CHUNKS, MAX_TOKEN_OFFSET, BlendCandidatesReply,
                        WireCandidateColumns, WireError, chunk_hash_of_hex, decode, decode_b64,
                        decode_uints)
from plugin.http import Verdict
from plugin.lookup import columns_of
from plugin.types import FoundColumns, FoundContent, Place

THIS_SERVER, SHARED, PEER = Place.THIS_SERVER, Place.SHARED, Place.PEER
_INFLATE_WBITS = {"gzip": 31, "x-gzip": 31, "deflate": 15}


class QueryFailed(Exception):
    """One round-trip did not produce a usable reply; the message says why.

    `verdict` (`plugin.http.Verdict`): `UNAVAILABLE` says the replica is down or struggling
    (connection error, timeout, 5xx): the lookup fails over and it counts toward that
    replica's breaker; anything else is this lookup's failure alone. `retry_after`: the
    seconds the answer asked for (`Retry-After`), if any.
    """

    def __init__(self, reason: str, *, verdict: Verdict = Verdict.ANSWERED,
                 retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.verdict, self.retry_after = verdict, retry_after


@dataclass
class Found:
    """What a reply holds that can be used, and what was dropped from it."""

    contents: FoundColumns
    default_form: bool = False  # the coordinator answered LMCache's form, not candidates
    objects_form: bool = False  # it answered the candidates' objects form, not columns
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
                          "client does not decode")
    inflate = zlib.decompressobj(wbits) if wbits else None
    parts, size = [], 0
    try:
        for raw in response.iter_raw():
            data = raw if inflate is None else inflate.decompress(raw, cap + 1 - size)
            size += len(data)
            if size > cap or (inflate is not None and inflate.unconsumed_tail):
                raise QueryFailed(f"reply from {url} exceeds {cap} bytes (max_reply_bytes)")
            parts.append(data)
    except zlib.error as exc:
        raise QueryFailed(f"reply from {url} is not valid {encoding}: {exc}") from None
    return b"".join(parts)


def found_in(content: bytes, url: str, *, chunk_size: int, instance_id: str,
             num_tokens: int) -> Found:
    """The usable part of a blend-lookup reply body (module doc), or `QueryFailed`."""
    try:
        reply = decode(content, BlendCandidatesReply)
    except WireError as exc:
        raise QueryFailed(f"reply from {url} is not a blend-lookup reply: {exc}") from None
    if reply.candidates is not None or reply.columns is not None:
        if reply.chunk_size != chunk_size:
            raise QueryFailed(f"{url} matches {reply.chunk_size}-token chunks, this server "
                              f"stores {chunk_size}: set both to one chunk size")
        found = (_candidates(reply, chunk_size, instance_id, num_tokens)
                 if reply.columns is None else
                 _columns(_Columns.of(reply.columns, url), chunk_size, instance_id, num_tokens))
        found.blend_lookup_off = not reply.blend_lookup
        return found
    if not reply.matches and b'"matches"' not in content:
        # The shape defaults `matches` to empty; a reply without it at all is some other
        # service answering, not "nothing found".
        raise QueryFailed(f"reply from {url} has no `matches`: {content[:200]!r}")
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
                 False, True, dropped, first_reason)


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
    return Found(columns_of(found), True, False, dropped, first_reason)


def _why_unusable(text: str, chunk_hash: bytes | None, old_st: int, seen: set[bytes]) -> str:
    """Why a reply's chunk cannot be used (empty when it can)."""
    if chunk_hash is None:
        return f"chunk_hash {text[:40]!r} is not a chunk hash (an even number of hex digits)"
    if not 0 <= old_st <= MAX_TOKEN_OFFSET:
        return f"old_st={old_st} is outside [0, 2^53-1]"
    if chunk_hash in seen:
        return "chunk reported twice"
    return ""


# --- the columns form ------------------------------------------------------------------------


@dataclass
class _Columns:
    """A columns-form reply decoded, its lengths consistent (`of`); per content and per
    chunk, as WIRE.md lists them (counts as int64, the rest as sent)."""

    position_counts: np.ndarray
    positions: np.ndarray
    chunk_counts: np.ndarray
    hashes: np.ndarray  # one void value of `hash_bytes` per chunk
    old_st: np.ndarray
    holder_counts: np.ndarray
    holders: np.ndarray
    instances: list[str]
    shared: np.ndarray  # bool per chunk

    @classmethod
    def of(cls, wire: WireCandidateColumns, url: str) -> "_Columns":
        """The columns decoded, or `QueryFailed` when one is not its codec's text or their
        lengths disagree (the whole reply fails: nothing in it can be placed)."""
        try:
            counts = [decode_uints(getattr(wire, name), name) for name in (
                "position_counts", "chunk_counts", "holder_counts")]
            positions = decode_uints(wire.positions, "positions")
            raw = decode_b64(wire.chunk_hashes, "chunk_hashes")
            old_st = decode_uints(wire.old_st, "old_st")
            holders = decode_uints(wire.holders, "holders")
            shared = decode_b64(wire.shared, "shared")
        except WireError as exc:
            raise QueryFailed(f"reply from {url} has a bad column: {exc}") from None
        chunks = raw.size // wire.hash_bytes
        # Counts summed as floats: a sum of huge counts cannot wrap round to a small
        # length (a sum of unsigned ints could), and below 2^53 it is exact.
        sizes = (positions.size, chunks, holders.size)
        if (raw.size % wire.hash_bytes or counts[0].size != counts[1].size
                or counts[2].size != chunks or old_st.size != chunks
                or shared.size != (chunks + 7) // 8
                or any(c.sum(dtype=np.float64) != n for c, n in zip(counts, sizes))
                or (holders.size and int(holders.max()) >= len(wire.instances))):
            raise QueryFailed(f"reply from {url} has columns of inconsistent lengths")
        return cls(counts[0].astype(np.int64), positions, counts[1].astype(np.int64),
                   raw.view(f"V{wire.hash_bytes}"), old_st, counts[2].astype(np.int64),
                   holders, wire.instances,
                   np.unpackbits(shared, count=chunks, bitorder="little").view(bool))


def _columns(reply: _Columns, chunk_size: int, instance_id: str, num_tokens: int) -> Found:
    """The columns form's valid entries, dropped exactly as `_candidates` drops them, with
    array operations (no Python per content or chunk)."""
    contents = reply.position_counts.size
    position_start = np.zeros(contents + 1, dtype=np.int64)
    np.cumsum(reply.position_counts, out=position_start[1:])
    chunk_start = np.zeros(contents + 1, dtype=np.int64)
    np.cumsum(reply.chunk_counts, out=chunk_start[1:])
    every_hash = reply.hashes.tolist()
    if (_all_valid(reply, position_start, num_tokens - chunk_size)
            and _all_usable(reply, every_hash)):  # a reply of ours: the usual
        return Found(FoundColumns(position_start, reply.positions.astype(np.int64),
                                  chunk_start, reply.old_st.astype(np.int64), every_hash,
                                  _places(reply, instance_id)))
    return _dropping(reply, chunk_size, instance_id, num_tokens, chunk_start, every_hash)


def _all_valid(reply: _Columns, position_start: np.ndarray, last: int) -> bool:
    """Whether no content is dropped: each has positions, none beyond `last` (the values
    are unsigned), rising within the content."""
    counts, positions = reply.position_counts, reply.positions
    if not positions.size or not counts.all():
        return not counts.size
    if int(positions.max()) > last:
        return False
    rising = positions[1:] > positions[:-1]
    rising[position_start[1:-1] - 1] = True  # a content may start below the last one's end
    return bool(rising.all())


def _dropping(reply: _Columns, chunk_size: int, instance_id: str, num_tokens: int,
              chunk_start: np.ndarray, every_hash: list[bytes]) -> Found:
    """`_columns` of a reply with something to drop (from a coordinator not of ours)."""
    contents, chunks = reply.position_counts.size, reply.hashes.size
    of_position = np.repeat(np.arange(contents), reply.position_counts)
    positions = reply.positions.astype(np.int64)  # past 2^63 wraps negative: out of range
    bad_content = reply.position_counts == 0
    bad_content[of_position[(positions < 0) | (positions > num_tokens - chunk_size)]] = True
    descends = (positions[1:] <= positions[:-1]) & (of_position[1:] == of_position[:-1])
    bad_content[of_position[1:][descends]] = True
    of_chunk = np.repeat(np.arange(contents), reply.chunk_counts)
    read = ~bad_content[of_chunk] & (np.arange(chunks) - chunk_start[of_chunk]
                                      < MAX_CANDIDATE_CHUNKS)
    bad_offset = read & (reply.old_st > MAX_TOKEN_OFFSET)
    usable = np.flatnonzero(read & ~bad_offset)
    hashes = list(map(every_hash.__getitem__, usable.tolist()))
    twice = _named_before(hashes)
    twice_at = usable[twice]  # chunks named again, by their index in the reply
    if twice.size:
        keep = np.ones(usable.size, dtype=bool)
        keep[twice] = False
        usable, hashes = usable[keep], list(compress(hashes, keep.tolist()))
    dropped = int(bad_content.sum() + bad_offset.sum() + twice.size)
    reason = (_first_reason(reply, positions, of_chunk, bad_content, bad_offset, twice_at,
                            num_tokens) if dropped else "")
    kept_per_content = np.bincount(of_chunk[usable], minlength=contents)
    content_kept = kept_per_content > 0
    position_start = np.zeros(int(content_kept.sum()) + 1, dtype=np.int64)
    np.cumsum(reply.position_counts[content_kept], out=position_start[1:])
    kept_start = np.zeros(position_start.size, dtype=np.int64)
    np.cumsum(kept_per_content[content_kept], out=kept_start[1:])
    return Found(FoundColumns(position_start, positions[content_kept[of_position]], kept_start,
                              reply.old_st[usable].astype(np.int64), hashes,
                              _places(reply, instance_id)[usable]),
                 False, False, dropped, reason)


def _all_usable(reply: _Columns, hashes: list[bytes]) -> bool:
    """Whether every chunk of a reply whose contents are all valid is kept: none past a
    content's first 64, no offset out of range, no hash twice (one set of `hashes`)."""
    return not hashes or (int(reply.chunk_counts.max()) <= MAX_CANDIDATE_CHUNKS
                          and int(reply.old_st.max()) <= MAX_TOKEN_OFFSET
                          and len(set(hashes)) == len(hashes))


def _named_before(hashes: list[bytes]) -> np.ndarray:
    """The indices of hashes an earlier one equals (none, nearly always: one set)."""
    if len(set(hashes)) == len(hashes):
        return np.zeros(0, dtype=np.int64)
    count = len(hashes)
    first = dict(zip(reversed(hashes), range(count - 1, -1, -1)))  # the earliest wins
    firsts = np.fromiter(map(first.__getitem__, hashes), dtype=np.int64, count=count)
    return np.flatnonzero(firsts != np.arange(count))


def _first_reason(reply: _Columns, positions: np.ndarray, of_chunk: np.ndarray,
                  bad_content: np.ndarray, bad_offset: np.ndarray, twice_at: np.ndarray,
                  num_tokens: int) -> str:
    """Why the first dropped entry, in reply order, was dropped (as `_candidates` says)."""
    bad_chunks = np.concatenate([np.flatnonzero(bad_offset), twice_at])
    chunk = int(bad_chunks.min()) if bad_chunks.size else -1
    content = int(np.argmax(bad_content)) if bad_content.any() else -1
    if content >= 0 and (chunk < 0 or content < of_chunk[chunk]):
        start = int(reply.position_counts[:content].sum())
        shown = tuple(positions[start:start + min(8, int(reply.position_counts[content]))]
                      .tolist())
        return f"positions {shown} are not ascending inside the {num_tokens}-token query"
    if bad_offset[chunk]:
        return f"old_st={int(reply.old_st[chunk])} is outside [0, 2^53-1]"
    return "chunk reported twice"


def _places(reply: _Columns, instance_id: str) -> np.ndarray:
    """Each chunk's `Place`: this server's L1 when its holders name `instance_id`, else a
    shared tier when `shared`, else a peer."""
    places = np.where(reply.shared, np.int64(SHARED), np.int64(PEER))
    me = [k for k, name in enumerate(reply.instances) if name == instance_id]  # per instance
    if instance_id and me:
        mine = reply.holders == me[0]
        for also in me[1:]:  # the same id twice: only from a coordinator not of ours
            mine |= reply.holders == also
        holder_chunk = np.repeat(np.arange(reply.hashes.size), reply.holder_counts)
        places[holder_chunk[mine]] = int(THIS_SERVER)
    return places
