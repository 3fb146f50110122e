"""Cache-event reporter: the server's stores and evictions, as `POST /events` batches.

Contract:
- `report_store` / `report_delete` only append to an in-memory queue (the store path never
  waits on the network, nor on batch building: batches are built outside the queue's lock); a
  task on the executor (the caller's, e.g. `BlendPlugin`'s, or one this reporter owns) flushes
  every `flush_interval`, and `close()` flushes once more.
- Input comes converted from the edge (`BlendPlugin`): a `BlendNamespace`, `bytes` chunk
  hashes (DESIGN.md: opaque bytes, hex on the wire), `uint32` token arrays. Each event's wire
  key is built when it is queued, so a hash that cannot be written as hex or a namespace that
  does not fit the wire raises `TypeError`/`WireError` to that caller and never reaches batch
  building, where it would take the whole queue down with it. Token chunks are copied when
  queued: the caller may reuse its buffer at once.
- Every POST goes through the plugin's one HTTP policy (plugin.http): its `timeout` (the
  config's `event_timeout`, not the lookup budget: delivery is background work) bounds the
  whole round-trip, so a coordinator trickling bytes cannot hold `flush()` or `close()`.
- STORE entries carry each chunk's `token_ids` and `token_offset`; DELETE entries carry keys.
  A flush writes the token lists of the batches it forms in one kernel call
  (`token_lists_to_json`): the body's bytes are those of the arrays, no Python int per token.
  Keys come from the namespace: `kv_rank` packs the world size in its top byte.
- Every event has a tier and a backend: the reporter's own unless the call names others (a
  tier-aware host reports L1 and L2 placements separately). Consecutive events of one
  `(type, tier, backend)` share a batch.
- Batches are numbered `seq = 1, 2, ...` per `(instance_id, incarnation)`. The incarnation
  defaults to the start time in nanoseconds, so a new reporter for the same `instance_id`
  outranks the previous one and the coordinator fences its placements.
- A seq is given to a batch once; a failed POST is retried later with the same batches in the
  same order (a retry of something that did land is then a harmless duplicate), and events
  reported meanwhile queue behind them.
- The queue is bounded (`max_events` entries, formed batches included): when it is full the
  oldest events are dropped first and counted in `stats().dropped_events`, which every batch
  built afterwards carries as its cumulative `dropped_events` (LMCache 0.5.7's field: the
  coordinator counts the rises per emitter).
- Several coordinator URLs (replicas sharing one event log, comma-separated): events go
  to one at a time, by the plugin's one fail-over policy (`plugin.http`): an `UNAVAILABLE`
  answer (a connection error, a timeout, any 5xx, 503 included since issue 34) sends the
  same body on to the next replica at once (a replica that appended it before failing
  makes the copy a duplicate, which the gate drops). One URL behaves as before.
- A permanent refusal (`plugin.http.PERMANENT_STATUSES`: 400, 403, 409, 413, 422) can never
  succeed at any replica, so it must not wedge the queue: the batches of the refused post
  are sent one by one, a refused one is dropped and counted, the others delivered in order.
  A 403 (outside the token's scope, issue 32) counts under `forbidden_batches`,
  `forbidden_events` and is logged once, then at debug; any other under
  `rejected_batches`, logged as an error. (Before issue 34 a 422 dropped every batch of
  its post and a 413 was retried for ever.)
- A coordinator that sheds load is honoured: a replica whose unavailable answer (a 503)
  carries `Retry-After` is benched that long (seconds, capped at
  `plugin.http.MAX_RETRY_AFTER_S`) and the body goes to the next replica; a 429 pauses
  every replica until its `Retry-After` (1 s when absent or unreadable). With every replica
  benched a flush sends nothing and counts no failure; the events stay queued, in order.
  `stats().throttled` counts the answers whose `Retry-After` was honoured.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Literal, NamedTuple, Sequence, get_args

import httpx
import numpy as np

from blend_wire import (EVENTS_PATH, NO_TOKEN_IDS, UNKNOWN_TOKEN_OFFSET, BlendNamespace,
                        CacheEventBatch, CacheEventEntry, EncodedObjectKey, EventsReply,
                        EventsRequest, Tier, TokenIds, WireError, check_token_offset, decode,
                        encode, pack_kv_rank, token_ids_of, token_lists_to_json)
from plugin.config import DEFAULT_EVENT_TIMEOUT_S, PluginConfig, coordinator_url_list
from plugin.http import Replicas, Verdict, coordinator_http
from plugin.workers import DaemonPool

log = logging.getLogger(__name__)
_JSON = {"content-type": "application/json"}


@dataclass
class ReporterStats:
    """Counters since start (events unless named batches), plus `pending` at the time."""

    enqueued: int = 0
    dropped_events: int = 0
    dropped_after_close: int = 0
    sent_batches: int = 0
    failed_flushes: int = 0
    throttled: int = 0      # answers with a Retry-After (503, 429): honoured (plugin.http)
    rejected_batches: int = 0   # refused for good (422, 400, 413...): dropped
    forbidden_batches: int = 0  # 403: outside the token's scope, dropped (never sendable)
    forbidden_events: int = 0   # their entries
    applied: int = 0       # batches, as the coordinator counted them
    duplicates: int = 0
    stale: int = 0
    pending: int = 0
    incarnation: int = 0

_incarnation_lock = threading.Lock()
_last_incarnation = 0


def next_incarnation() -> int:
    """A start-time incarnation, strictly increasing within this process too."""
    global _last_incarnation
    with _incarnation_lock:
        _last_incarnation = max(time.time_ns(), _last_incarnation + 1)
        return _last_incarnation


class _Event(NamedTuple):
    event_type: Literal["store", "delete"]
    key: EncodedObjectKey
    tokens: TokenIds | None  # a private copy, never the caller's buffer
    offset: int
    size_bytes: int
    tier: Tier
    backend: str


def encode_key(namespace: BlendNamespace, chunk_hash: bytes) -> EncodedObjectKey:
    """The wire key of a chunk stored in `namespace` (world size in kv_rank's top byte).

    Raises `TypeError` for a hash that has no hex form, `ValueError` for one whose hex form
    is not hex (the wire key checks it), and `WireError` for a world size that does not fit
    kv_rank's byte.
    """
    try:
        hex_hash = chunk_hash.hex()
    except AttributeError:
        raise TypeError(f"chunk_hash must be bytes (hex on the wire), not "
                        f"{type(chunk_hash).__name__}") from None
    return EncodedObjectKey(chunk_hash_hex=hex_hash, model_name=namespace.model_name,
                            kv_rank=pack_kv_rank(namespace.world_size),
                            cache_salt=namespace.cache_salt)


class CacheEventReporter:
    """Queues cache events and delivers them in order in the background
    (module doc)."""

    def __init__(self, base_url: str | Sequence[str], *, instance_id: str, incarnation: int | None = None,
                 flush_interval: float = 1.0, timeout: float = DEFAULT_EVENT_TIMEOUT_S,
                 max_events: int = 100_000,
                 tier: str = "l1", backend: str = "dram", max_entries_per_batch: int = 1024,
                 max_entries_per_post: int = 4096, executor: Executor | None = None,
                 start: bool = True, token: str | None = None,
                 ca_file: str | None = None, breaker_threshold: int = 3,
                 breaker_cooldown_s: float = 5.0) -> None:
        if not instance_id:
            raise ValueError("instance_id must be non-empty")
        urls = coordinator_url_list(base_url)
        if not urls:
            raise ValueError("at least one coordinator URL is needed")
        self.instance_id = instance_id
        self.incarnation = next_incarnation() if incarnation is None else incarnation
        self.flush_interval = flush_interval
        self.max_events = max_events
        self.tier, self.backend = tier, backend
        self.max_entries_per_batch = max_entries_per_batch
        self.max_entries_per_post = max_entries_per_post
        # Events go to one replica at a time (they share one event log) and on to the next
        # when it is unavailable, by the plugin's one fail-over policy.
        self._replicas = Replicas(
            urls, lambda url: coordinator_http(url, timeout=timeout, token=token,
                                               ca_file=ca_file),
            breaker_threshold=breaker_threshold, breaker_cooldown_s=breaker_cooldown_s)
        self._lock = threading.Lock()         # guards the queue, the outbox and the stats
        self._flush_lock = threading.Lock()   # one flush at a time keeps the order
        self._events: collections.deque[_Event] = collections.deque()
        # Events taken off the queue by a flush and being built into batches outside the
        # lock; still counted against the bound, and the oldest of them drop first.
        self._building = 0
        self._building_dropped = 0
        self._outbox: list[CacheEventBatch] = []  # formed, numbered, not yet acknowledged
        self._outbox_entries = 0
        self._seq = itertools.count(1)
        self._stats = ReporterStats(incarnation=self.incarnation)
        self._failing = False
        self._forbidden_said = False  # a 403 is logged once, then counted
        self._closed = False
        self._stop = threading.Event()
        self._owns_executor = executor is None and start
        if self._owns_executor:
            # A daemon thread: its flush loop ends only on close(), and must not keep the
            # process alive without it.
            executor = DaemonPool(1, thread_name_prefix="blend-events")
        self._executor = executor
        self._flusher: Future | None = executor.submit(self._run) if start else None

    @classmethod
    def from_config(cls, config: PluginConfig, *,
                    executor: Executor | None = None) -> "CacheEventReporter":
        """The reporter `config` describes: its URLs, identity, deadline, bounds, default tier
        and credentials (one place, so every caller sends the token and trusts the CA)."""
        return cls(config.coordinator_urls, instance_id=config.instance_id,
                   incarnation=config.incarnation, flush_interval=config.event_flush_interval,
                   timeout=config.event_timeout, max_events=config.event_queue_limit,
                   tier=config.event_tier, backend=config.event_backend, executor=executor,
                   token=config.coordinator_token, ca_file=config.coordinator_ca_file,
                   breaker_threshold=config.breaker_threshold,
                   breaker_cooldown_s=config.breaker_cooldown_s)

    @property
    def base_url(self) -> str:
        """The coordinator replica events go to now."""
        return self._replicas.url

    # --- the store path: enqueue only ----------------------------------------------------------

    def report_store(self, namespace: BlendNamespace, chunk_hashes: Sequence[bytes],
                     token_chunks: Sequence[np.ndarray | None], offsets: Sequence[int],
                     size_bytes: int = 0, *, tier: str | None = None,
                     backend: str | None = None) -> None:
        """Queue one STORE per chunk: its tokens and the position of its first token.

        The tokens are copied (the caller may reuse its buffer). A hash with no hex form
        raises `TypeError` (an empty one, a bad offset, tier or backend, tokens that are
        not integers, `ValueError`) and nothing of this call is queued. `tier`/`backend`
        default to the reporter's.
        """
        tier, backend = self._placement(tier, backend)
        if not len(chunk_hashes) == len(token_chunks) == len(offsets):
            raise ValueError("chunk_hashes, token_chunks and offsets must have the same length")
        events = []
        for chunk_hash, tokens, offset in zip(chunk_hashes, token_chunks, offsets):
            offset = UNKNOWN_TOKEN_OFFSET if offset is None else int(offset)
            check_token_offset(offset)  # checked here: batch building must not fail
            if tokens is not None:
                tokens = token_ids_of(tokens).copy()  # as the wire takes them, and ours
            events.append(_Event("store", encode_key(namespace, chunk_hash), tokens, offset,
                                 size_bytes, tier, backend))
        self._enqueue(events)

    def report_delete(self, namespace: BlendNamespace, chunk_hashes: Sequence[bytes], *,
                      tier: str | None = None, backend: str | None = None) -> None:
        """Queue one DELETE per chunk. A hash with no hex form raises `TypeError` (a bad tier
        or backend, `ValueError`) and nothing of this call is queued. `tier`/`backend` default
        to the reporter's."""
        tier, backend = self._placement(tier, backend)
        self._enqueue([_Event("delete", encode_key(namespace, h), None, UNKNOWN_TOKEN_OFFSET, 0,
                              tier, backend)
                       for h in chunk_hashes])

    def _placement(self, tier: str | None, backend: str | None) -> tuple[str, str]:
        # Checked here, where the caller can be told; batch building must not fail.
        tier = self.tier if tier is None else tier
        backend = self.backend if backend is None else backend
        if tier not in get_args(Tier):
            raise ValueError(f"tier={tier!r} must be one of {get_args(Tier)}")
        if not backend:
            raise ValueError("backend must be non-empty (e.g. 'dram')")
        return tier, backend

    def _enqueue(self, events: list[_Event]) -> None:
        with self._lock:
            if self._closed:
                self._stats.dropped_after_close += len(events)
                return
            self._events.extend(events)
            self._stats.enqueued += len(events)
            overflow = self._pending_locked() - self.max_events
            if overflow > 0:
                self._drop_oldest_locked(overflow)

    def _pending_locked(self) -> int:
        return len(self._events) + self._outbox_entries + self._building - self._building_dropped

    def _drop_oldest_locked(self, count: int) -> None:
        # The oldest events are the ones already formed into batches, then those being built,
        # then the queue's head.
        dropped = 0
        while dropped < count and self._outbox:
            batch = self._outbox[0]
            take = min(count - dropped, len(batch.entries))
            del batch.entries[:take]
            self._outbox_entries -= take
            dropped += take
            if not batch.entries:
                self._outbox.pop(0)  # its seq is skipped; gaps are fine, order is kept
        if dropped < count and self._building > self._building_dropped:
            # The flush building them skips this many from their head when it is done.
            take = min(count - dropped, self._building - self._building_dropped)
            self._building_dropped += take
            dropped += take
        while dropped < count and self._events:
            self._events.popleft()
            dropped += 1
        self._stats.dropped_events += dropped

    # --- delivery --------------------------------------------------------------------------------

    def flush(self) -> bool:
        """One delivery attempt of everything queued; True when nothing is left undelivered."""
        with self._flush_lock:
            self._form_batches()
            while True:
                with self._lock:
                    to_send, entries = [], 0
                    for batch in self._outbox:
                        if to_send and entries + len(batch.entries) > self.max_entries_per_post:
                            break
                        to_send.append(batch)
                        entries += len(batch.entries)
                if not to_send:
                    return True
                if not self._post(to_send):
                    return False

    def _form_batches(self) -> None:
        # Called under _flush_lock only, so one build runs at a time and seqs stay in order.
        # The queue is swapped out under _lock and the entries are built outside it: building
        # thousands of entries must not stall the store path, which only needs _lock to append.
        with self._lock:
            events, self._events = self._events, collections.deque()
            self._building, self._building_dropped = len(events), 0
        built = []
        try:
            built = [((e.event_type, e.tier, e.backend), self._entry(e)) for e in events]
            _encode_token_lists([entry for (kind, _, _), entry in built if kind == "store"])
        finally:
            with self._lock:
                built = built[self._building_dropped:]  # overflowed meanwhile: the oldest go
                self._building = self._building_dropped = 0
                self._outbox.extend(self._batches(built))
                self._outbox_entries += len(built)

    def _batches(self, built: list[tuple[tuple[str, str, str], CacheEventEntry]]
                 ) -> list[CacheEventBatch]:
        # Cheap (one struct per batch), so it may run under _lock.
        now = time.time()
        batches = []
        # Consecutive events of one (type, tier, backend) share a batch; a change starts a new
        # one, so a store and a later delete of the same chunk keep their order.
        for (event_type, tier, backend), run in itertools.groupby(built, key=lambda b: b[0]):
            entries = [entry for _, entry in run]
            for start in range(0, len(entries), self.max_entries_per_batch):
                batch = CacheEventBatch(
                    instance_id=self.instance_id, incarnation=self.incarnation,
                    seq=next(self._seq), event_type=event_type, tier=tier,
                    backend=backend, ts=now, dropped_events=self._stats.dropped_events)
                # Given after construction, which would parse their encoded token lists.
                batch.entries = entries[start:start + self.max_entries_per_batch]
                batches.append(batch)
        return batches

    @staticmethod
    def _entry(event: _Event) -> CacheEventEntry:
        if event.event_type == "delete":
            return CacheEventEntry(key=event.key)
        tokens = NO_TOKEN_IDS if event.tokens is None else event.tokens
        return CacheEventEntry(key=event.key, size_bytes=event.size_bytes, token_ids=tokens,
                               token_offset=event.offset)

    def _post(self, batches: list[CacheEventBatch]) -> bool:
        sent = self._replicas.request("POST", EVENTS_PATH,
                                      content=encode(EventsRequest(batches=batches)),
                                      headers=_JSON)
        if sent.retry_after:
            with self._lock:
                self._stats.throttled += 1
        response = sent.response
        if response is None:
            # Every replica unavailable; or every one benched (a Retry-After, an outage)
            # and none asked: the events stay queued, in order, and nothing is counted.
            return self._failed(sent.failure) if sent.tried else False
        if sent.verdict is Verdict.PERMANENT:
            return self._refused(batches, response)
        if response.status_code != 200:  # 429 (every replica paused), 401, 404...
            return self._failed(f"HTTP {response.status_code}: {response.text[:200]!r}")
        self._remove_sent(batches)
        try:
            reply: EventsReply | None = decode(response.content, EventsReply)
        except WireError:
            reply = None
            log.debug("events reply is not {applied, duplicates, stale}: %r", response.text[:200])
        with self._lock:
            self._stats.sent_batches += len(batches)
            if reply is not None:
                self._stats.applied += reply.applied
                self._stats.duplicates += reply.duplicates
                self._stats.stale += reply.stale
            if self._failing:
                log.info("coordinator at %s accepts events again", self.base_url)
            self._failing = False
        return True

    def _refused(self, batches: list[CacheEventBatch], response: httpx.Response) -> bool:
        """A permanent refusal (`plugin.http.PERMANENT_STATUSES`: invalid, too large, outside
        the token's scope): no replica will ever take these batches as they are, so it is no
        outage, and they must not wedge the queue. Which one: each batch is sent on its
        own; a refused batch is dropped and counted, the others delivered (in order). A
        403 (the token may not send it: an instance or salt outside its scope) counts
        under `forbidden_*` and is logged once; any other under `rejected_batches`."""
        if len(batches) > 1:
            return all(self._post([batch]) for batch in batches)
        self._remove_sent(batches)
        if response.status_code != 403:
            with self._lock:
                self._stats.rejected_batches += 1
            log.error("coordinator at %s rejected a cache-event batch of %d event(s) with HTTP "
                      "%d and it was dropped: %s", self.base_url, len(batches[0].entries),
                      response.status_code, response.text[:300])
            return True
        with self._lock:
            self._stats.forbidden_batches += 1
            self._stats.forbidden_events += len(batches[0].entries)
            first, self._forbidden_said = not self._forbidden_said, True
        (log.error if first else log.debug)(
            "coordinator at %s refused a cache-event batch of %d event(s) with HTTP 403: "
            "this token may not send it (its scope), so it was dropped; later refusals "
            "are only counted (forbidden_batches): %s", self.base_url,
            len(batches[0].entries), response.text[:300])
        return True

    def _remove_sent(self, batches: list[CacheEventBatch]) -> None:
        sent = {id(b) for b in batches}
        with self._lock:
            kept = [b for b in self._outbox if id(b) not in sent]
            self._outbox_entries = sum(len(b.entries) for b in kept)
            self._outbox = kept

    def _failed(self, reason: str) -> bool:
        with self._lock:
            self._stats.failed_flushes += 1
            first = not self._failing
            self._failing = True
            pending = self._pending_locked()
        # One warning per outage, not one per flush interval.
        emit = log.warning if first else log.debug
        emit("cannot deliver cache events to %s (%s); %d event(s) kept and retried in order",
             self.base_url, reason, pending)
        return False

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval):
            try:
                self.flush()
            except Exception:  # the flusher must outlive any surprise
                log.exception("cache-event flush failed")

    # --- lifecycle and introspection -------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Events not yet acknowledged by the coordinator."""
        with self._lock:
            return self._pending_locked()

    def stats(self) -> ReporterStats:
        with self._lock:
            return dataclasses.replace(self._stats, pending=self._pending_locked())

    def close(self) -> None:
        """Stop the periodic flush, try one last flush, close the HTTP client and the executor
        if this reporter made it. Idempotent. Bounded: each POST ends within the timeout."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        try:
            self.flush()  # waits for a flush in progress, then delivers what is left
        except Exception:
            log.exception("final cache-event flush failed")
        finally:
            if self._flusher is not None:
                self._flusher.result()  # it saw _stop; at most its last POST remains
            if self._owns_executor:
                self._executor.shutdown(wait=True)
            self._replicas.close()


def _encode_token_lists(entries: list[CacheEventEntry]) -> None:
    """Each entry's token array replaced by its JSON list (`msgspec.Raw`), all written in
    one kernel call, so encoding a batch builds no Python int per token; the body's bytes
    are the same as from the arrays. A list of ints (ids outside uint32) stays as it is."""
    held = [entry for entry in entries if type(entry.token_ids) is np.ndarray]
    for entry, raw in zip(held, token_lists_to_json([entry.token_ids for entry in held])):
        entry.token_ids = raw
