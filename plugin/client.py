"""`BlendCoordinatorClient`: the coordinator leg, query-only `POST /directory/blend-lookup`,
never in the caller's way.

`submit(request_id, tokens, namespace, deadline)` queues one query and returns at once;
`take(request_id)` hands the `FleetReply` over once (PENDING / DONE / FAILED / UNKNOWN).
At most `match_concurrency` round-trips in flight, each within its deadline; replicas in
turn with fail-over and one circuit breaker per URL, by the plugin's one fail-over policy
(`plugin.http.Replicas`, as the reporter and the registrar); memory bounded (`result_ttl_s`,
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
from plugin.http import Replica, Replicas, Verdict, coordinator_http, retry_after_s, verdict_of
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


@dataclass
class _Forms:
    """What one coordinator URL answers (guarded by the client's lock)."""

    candidates: bool = True  # False once it answered the default form to a candidates query
    said_objects: bool = False  # its "no columns form" was logged (once per URL)
    said_blend_off: bool = False  # its "blend lookup off" was logged (once per URL)


@dataclass(eq=False)
class _Query:
    request_id: str
    tokens: np.ndarray
    namespace: BlendNamespace
    deadline: float
    replica: Replica | None = None  # where it goes next
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
        self._replicas = Replicas(
            urls, lambda url: coordinator_http(url, timeout=timeout,
                                               connections=match_concurrency, token=token,
                                               ca_file=ca_file),
            breaker_threshold=breaker_threshold, breaker_cooldown_s=breaker_cooldown_s,
            clock=clock)
        self._forms = {replica.url: _Forms() for replica in self._replicas.replicas}
        self._turn = 0  # the replica the next query tries first
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
        return self._replicas.best().breaker

    def stats(self) -> ClientStats:
        with self._lock:
            best = self._replicas.best()
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
        self._replicas.close()

    # --- breakers (plugin.http.Replicas), guarded by _lock -----------------------------------

    def _route_locked(self, query: _Query, now: float, tried: tuple = ()) -> bool:
        """Send `query` next to the first replica, in turn, whose breaker admits it and
        that it has not tried; False if there is none."""
        picked = self._replicas.pick(self._turn, now, tried)
        if picked is None:
            return False
        index, query.replica, query.is_probe = picked
        self._turn = (index + 1) % len(self._replicas.replicas)
        return True

    def _record_locked(self, query: _Query, failure: QueryFailed | None, now: float) -> None:
        replica = query.replica
        verdict, wait = (Verdict.OK, None) if failure is None else (failure.verdict,
                                                                     failure.retry_after)
        before, after = self._replicas.record(replica, verdict, now, is_probe=query.is_probe,
                                              retry_after=wait)
        if failure is None:
            if before is not BreakerState.CLOSED:
                log.info("coordinator at %s answers again; fleet lookups resume", replica.url)
        elif verdict is not Verdict.UNAVAILABLE:
            # A 4xx or a malformed reply: this lookup goes local-only, the breaker is left as
            # it was (a 429 pauses every replica for its Retry-After).
            log.warning("coordinator blend-lookup failed (%s); this lookup goes local-only",
                        failure)
        elif before is BreakerState.HALF_OPEN and query.is_probe:
            log.warning("coordinator probe failed (%s); %s gets no lookups for %.1f s",
                        failure, replica.url, replica.reopens_at - now)
        elif before is not BreakerState.OPEN and after is BreakerState.OPEN:
            self._stats.breaker_opened += 1
            log.warning("coordinator blend-lookup failed %d times in a row (last: %s); "
                        "circuit breaker of %s open for %.1f s", replica.failures,
                        failure, replica.url, replica.reopens_at - now)
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
        tried: tuple[Replica, ...] = ()
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
                    if query.is_probe:  # let the next query probe instead
                        self._replicas.record(query.replica, Verdict.ANSWERED, now,
                                              is_probe=True)
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
                failure = QueryFailed(f"unexpected {type(exc).__name__}: {exc}",
                                      verdict=Verdict.ANSWERED)
            with self._lock:
                self._in_flight -= 1
                now = self._clock()
                if failure is None:
                    self._stats.succeeded += 1
                else:
                    self._stats.failed += 1
                self._record_locked(query, failure, now)
                tracked = self._tracked.get(query.request_id) is query
                if (failure is not None and failure.verdict is Verdict.UNAVAILABLE and tracked
                        and now < query.deadline - _MIN_USEFUL_S):
                    # Another replica may answer in the time left: fail over to it.
                    tried += (query.replica,)
                    if self._route_locked(query, now, tried):
                        self._stats.failed_over += 1
                        continue
                if tracked:
                    self._finish_locked(query, reply, now)
                else:
                    self._stats.late_discarded += 1
                return

    def _say_blend_off(self, url: str) -> None:
        """Once per URL: why this coordinator's answers hold nothing."""
        with self._lock:
            forms = self._forms[url]
            first, forms.said_blend_off = not forms.said_blend_off, True
        if first:
            log.warning("%s has blend lookup off (started without --enable-blend-lookup): it "
                        "finds nothing, so this server reuses nothing through the fleet. "
                        "Restart it with --enable-blend-lookup", url)

    def _first_objects_reply(self, url: str) -> bool:
        """Whether this is the first objects-form reply from `url` (logged once)."""
        with self._lock:
            forms = self._forms[url]
            first, forms.said_objects = not forms.said_objects, True
        return first

    def _round_trip(self, query: _Query, budget: float) -> FoundColumns:
        namespace, replica = query.namespace, query.replica
        url, forms = replica.url, self._forms[replica.url]
        # Columns are asked for with every candidates query: a coordinator of ours without
        # that form ignores the field, and one with it may answer a reply in objects
        # (hashes of different lengths), so an objects reply is no reason to stop asking.
        asked_candidates = forms.candidates
        body = encode(BlendLookupRequest(tokens_b64=encode_tokens(query.tokens),
                                         model_name=namespace.model_name,
                                         world_size=namespace.world_size,
                                         cache_salt=namespace.cache_salt,
                                         candidates=asked_candidates,
                                         columns=asked_candidates))
        try:
            with replica.http.stream("POST", BLEND_LOOKUP_PATH, content=body, timeout=budget,
                                     headers=_JSON) as response:
                if response.status_code != 200:
                    raise _refused(response, url)
                content = read_capped(response, self.max_reply_bytes, url)
        except httpx.TimeoutException as exc:
            raise QueryFailed(f"no reply from {url} within {budget:.3f} s "
                              f"({type(exc).__name__})", verdict=Verdict.UNAVAILABLE) from None
        except httpx.HTTPError as exc:
            raise QueryFailed(f"{type(exc).__name__} talking to {url}: {exc}",
                              verdict=Verdict.UNAVAILABLE) from None
        found = found_in(content, url, chunk_size=self.chunk_size,
                         instance_id=self.instance_id, num_tokens=len(query.tokens))
        if found.default_form and asked_candidates:
            with self._lock:
                forms.candidates = False
            log.info("%s answers blend lookups in LMCache's default form (no candidates): "
                     "using it", url)
        if found.objects_form and self._first_objects_reply(url):
            log.info("%s answers blend lookups with candidates as objects (no columns form, "
                     "or hashes of different lengths): using them", url)
        if found.blend_lookup_off:
            self._say_blend_off(url)
        if found.dropped:
            with self._lock:
                self._stats.dropped_entries += found.dropped
            log.warning("dropped %d invalid entr%s from the coordinator reply (first: %s)",
                        found.dropped, "y" if found.dropped == 1 else "ies", found.first_reason)
        return found.contents


def _refused(response: httpx.Response, url: str) -> QueryFailed:
    """A status other than 200 as a failure, with its verdict by the one policy and the
    `Retry-After` it asks for, if any."""
    text = read_capped(response, 4096, url)[:200]
    verdict = verdict_of(response.status_code)
    if verdict is Verdict.OK:  # a 2xx other than 200: not the reply asked for
        verdict = Verdict.ANSWERED
    header = response.headers.get("retry-after")
    wait = (retry_after_s(header) if header is not None or verdict is Verdict.THROTTLED
            else None)
    return QueryFailed(f"HTTP {response.status_code} from {url}{BLEND_LOOKUP_PATH}: {text!r}",
                       verdict=verdict, retry_after=wait)
