"""Coordinator client: query-only `POST /directory/blend-lookup`, never in the caller's way.

Contract:
- `submit_match(request_id, tokens, namespace, deadline)` queues one query per request id and
  returns at once; `poll_match` answers `PENDING`, the matches (a list, possibly empty), or
  None for an id it does not track; `take_match` hands the result over and forgets the id (a
  reply that arrives after that is discarded).
- A pool of `match_concurrency` daemon threads performs the round-trips, so at most that many
  are in flight. A query still queued when its deadline passes (or is a hair away) is not sent.
  A round-trip's budget is the configured timeout, cut to what is left of the deadline, and it
  bounds the whole round-trip (connect, send, every read): httpx's own timeouts apply per
  phase and per read, so a coordinator trickling bytes could otherwise hold a worker forever.
- Every failure (refused, timeout, 5xx, 422, non-JSON, wrong shape) becomes an empty result and
  a log warning; no method raises into the serving path.
- Replies are validated: an entry with bad hex, a negative `old_st`, a `cur_st` outside the
  query (`cur_st + C` beyond it) or a repeated chunk is dropped and counted.
- Circuit breaker: `breaker_threshold` consecutive failed round-trips open it (only failures
  that say the coordinator is unwell count: connection errors, timeouts, 5xx; a 4xx or a bad
  reply shape is one caller's or one reply's problem and must not turn the leg off for the
  whole process); while open,
  `submit_match` declines at once (the lookup goes local-only with no added latency); after
  `breaker_cooldown_s` one probe query is let through, and its outcome closes or re-opens it.
- Memory is bounded: finished results nobody takes expire after `result_ttl_s`, and at most
  `max_tracked` queries are tracked (the oldest unclaimed result makes room first; when all
  are in flight, the new query is declined).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import httpcore
import httpx
import numpy as np

from local_matcher.types import BlendMatch
from blend_wire import (BLEND_LOOKUP_PATH, BlendLookupReply, BlendLookupRequest, BlendNamespace,
                         WireError, decode, encode, encode_tokens)

logger = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
# A round-trip with less time than this left cannot come back in time: treat the query as
# past its deadline instead of sending it (and counting the sure timeout against the breaker).
_MIN_USEFUL_S = 0.002


class _Pending:
    """The type of `PENDING`: a query is queued or in flight."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "PENDING"

    def __bool__(self) -> bool:
        return False


PENDING = _Pending()


class MatchList(list):
    """The matches of one query (a plain list to callers); `ok` is False when the round-trip
    failed, or was skipped, and the empty list stands in for an answer."""

    ok: bool = True


class _QueryFailed(Exception):
    """One round-trip did not produce a usable reply; the message says why.

    `unhealthy`: the failure says the coordinator is down or struggling (connection error,
    timeout, 5xx) and counts toward the circuit breaker.
    """

    def __init__(self, reason: str, *, unhealthy: bool) -> None:
        super().__init__(reason)
        self.unhealthy = unhealthy


# --- a total deadline per round-trip ---------------------------------------------------------
# httpx applies its timeouts to each connect, write and read separately, and a read that
# returns one byte restarts the clock. The worker thread sets its round-trip's absolute
# deadline here, and the network backend below cuts every socket operation's timeout to it.
_this_thread = threading.local()


def _cut_to_deadline(timeout: float | None, error: type[Exception]) -> float | None:
    deadline = getattr(_this_thread, "deadline", None)
    if deadline is None:
        return timeout
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise error("the round-trip's total deadline has passed")
    return remaining if timeout is None else min(timeout, remaining)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _cut_to_deadline(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _cut_to_deadline(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None):
        return _DeadlineStream(self._stream.start_tls(
            ssl_context, server_hostname, _cut_to_deadline(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str):
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self, backend: httpcore.NetworkBackend) -> None:
        self._backend = backend

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        return _DeadlineStream(self._backend.connect_tcp(
            host, port, _cut_to_deadline(timeout, httpcore.ConnectTimeout), local_address,
            socket_options))

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        return _DeadlineStream(self._backend.connect_unix_socket(
            path, _cut_to_deadline(timeout, httpcore.ConnectTimeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


def _deadline_transport(limits: httpx.Limits) -> httpx.HTTPTransport:
    transport = httpx.HTTPTransport(limits=limits)
    # httpx offers no public hook for the network layer; its httpcore pool takes a network
    # backend, so wrap the one it made (every other pool setting stays as httpx chose it).
    pool = transport._pool
    pool._network_backend = _DeadlineBackend(pool._network_backend)
    return transport


@dataclass(eq=False)
class _Query:
    request_id: str
    tokens: np.ndarray
    namespace: BlendNamespace
    deadline: float
    is_probe: bool = False
    done: bool = False
    done_at: float = 0.0
    result: list[BlendMatch] = field(default_factory=list)
    ok: bool = True


class BlendCoordinatorClient:
    """Asks a coordinator which stored chunks a token sequence contains; see module doc."""

    def __init__(self, base_url: str, *, chunk_size: int = 256, timeout: float = 1.0,
                 match_concurrency: int = 8, breaker_threshold: int = 3,
                 breaker_cooldown_s: float = 5.0, result_ttl_s: float = 30.0,
                 max_tracked: int = 4096, transport: httpx.BaseTransport | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if match_concurrency < 1:
            raise ValueError(f"match_concurrency={match_concurrency} must be >= 1")
        self.base_url = base_url.rstrip("/")
        self.chunk_size = chunk_size
        self.timeout = timeout
        self.match_concurrency = match_concurrency
        self.breaker_threshold = breaker_threshold
        self.breaker_cooldown_s = breaker_cooldown_s
        self.result_ttl_s = result_ttl_s
        self.max_tracked = max_tracked
        self._clock = clock
        # trust_env=False: a proxy from HTTP_PROXY must not sit between a server and its
        # coordinator (it would also swallow our timeouts). The pool holds one connection per
        # worker so a round-trip never waits for a connection.
        limits = httpx.Limits(max_connections=match_concurrency,
                              max_keepalive_connections=match_concurrency)
        if transport is None:  # a caller's own transport (tests) gets httpx's timeouts only
            transport = _deadline_transport(limits)
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, limits=limits,
                                  transport=transport, trust_env=False)
        self._lock = threading.Lock()
        self._tracked: collections.OrderedDict[str, _Query] = collections.OrderedDict()
        self._queue: queue.SimpleQueue[_Query | None] = queue.SimpleQueue()
        self._closed = False
        self._last_purge = clock()
        # Circuit breaker state, guarded by _lock.
        self._breaker = CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_out = False
        self._stats = collections.Counter(dict.fromkeys(
            ("submitted", "sent", "succeeded", "failed", "skipped_breaker", "skipped_deadline",
             "dropped_entries", "expired", "cancelled", "late_discarded", "breaker_opened"), 0))
        self._in_flight = 0
        self._workers = [threading.Thread(target=self._work, name=f"blend-match-{i}", daemon=True)
                         for i in range(match_concurrency)]
        for worker in self._workers:
            worker.start()

    # --- the caller's side: never blocks on I/O ---------------------------------------------

    def submit_match(self, request_id: str, tokens: Sequence[int], namespace: BlendNamespace,
                     deadline: float | None = None) -> bool:
        """Queue one query for `request_id`; True if it will be answered, False if declined.

        Declined: closed client, id already tracked, breaker open, or the tracking map full.
        `deadline` is on this client's clock (time.monotonic by default); a query still queued
        when it passes is not sent. Default: now + timeout.
        """
        try:
            now = self._clock()
            array = np.asarray(tokens, dtype=np.uint32)
            query = _Query(request_id, array, BlendNamespace(*namespace),
                           now + self.timeout if deadline is None else deadline)
            with self._lock:
                if self._closed or request_id in self._tracked:
                    self._stats["declined_duplicate" if not self._closed else "declined_closed"] += 1
                    return False
                if not self._make_room_locked(now):
                    self._stats["declined_full"] += 1
                    logger.warning("coordinator client tracks %d queries (max_tracked); request "
                                   "%s goes local-only. Take results with take_match().",
                                   len(self._tracked), request_id)
                    return False
                if len(array) < self.chunk_size:
                    # Shorter than one chunk: the coordinator answers empty, so do not ask.
                    self._finish_locked(query, [], now)
                    self._tracked[request_id] = query
                    return True
                admitted, is_probe = self._admit_locked(now)
                if not admitted:
                    self._stats["skipped_breaker"] += 1
                    return False
                query.is_probe = is_probe
                self._tracked[request_id] = query
                self._stats["submitted"] += 1
            self._queue.put(query)
            return True
        except Exception:  # never into the serving path
            logger.exception("submit_match failed for request %s; going local-only", request_id)
            return False

    def poll_match(self, request_id: str):
        """`PENDING`, the list of `BlendMatch` (possibly empty), or None if not tracked."""
        with self._lock:
            query = self._tracked.get(request_id)
            if query is None:
                return None
            if not query.done:
                if self._clock() > query.deadline + self.result_ttl_s:
                    # Stuck far past its deadline: give up on it rather than poll forever.
                    self._tracked.pop(request_id, None)
                    self._stats["expired"] += 1
                    return None
                return PENDING
            return self._result(query)

    def take_match(self, request_id: str) -> list[BlendMatch] | None:
        """Hand over a finished result and forget the id. A pending one is cancelled (None)."""
        with self._lock:
            query = self._tracked.pop(request_id, None)
            if query is None:
                return None
            if not query.done:
                self._stats["cancelled"] += 1
                return None
            return self._result(query)

    @staticmethod
    def _result(query: _Query) -> MatchList:
        result = MatchList(query.result)
        result.ok = query.ok
        return result

    def cancel(self, request_id: str) -> None:
        """Forget a request id; a reply still to come is discarded."""
        self.take_match(request_id)

    # --- introspection ------------------------------------------------------------------------

    @property
    def breaker_state(self) -> str:
        with self._lock:
            return self._breaker

    def stats(self) -> dict:
        with self._lock:
            return {**self._stats, "tracked": len(self._tracked), "in_flight": self._in_flight,
                    "breaker": self._breaker, "consecutive_failures": self._failures}

    def close(self, timeout: float = 2.0) -> None:
        """Stop the workers (in-flight round-trips end within the HTTP timeout) and the client."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._tracked.clear()
        for _ in self._workers:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        try:
            self._http.close()
        except Exception:  # a worker still inside a request; the daemon thread dies with us
            logger.debug("closing the coordinator HTTP client", exc_info=True)

    # --- breaker, guarded by _lock ------------------------------------------------------------

    def _admit_locked(self, now: float) -> tuple[bool, bool]:
        if self._breaker == CLOSED:
            return True, False
        if self._breaker == OPEN:
            if now - self._opened_at < self.breaker_cooldown_s:
                return False, False
            self._breaker = HALF_OPEN
            self._probe_out = False
        if self._probe_out:
            return False, False
        self._probe_out = True
        return True, True

    def _record_locked(self, query: _Query, ok: bool, unhealthy: bool, reason: str,
                       now: float) -> None:
        if ok:
            if self._breaker != CLOSED:
                logger.info("coordinator at %s answers again; fleet lookups resume", self.base_url)
            self._breaker, self._failures, self._probe_out = CLOSED, 0, False
            return
        if not unhealthy:
            # A 4xx or a malformed reply: this lookup goes local-only, the breaker is left as
            # it was (a failed probe just lets the next query probe instead).
            if query.is_probe:
                self._probe_out = False
            logger.warning("coordinator blend-lookup failed (%s); this lookup goes local-only",
                           reason)
            return
        self._failures += 1
        if self._breaker == HALF_OPEN and query.is_probe:
            self._breaker, self._opened_at, self._probe_out = OPEN, now, False
            logger.warning("coordinator probe failed (%s); fleet leg stays off for %.1f s",
                           reason, self.breaker_cooldown_s)
        elif self._breaker == CLOSED:
            if self._failures >= self.breaker_threshold:
                self._breaker, self._opened_at = OPEN, now
                self._stats["breaker_opened"] += 1
                logger.warning("coordinator blend-lookup failed %d times in a row (last: %s); "
                               "circuit breaker open, lookups go local-only for %.1f s",
                               self._failures, reason, self.breaker_cooldown_s)
            else:
                logger.warning("coordinator blend-lookup failed (%s); this lookup goes local-only",
                               reason)

    # --- bookkeeping, guarded by _lock ----------------------------------------------------------

    def _finish_locked(self, query: _Query, result: list[BlendMatch], now: float,
                       ok: bool = True) -> None:
        query.result, query.done, query.done_at, query.ok = result, True, now, ok

    def _make_room_locked(self, now: float) -> bool:
        if now - self._last_purge >= self.result_ttl_s / 4 or len(self._tracked) >= self.max_tracked:
            self._last_purge = now
            for request_id, query in list(self._tracked.items()):
                stale = (now - query.done_at > self.result_ttl_s if query.done
                         else now > query.deadline + self.result_ttl_s)
                if stale:
                    del self._tracked[request_id]
                    self._stats["expired"] += 1
        if len(self._tracked) < self.max_tracked:
            return True
        for request_id, query in self._tracked.items():  # oldest first
            if query.done:
                del self._tracked[request_id]
                self._stats["expired"] += 1
                return True
        return False

    # --- workers -----------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            query = self._queue.get()
            if query is None:
                return
            try:
                self._serve(query)
            except Exception:  # keep the worker alive whatever happens
                logger.exception("coordinator worker error on request %s", query.request_id)

    def _serve(self, query: _Query) -> None:
        with self._lock:
            current = self._tracked.get(query.request_id) is query
            now = self._clock()
            if not current or now >= query.deadline - _MIN_USEFUL_S:
                # Taken/cancelled, or too late to be of use: do not spend a round-trip.
                self._stats["skipped_cancelled" if not current else "skipped_deadline"] += 1
                if query.is_probe:
                    self._probe_out = False  # let the next query probe instead
                if current:
                    self._finish_locked(query, [], now, ok=False)
                return
            remaining = query.deadline - now
            self._in_flight += 1
            self._stats["sent"] += 1
        ok, unhealthy, reason, matches = True, False, "", []
        try:
            matches = self._round_trip(query, min(self.timeout, remaining))
        except _QueryFailed as exc:
            ok, unhealthy, reason = False, exc.unhealthy, str(exc)
        except Exception as exc:  # anything else is a failure too, never an exception upward
            ok, reason = False, f"unexpected {type(exc).__name__}: {exc}"
        with self._lock:
            self._in_flight -= 1
            now = self._clock()
            self._stats["succeeded" if ok else "failed"] += 1
            self._record_locked(query, ok, unhealthy, reason, now)
            if self._tracked.get(query.request_id) is query:
                self._finish_locked(query, matches, now, ok)
            else:
                self._stats["late_discarded"] += 1

    def _round_trip(self, query: _Query, timeout: float) -> list[BlendMatch]:
        namespace = query.namespace
        body = encode(BlendLookupRequest(tokens_b64=encode_tokens(query.tokens),
                                         model_name=namespace.model_name,
                                         world_size=namespace.world_size,
                                         cache_salt=namespace.cache_salt))
        _this_thread.deadline = time.monotonic() + timeout  # the whole round-trip's budget
        try:
            response = self._http.post(BLEND_LOOKUP_PATH, content=body, timeout=timeout,
                                       headers={"content-type": "application/json"})
        except httpx.TimeoutException as exc:
            raise _QueryFailed(f"no reply from {self.base_url} within {timeout:.3f} s "
                               f"({type(exc).__name__})", unhealthy=True) from None
        except httpx.HTTPError as exc:
            raise _QueryFailed(f"{type(exc).__name__} talking to {self.base_url}: {exc}",
                               unhealthy=True) from None
        finally:
            _this_thread.deadline = None
        if response.status_code != 200:
            raise _QueryFailed(f"HTTP {response.status_code} from {self.base_url}"
                               f"{BLEND_LOOKUP_PATH}: {response.text[:200]!r}",
                               unhealthy=response.status_code >= 500)
        try:
            reply = decode(response.content, BlendLookupReply)
        except WireError as exc:
            raise _QueryFailed(f"reply from {self.base_url} is not a blend-lookup reply: {exc}",
                               unhealthy=False) from None
        if not reply.matches and b'"matches"' not in response.content:
            # The shape defaults `matches` to empty; a reply without it at all is some other
            # service answering, not "nothing found".
            raise _QueryFailed(f"reply from {self.base_url} has no `matches`: "
                               f"{response.text[:200]!r}", unhealthy=False)
        return self._validate(reply, len(query.tokens))

    def _validate(self, reply: BlendLookupReply, num_tokens: int) -> list[BlendMatch]:
        kept: list[BlendMatch] = []
        seen: set[bytes] = set()
        dropped, first_reason = 0, ""
        for entry in reply.matches:
            reason = ""
            try:
                chunk_hash = bytes.fromhex(entry.chunk_hash)
            except ValueError:
                chunk_hash, reason = b"", f"chunk_hash {entry.chunk_hash[:40]!r} is not hex"
            if not reason and not chunk_hash:
                reason = "empty chunk_hash"
            elif not reason and entry.old_st < 0:
                reason = f"old_st={entry.old_st} is negative"
            elif not reason and not 0 <= entry.cur_st <= num_tokens - self.chunk_size:
                reason = (f"cur_st={entry.cur_st} + chunk_size {self.chunk_size} lies outside "
                          f"the {num_tokens}-token query")
            elif not reason and chunk_hash in seen:
                reason = "chunk reported twice"
            if reason:
                dropped += 1
                first_reason = first_reason or reason
                continue
            seen.add(chunk_hash)
            kept.append(BlendMatch(chunk_hash, entry.old_st, entry.cur_st))
        if dropped:
            with self._lock:
                self._stats["dropped_entries"] += dropped
            logger.warning("dropped %d invalid match(es) from the coordinator reply (first: %s)",
                           dropped, first_reason)
        kept.sort(key=lambda m: m.cur_st)
        return kept
