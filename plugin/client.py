"""`BlendCoordinatorClient`: the coordinator leg, query-only `POST /directory/blend-lookup`,
never in the caller's way.

`submit(request_id, tokens, namespace, deadline)` queues one query and returns at once;
`take(request_id)` hands the `FleetReply` over once (PENDING / DONE / FAILED / UNKNOWN).
At most `match_concurrency` round-trips in flight, each within its deadline; replicas in
turn with fail-over, one circuit breaker per URL; memory bounded (`result_ttl_s`,
`max_tracked`); replies read and validated by plugin.replies; no method raises into the
serving path. `from_config(config)` is the client a `PluginConfig` describes.
Contract: docs/DESIGN.md, "Plugin"; the wire: docs/WIRE.md.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import httpx
import numpy as np

from blend_wire import BLEND_LOOKUP_PATH, BlendLookupRequest, BlendNamespace, encode, encode_tokens
from plugin.config import DEFAULT_MAX_REPLY_BYTES, PluginConfig, coordinator_url_list
from plugin.http import coordinator_http
from plugin.replies import QueryFailed, found_in, read_capped
from plugin.types import BreakerState, FleetReply, FoundColumns, MatchState

log = logging.getLogger(__name__)

# A round-trip with less time than this left cannot come back in time: treat the query as
# past its deadline instead of sending it (and counting the sure timeout against the breaker).
_MIN_USEFUL_S = 0.002
# Encodings the bounded reader can decode (anything else fails the reply).
_JSON = {"content-type": "application/json", "accept-encoding": "gzip, deflate"}


@dataclass
class ClientStats:
    """Counters since start, plus the state at the time of `stats()`."""

    submitted: int = 0
    sent: int = 0
    succeeded: int = 0
    failed: int = 0
    skipped_breaker: int = 0
    skipped_deadline: int = 0
    skipped_cancelled: int = 0
    declined_duplicate: int = 0
    declined_closed: int = 0
    declined_full: int = 0
    dropped_entries: int = 0
    expired: int = 0
    cancelled: int = 0
    late_discarded: int = 0
    breaker_opened: int = 0
    failed_over: int = 0  # round-trips sent on to another coordinator after a failure
    tracked: int = 0
    in_flight: int = 0
    breaker: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0


@dataclass(eq=False)
class _Endpoint:
    """One coordinator URL: its connections and its circuit breaker (guarded by the
    client's lock)."""

    url: str
    http: httpx.Client
    breaker: BreakerState = BreakerState.CLOSED
    opened_at: float = 0.0
    probe_out: bool = False
    failures: int = 0  # consecutive unhealthy failures
    candidates: bool = True  # False once it answered the default form to a candidates query
    said_objects: bool = False  # its "no columns form" was logged (once per URL)
    said_blend_off: bool = False  # its "blend lookup off" was logged (once per URL)


@dataclass(eq=False)
class _Query:
    request_id: str
    tokens: np.ndarray
    namespace: BlendNamespace
    deadline: float
    endpoint: _Endpoint | None = None  # where it goes next
    is_probe: bool = False
    reply: FleetReply | None = None  # set once, when it is done
    done_at: float = 0.0


class BlendCoordinatorClient:
    """Asks a coordinator which stored chunks a token sequence contains; see module doc."""

    def __init__(self, base_url: str | Sequence[str], *, chunk_size: int = 256, timeout: float = 1.0,
                 match_concurrency: int = 8, breaker_threshold: int = 3,
                 breaker_cooldown_s: float = 5.0, result_ttl_s: float = 30.0,
                 max_tracked: int = 4096, executor: Executor | None = None,
                 clock: Callable[[], float] = time.monotonic, token: str | None = None,
                 ca_file: str | None = None, instance_id: str = "",
                 max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES) -> None:
        if match_concurrency < 1:
            raise ValueError(f"match_concurrency={match_concurrency} must be >= 1")
        urls = coordinator_url_list(base_url)
        if not urls:
            raise ValueError("at least one coordinator URL is needed")
        self.base_url = ",".join(urls)
        self.chunk_size = chunk_size
        self.instance_id = instance_id
        self.max_reply_bytes = max_reply_bytes
        self.timeout = timeout
        self.match_concurrency = match_concurrency
        self.breaker_threshold = breaker_threshold
        self.breaker_cooldown_s = breaker_cooldown_s
        self.result_ttl_s = result_ttl_s
        self.max_tracked = max_tracked
        self._clock = clock
        # One connection per round-trip in flight, so none waits for a connection.
        self._endpoints = [_Endpoint(url, coordinator_http(url, timeout=timeout,
                                                           connections=match_concurrency,
                                                           token=token, ca_file=ca_file))
                           for url in urls]
        self._turn = 0  # the endpoint the next query tries first
        self._owns_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(match_concurrency,
                                                        thread_name_prefix="blend-match")
        self._lock = threading.Lock()
        self._tracked: collections.OrderedDict[str, _Query] = collections.OrderedDict()
        self._waiting: collections.deque[_Query] = collections.deque()
        self._drainers = 0  # tasks draining _waiting; at most match_concurrency
        self._drained = threading.Condition(self._lock)  # notified when _drainers hits 0
        self._closed = False
        self._last_purge = clock()
        self._in_flight = 0
        self._stats = ClientStats()

    @classmethod
    def from_config(cls, config: PluginConfig, *, executor: Executor | None = None,
                    clock: Callable[[], float] = time.monotonic) -> "BlendCoordinatorClient":
        """The client `config` describes: its URLs, chunk size, budget, concurrency, breaker,
        bounds, identity and credentials (one place, as `CacheEventReporter.from_config`)."""
        return cls(config.coordinator_urls, chunk_size=config.chunk_size,
                   timeout=config.blend_timeout, match_concurrency=config.match_concurrency,
                   breaker_threshold=config.breaker_threshold,
                   breaker_cooldown_s=config.breaker_cooldown_s,
                   result_ttl_s=config.result_ttl_s, max_tracked=config.max_tracked_queries,
                   executor=executor, clock=clock, token=config.coordinator_token,
                   ca_file=config.coordinator_ca_file, instance_id=config.instance_id,
                   max_reply_bytes=config.max_reply_bytes)

    # --- the caller's side: never blocks on I/O ---------------------------------------------

    def submit(self, request_id: str, tokens: np.ndarray, namespace: BlendNamespace,
               deadline: float | None = None) -> bool:
        """Queue one query for `request_id`; True if it will be answered, False if declined.

        Declined: closed client, id already tracked, breaker open, or the tracking map full.
        `deadline` is on this client's clock (time.monotonic by default); a query still queued
        when it passes is not sent. Default: now + timeout.
        """
        try:
            now = self._clock()
            query = _Query(request_id, tokens, namespace,
                           now + self.timeout if deadline is None else deadline)
            with self._lock:
                if self._closed:
                    self._stats.declined_closed += 1
                    return False
                if request_id in self._tracked:
                    self._stats.declined_duplicate += 1
                    return False
                if not self._make_room_locked(now):
                    self._stats.declined_full += 1
                    log.warning("coordinator client tracks %d queries (max_tracked); request "
                                "%s goes local-only. Take results with take().",
                                len(self._tracked), request_id)
                    return False
                if not self._route_locked(query, now):
                    self._stats.skipped_breaker += 1
                    return False
                self._tracked[request_id] = query
                self._stats.submitted += 1
                self._waiting.append(query)
                if self._drainers < self.match_concurrency:
                    self._drainers += 1
                    self._executor.submit(self._drain)
            return True
        except Exception:  # never into the serving path
            log.exception("submit failed for request %s; going local-only", request_id)
            return False

    def take(self, request_id: str) -> FleetReply:
        """The hand-over: PENDING (still tracked), DONE / FAILED (handed over, forgotten),
        or UNKNOWN. Never raises."""
        with self._lock:
            query = self._tracked.get(request_id)
            if query is None:
                return FleetReply(MatchState.UNKNOWN)
            if query.reply is None:
                if self._clock() <= query.deadline + self.result_ttl_s:
                    return FleetReply(MatchState.PENDING)
                # Stuck far past its deadline: give up on it rather than poll forever.
                del self._tracked[request_id]
                self._stats.expired += 1
                return FleetReply(MatchState.UNKNOWN)
            del self._tracked[request_id]
            return query.reply

    def cancel(self, request_id: str) -> None:
        """Forget a request id; a reply still to come is discarded."""
        with self._lock:
            query = self._tracked.pop(request_id, None)
            if query is not None and query.reply is None:
                self._stats.cancelled += 1

    # --- introspection ------------------------------------------------------------------------

    @property
    def breaker_state(self) -> BreakerState:
        """The best breaker: closed if any coordinator's is, else half-open if any is."""
        with self._lock:
            return self._best_locked().breaker

    def _best_locked(self) -> _Endpoint:
        rank = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
        return min(self._endpoints, key=lambda e: (rank[e.breaker], e.failures))

    def stats(self) -> ClientStats:
        with self._lock:
            best = self._best_locked()
            return dataclasses.replace(self._stats, tracked=len(self._tracked),
                                       in_flight=self._in_flight, breaker=best.breaker,
                                       consecutive_failures=best.failures)

    def close(self) -> None:
        """Decline new queries, drop queued ones, wait for the round-trips in flight (each
        ends within its budget), close the HTTP client and the executor if this client made
        it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._tracked.clear()
            self._waiting.clear()
            self._drained.wait_for(lambda: self._drainers == 0, self.timeout + 1.0)
        if self._owns_executor:
            self._executor.shutdown(wait=True)
        for endpoint in self._endpoints:
            endpoint.http.close()

    # --- breakers, guarded by _lock -----------------------------------------------------------

    def _route_locked(self, query: _Query, now: float, tried: tuple = ()) -> bool:
        """Send `query` next to the first endpoint, in turn, whose breaker admits it and
        that it has not tried; False if there is none."""
        count = len(self._endpoints)
        for step in range(count):
            endpoint = self._endpoints[(self._turn + step) % count]
            if endpoint in tried:
                continue
            admitted, is_probe = self._admit_locked(endpoint, now)
            if admitted:
                self._turn = (self._turn + step + 1) % count
                query.endpoint, query.is_probe = endpoint, is_probe
                return True
        return False

    def _admit_locked(self, endpoint: _Endpoint, now: float) -> tuple[bool, bool]:
        """(admitted, is_probe)."""
        if endpoint.breaker is BreakerState.CLOSED:
            return True, False
        if endpoint.breaker is BreakerState.OPEN:
            if now - endpoint.opened_at < self.breaker_cooldown_s:
                return False, False
            endpoint.breaker = BreakerState.HALF_OPEN
            endpoint.probe_out = False
        if endpoint.probe_out:
            return False, False
        endpoint.probe_out = True
        return True, True

    def _record_locked(self, query: _Query, failure: QueryFailed | None, now: float) -> None:
        stats, endpoint = self._stats, query.endpoint
        if failure is None:
            if endpoint.breaker is not BreakerState.CLOSED:
                log.info("coordinator at %s answers again; fleet lookups resume",
                         endpoint.url)
            endpoint.breaker, endpoint.probe_out, endpoint.failures = (
                BreakerState.CLOSED, False, 0)
            return
        if not failure.unhealthy:
            # A 4xx or a malformed reply: this lookup goes local-only, the breaker is left as
            # it was (a failed probe just lets the next query probe instead).
            if query.is_probe:
                endpoint.probe_out = False
            log.warning("coordinator blend-lookup failed (%s); this lookup goes local-only",
                        failure)
            return
        endpoint.failures += 1
        if endpoint.breaker is BreakerState.HALF_OPEN and query.is_probe:
            endpoint.breaker, endpoint.opened_at, endpoint.probe_out = (
                BreakerState.OPEN, now, False)
            log.warning("coordinator probe failed (%s); %s gets no lookups for %.1f s",
                        failure, endpoint.url, self.breaker_cooldown_s)
        elif endpoint.breaker is BreakerState.CLOSED:
            if endpoint.failures >= self.breaker_threshold:
                endpoint.breaker, endpoint.opened_at = BreakerState.OPEN, now
                stats.breaker_opened += 1
                log.warning("coordinator blend-lookup failed %d times in a row (last: %s); "
                            "circuit breaker of %s open for %.1f s", endpoint.failures,
                            failure, endpoint.url, self.breaker_cooldown_s)
            else:
                log.warning("coordinator blend-lookup failed (%s); this lookup goes to "
                            "another replica, or local-only", failure)

    # --- bookkeeping, guarded by _lock ----------------------------------------------------------

    def _finish_locked(self, query: _Query, reply: FleetReply, now: float) -> None:
        query.reply, query.done_at = reply, now

    def _make_room_locked(self, now: float) -> bool:
        if now - self._last_purge >= self.result_ttl_s / 4 or len(self._tracked) >= self.max_tracked:
            self._last_purge = now
            for request_id, query in list(self._tracked.items()):
                stale = (now - query.done_at > self.result_ttl_s if query.reply is not None
                         else now > query.deadline + self.result_ttl_s)
                if stale:
                    del self._tracked[request_id]
                    self._stats.expired += 1
        if len(self._tracked) < self.max_tracked:
            return True
        for request_id, query in self._tracked.items():  # oldest first
            if query.reply is not None:
                del self._tracked[request_id]
                self._stats.expired += 1
                return True
        return False

    # --- background: at most match_concurrency drain tasks ----------------------------------

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._waiting:
                    self._drainers -= 1
                    if not self._drainers:
                        self._drained.notify_all()
                    return
                query = self._waiting.popleft()
            try:
                self._serve(query)
            except Exception:  # keep draining whatever happens
                log.exception("coordinator query failed on request %s", query.request_id)

    def _serve(self, query: _Query) -> None:
        tried: tuple[_Endpoint, ...] = ()
        while True:
            with self._lock:
                current = self._tracked.get(query.request_id) is query
                now = self._clock()
                if not current or now >= query.deadline - _MIN_USEFUL_S:
                    # Taken/cancelled, or too late to be of use: do not spend a round-trip.
                    if current:
                        self._stats.skipped_deadline += 1
                        self._finish_locked(query, FleetReply(MatchState.FAILED), now)
                    else:
                        self._stats.skipped_cancelled += 1
                    if query.is_probe:
                        query.endpoint.probe_out = False  # let the next query probe instead
                    return
                budget = min(self.timeout, query.deadline - now)
                self._in_flight += 1
                self._stats.sent += 1
            failure, reply = None, FleetReply(MatchState.FAILED)
            try:
                reply = FleetReply(MatchState.DONE, self._round_trip(query, budget))
            except QueryFailed as exc:
                failure = exc
            except Exception as exc:  # anything else is a failure too, never an exception upward
                failure = QueryFailed(f"unexpected {type(exc).__name__}: {exc}", unhealthy=False)
            with self._lock:
                self._in_flight -= 1
                now = self._clock()
                if failure is None:
                    self._stats.succeeded += 1
                else:
                    self._stats.failed += 1
                self._record_locked(query, failure, now)
                tracked = self._tracked.get(query.request_id) is query
                if (failure is not None and failure.unhealthy and tracked
                        and now < query.deadline - _MIN_USEFUL_S):
                    # Another replica may answer in the time left: fail over to it.
                    tried += (query.endpoint,)
                    if self._route_locked(query, now, tried):
                        self._stats.failed_over += 1
                        continue
                if tracked:
                    self._finish_locked(query, reply, now)
                else:
                    self._stats.late_discarded += 1
                return

    def _say_blend_off(self, endpoint: _Endpoint) -> None:
        """Once per URL: why this coordinator's answers hold nothing."""
        with self._lock:
            first, endpoint.said_blend_off = not endpoint.said_blend_off, True
        if first:
            log.warning("%s has blend lookup off (started without --enable-blend-lookup): it "
                        "finds nothing, so this server reuses nothing through the fleet. "
                        "Restart it with --enable-blend-lookup", endpoint.url)

    def _first_objects_reply(self, endpoint: _Endpoint) -> bool:
        """Whether this is the first objects-form reply from `endpoint` (logged once)."""
        with self._lock:
            first, endpoint.said_objects = not endpoint.said_objects, True
        return first

    def _round_trip(self, query: _Query, budget: float) -> FoundColumns:
        namespace, endpoint = query.namespace, query.endpoint
        # Columns are asked for with every candidates query: a coordinator of ours without
        # that form ignores the field, and one with it may answer a reply in objects
        # (hashes of different lengths), so an objects reply is no reason to stop asking.
        asked_candidates = endpoint.candidates
        body = encode(BlendLookupRequest(tokens_b64=encode_tokens(query.tokens),
                                         model_name=namespace.model_name,
                                         world_size=namespace.world_size,
                                         cache_salt=namespace.cache_salt,
                                         candidates=asked_candidates,
                                         columns=asked_candidates))
        try:
            with endpoint.http.stream("POST", BLEND_LOOKUP_PATH, content=body, timeout=budget,
                                      headers=_JSON) as response:
                if response.status_code != 200:
                    text = read_capped(response, 4096, endpoint.url)[:200]
                    raise QueryFailed(f"HTTP {response.status_code} from {endpoint.url}"
                                      f"{BLEND_LOOKUP_PATH}: {text!r}",
                                      unhealthy=response.status_code >= 500)
                content = read_capped(response, self.max_reply_bytes, endpoint.url)
        except httpx.TimeoutException as exc:
            raise QueryFailed(f"no reply from {endpoint.url} within {budget:.3f} s "
                              f"({type(exc).__name__})", unhealthy=True) from None
        except httpx.HTTPError as exc:
            raise QueryFailed(f"{type(exc).__name__} talking to {endpoint.url}: {exc}",
                              unhealthy=True) from None
        found = found_in(content, endpoint.url, chunk_size=self.chunk_size,
                         instance_id=self.instance_id, num_tokens=len(query.tokens))
        if found.default_form and asked_candidates:
            with self._lock:
                endpoint.candidates = False
            log.info("%s answers blend lookups in LMCache's default form (no candidates): "
                     "using it", endpoint.url)
        if found.objects_form and self._first_objects_reply(endpoint):
            log.info("%s answers blend lookups with candidates as objects (no columns form, "
                     "or hashes of different lengths): using them", endpoint.url)
        if found.blend_lookup_off:
            self._say_blend_off(endpoint)
        if found.dropped:
            with self._lock:
                self._stats.dropped_entries += found.dropped
            log.warning("dropped %d invalid entr%s from the coordinator reply (first: %s)",
                        found.dropped, "y" if found.dropped == 1 else "ies", found.first_reason)
        return found.contents
