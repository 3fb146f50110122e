"""The plugin's one HTTP policy: how the coordinator client, the reporter and the registrar
talk to a coordinator and fail over between its replicas.

Contract:
- `coordinator_http(base_url, timeout=..., connections=..., token=..., ca_file=...)` is the
  only way the plugin makes an `httpx.Client`: no proxy from the environment (one must not
  sit between a server and its coordinator, nor swallow our timeouts), a pool of
  `connections` keep-alive connections, and `DeadlineTransport` underneath. With a `token`,
  every request carries `Authorization: Bearer <token>` (a coordinator with access control
  on); with a `ca_file`, an `https://` coordinator's certificate is checked against it
  instead of the system's trust store. A token bound for an `http://` URL whose host is
  not loopback is warned about (once per host): it would cross the network in clear.
- `DeadlineTransport` makes a request's timeout a *total* deadline for the round-trip:
  connecting, sending and every read of the status line, headers and body, together.
  httpx applies its timeouts per phase and per read (a read that returns one byte restarts
  the clock), so a coordinator trickling bytes could otherwise hold a caller forever.
  The budget is the smallest of the request's httpx timeouts (`timeout=` of the call, or the
  client's), fixed when the request is handed to the transport.
- Built on public API only: `httpx.BaseTransport`, and an `httpcore.ConnectionPool` given a
  `network_backend` that cuts each socket operation's timeout to what is left of the
  deadline. No httpx internals, so httpx upgrades do not break it (tests/serving/test_plugin_http.py
  runs the trickling servers against it).
- Errors surface as httpx's exception types (`httpx.ReadTimeout`, `httpx.ConnectError`...),
  as from httpx's own transport.

The one fail-over policy (issue 34; before it the reporter stopped at a 503, the registrar
moved on at any 5xx and the client had breakers of its own). The client, the reporter and
the registrar each hold a `Replicas` over their URLs and follow it alike:
- `verdict_of(status)` is the one classification of an answer. `UNAVAILABLE`: a connection
  error, a timeout or any 5xx (503 included: a replica whose ingest budget or connections
  are at their cap, whose event log has no quorum, or that is shutting down): this replica
  cannot take it now, the request goes on to the next replica at once (each at most once
  per request). `PERMANENT`
  (`PERMANENT_STATUSES`: 400, 403, 409, 413, 422): a refusal of what the request is, which
  every replica would repeat: no other replica is asked, and it is no outage.
  `THROTTLED` (429, a quota every replica shares: the instance-id cap): no replica is asked
  before its `Retry-After`. `OK` (2xx) and `ANSWERED` (anything else, 401 or 404: the
  caller reads it) end the request at that replica.
- How long a replica is benched: each has a circuit breaker. It opens after
  `breaker_threshold` consecutive `UNAVAILABLE` verdicts (3), for `breaker_cooldown_s` (5 s;
  both from `PluginConfig`, the same for all three callers), or at once for its
  `Retry-After` (`retry_after_s`: seconds, at most `MAX_RETRY_AFTER_S`, 60; an HTTP date or
  garbage is 1 s) when an unavailable answer carries one. After the bench one request
  probes it (half-open): an `OK` closes the breaker, an `UNAVAILABLE` opens it again, any
  other verdict lets the next request probe. A benched replica is skipped; with every one
  benched (or paused) a request is not sent at all.
- Order: `pick(start, ...)` takes the first admitted replica from `start` on. The client
  starts each query at the replica after the last one used (lookups take turns);
  `Replicas.request` (the reporter, the registrar: synchronous) starts at the current
  replica and the one that answers stays current. `Sent` says what happened: the answer
  and its verdict, or why none came, how many replicas were asked and moved past, and
  whether a `Retry-After` was honoured.
- Each caller keeps its own guarantees on top: the client never raises into the serving
  path and fails over only within the lookup's budget; the reporter and the registrar
  bound each round-trip by their timeout, so a request takes at most one timeout per
  replica.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Iterator, Mapping, Sequence

import httpcore
import httpx

from blend_wire import is_loopback_host
from plugin.types import BreakerState

__all__ = ["MAX_RETRY_AFTER_S", "PERMANENT_STATUSES", "DeadlineTransport", "Replica", "Replicas",
           "Sent", "Verdict", "coordinator_http", "retry_after_s", "verdict_of"]

log = logging.getLogger(__name__)


def coordinator_http(base_url: str, *, timeout: float, connections: int = 1,
                     token: str | None = None, ca_file: str | None = None) -> httpx.Client:
    """An `httpx.Client` for a coordinator: total deadline per round-trip, no env proxy."""
    if token:
        _warn_if_in_clear(base_url)
    ssl_context = ssl.create_default_context(cafile=ca_file) if ca_file else None
    transport = DeadlineTransport(max_connections=connections, ssl_context=ssl_context)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return httpx.Client(base_url=base_url, timeout=timeout, transport=transport,
                        headers=headers, trust_env=False)


_warned_in_clear: set[str] = set()


def _warn_if_in_clear(base_url: str) -> None:
    """Warn (once per coordinator) when a bearer token would go over plain HTTP to
    another machine: anyone on the path can copy it and speak as this server."""
    url = httpx.URL(base_url)
    if url.scheme != "http" or is_loopback_host(url.host) or url.host in _warned_in_clear:
        return
    _warned_in_clear.add(url.host)
    log.warning("the coordinator token (LMCACHE_COORDINATOR_TOKEN) is sent over plain http:// "
                "to %s, a host other than this one: anyone on the path can copy it; use an "
                "https:// coordinator URL (LMCACHE_COORDINATOR_CA_FILE for its CA)", url.host)


# The absolute deadline (time.monotonic) of the round-trip the current thread is making. A
# sync round-trip runs on its caller's thread from start to last byte, and a pooled
# connection serves one round-trip at a time, so the thread is the right scope.
_round_trip = threading.local()


@contextlib.contextmanager
def _deadline(deadline: float | None) -> Iterator[None]:
    outer = getattr(_round_trip, "deadline", None)
    _round_trip.deadline = deadline
    try:
        yield
    finally:
        _round_trip.deadline = outer


def _cut(timeout: float | None, error: type[Exception]) -> float | None:
    deadline = getattr(_round_trip, "deadline", None)
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
        return self._stream.read(max_bytes, _cut(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _cut(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._stream.start_tls(
            ssl_context, server_hostname, _cut(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str):
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None
                    ) -> httpcore.NetworkStream:
        return _DeadlineStream(self._backend.connect_tcp(
            host, port, _cut(timeout, httpcore.ConnectTimeout), local_address, socket_options))

    def connect_unix_socket(self, path, timeout=None, socket_options=None
                            ) -> httpcore.NetworkStream:
        return _DeadlineStream(self._backend.connect_unix_socket(
            path, _cut(timeout, httpcore.ConnectTimeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


@contextlib.contextmanager
def _httpx_errors(request: httpx.Request) -> Iterator[None]:
    """Re-raise httpcore's errors as the httpx error of the same name (both export them)."""
    try:
        yield
    except httpcore.TimeoutException as exc:
        raise _as_httpx(exc, request, httpx.TimeoutException) from exc
    except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.ProxyError,
            httpcore.UnsupportedProtocol) as exc:
        raise _as_httpx(exc, request, httpx.TransportError) from exc


def _as_httpx(exc: Exception, request: httpx.Request,
              fallback: type[httpx.TransportError]) -> httpx.TransportError:
    for cls in type(exc).__mro__:
        same = getattr(httpx, cls.__name__, None)
        if isinstance(same, type) and issubclass(same, fallback):
            return same(str(exc) or cls.__name__, request=request)
    return fallback(str(exc) or type(exc).__name__, request=request)


class _Body(httpx.SyncByteStream):
    """The response body, read under the round-trip's deadline."""

    def __init__(self, stream: Iterable[bytes], request: httpx.Request,
                 deadline: float | None) -> None:
        self._stream, self._request, self._deadline = stream, request, deadline

    def __iter__(self) -> Iterator[bytes]:
        with _deadline(self._deadline), _httpx_errors(self._request):
            yield from self._stream

    def close(self) -> None:
        close = getattr(self._stream, "close", None)
        if close is not None:
            close()


class DeadlineTransport(httpx.BaseTransport):
    """An httpx transport whose request timeout bounds the whole round-trip
    (module doc)."""

    def __init__(self, *, max_connections: int = 1,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._pool = httpcore.ConnectionPool(
            ssl_context=ssl_context, max_connections=max_connections,
            max_keepalive_connections=max_connections, network_backend=_DeadlineBackend())

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        budget = min((t for t in timeouts.values() if t is not None), default=None)
        deadline = None if budget is None else time.monotonic() + budget
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=request.url.raw_scheme, host=request.url.raw_host,
                             port=request.url.port, target=request.url.raw_path),
            headers=request.headers.raw, content=request.stream,
            extensions=request.extensions)
        with _deadline(deadline), _httpx_errors(request):
            core_response = self._pool.handle_request(core_request)
        return httpx.Response(status_code=core_response.status, headers=core_response.headers,
                              stream=_Body(core_response.stream, request, deadline),
                              extensions=core_response.extensions)

    def close(self) -> None:
        self._pool.close()


# --- the one fail-over policy: replicas of one coordinator ------------------------------------

#: The longest `Retry-After` honoured: a coordinator cannot bench a replica, or pause a
#: caller, for longer.
MAX_RETRY_AFTER_S = 60.0
#: Refusals of what the request is, not of the replica's state: every replica would answer
#: the same, now and later (invalid 400/422, too large 413, outside the token's scope 403,
#: in conflict with the fleet 409).
PERMANENT_STATUSES = frozenset({400, 403, 409, 413, 422})


class Verdict(enum.Enum):
    """What an answer says about the replica and the request (module doc)."""

    OK = "ok"                    # 2xx: the replica is well
    ANSWERED = "answered"        # another answer the caller reads (404, 401...): health unknown
    PERMANENT = "permanent"      # PERMANENT_STATUSES: no replica will take this request
    THROTTLED = "throttled"      # 429: a quota every replica shares; no replica until Retry-After
    UNAVAILABLE = "unavailable"  # connection error, timeout, 5xx: try the next replica


def verdict_of(status: int) -> Verdict:
    """The one classification of a coordinator's HTTP status (a transport error is
    `Verdict.UNAVAILABLE` too)."""
    if status >= 500:
        return Verdict.UNAVAILABLE
    if status == 429:
        return Verdict.THROTTLED
    if status in PERMANENT_STATUSES:
        return Verdict.PERMANENT
    return Verdict.OK if 200 <= status < 300 else Verdict.ANSWERED


def retry_after_s(value: str | None) -> float:
    """`Retry-After` in seconds (the delay form; an HTTP date or garbage counts as 1 s),
    at most `MAX_RETRY_AFTER_S`."""
    try:
        delay = float(value) if value is not None else 1.0
    except ValueError:
        delay = 1.0
    if not delay >= 0:  # NaN, negative
        delay = 1.0
    return min(delay, MAX_RETRY_AFTER_S)


@dataclass(eq=False)
class Replica:
    """One coordinator URL: its connections and its circuit breaker (guarded by `Replicas`)."""

    url: str
    http: httpx.Client
    breaker: BreakerState = BreakerState.CLOSED
    failures: int = 0         # consecutive UNAVAILABLE verdicts
    reopens_at: float = 0.0   # while OPEN: benched until then
    probe_out: bool = False   # HALF_OPEN: the one request that tells whether it is back


@dataclass
class Sent:
    """What `Replicas.request` got: the answer of the first replica that was not
    unavailable, or none (`failure` says why)."""

    response: httpx.Response | None
    verdict: Verdict | None
    failure: str = ""
    tried: int = 0          # replicas asked; 0: every one benched (or paused), none asked
    moved: int = 0          # times the request went on to the next replica
    retry_after: bool = False  # some answer carried a Retry-After, honoured


class Replicas:
    """Replicas of one coordinator under the one fail-over policy (module doc):
    `UNAVAILABLE` goes on to the next replica at once; a replica's breaker opens after
    `breaker_threshold` consecutive UNAVAILABLE verdicts, for `breaker_cooldown_s`, or at
    once for its `Retry-After`; then one probe. `THROTTLED` pauses every replica until its
    `Retry-After`. Thread-safe; no I/O under the lock."""

    def __init__(self, urls: Sequence[str], http_for: Callable[[str], httpx.Client], *,
                 breaker_threshold: int = 3, breaker_cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not urls:
            raise ValueError("at least one coordinator URL is needed")
        if breaker_threshold < 1 or not breaker_cooldown_s > 0:
            raise ValueError(f"breaker_threshold={breaker_threshold} must be >= 1 and "
                             f"breaker_cooldown_s={breaker_cooldown_s} > 0")
        self.replicas = [Replica(url, http_for(url)) for url in urls]
        self.breaker_threshold, self.breaker_cooldown_s = breaker_threshold, breaker_cooldown_s
        self.clock = clock
        self.current = 0  # where `request` starts: it stays with the replica that answers
        self._paused_until = 0.0
        self._lock = threading.Lock()

    def pick(self, start: int, now: float, tried: Collection[Replica] = ()
             ) -> tuple[int, Replica, bool] | None:
        """The first replica from index `start` on, in turn, not in `tried`, whose breaker
        admits a request now: (its index, it, whether the request is its probe); None when
        there is none."""
        with self._lock:
            if now < self._paused_until:
                return None
            count = len(self.replicas)
            for step in range(count):
                index = (start + step) % count
                replica = self.replicas[index]
                if replica not in tried:
                    admitted, is_probe = self._admit_locked(replica, now)
                    if admitted:
                        return index, replica, is_probe
            return None

    def _admit_locked(self, replica: Replica, now: float) -> tuple[bool, bool]:
        if replica.breaker is BreakerState.CLOSED:
            return True, False
        if replica.breaker is BreakerState.OPEN:
            if now < replica.reopens_at:
                return False, False
            replica.breaker, replica.probe_out = BreakerState.HALF_OPEN, False
        if replica.probe_out:
            return False, False
        replica.probe_out = True
        return True, True

    def record(self, replica: Replica, verdict: Verdict, now: float, *, is_probe: bool,
               retry_after: float | None = None) -> tuple[BreakerState, BreakerState]:
        """Account one request's verdict; (breaker before, breaker after).

        OK closes the breaker. ANSWERED and PERMANENT leave it (a probe's just lets the next
        request probe). UNAVAILABLE counts; it opens the breaker at the threshold, at a
        failed probe, or at once when the answer carried `retry_after`. THROTTLED pauses
        every replica for `retry_after` (1 s without one)."""
        with self._lock:
            before = replica.breaker
            if verdict is Verdict.OK:
                replica.breaker, replica.probe_out, replica.failures = (
                    BreakerState.CLOSED, False, 0)
            elif verdict is Verdict.UNAVAILABLE:
                replica.failures += 1
                if (retry_after is not None or is_probe
                        or replica.failures >= self.breaker_threshold):
                    bench = self.breaker_cooldown_s if retry_after is None else retry_after
                    replica.breaker, replica.probe_out = BreakerState.OPEN, False
                    replica.reopens_at = max(replica.reopens_at, now + bench)
            else:
                if is_probe:
                    replica.probe_out = False
                if verdict is Verdict.THROTTLED:
                    self._paused_until = max(self._paused_until,
                                             now + (1.0 if retry_after is None else retry_after))
            return before, replica.breaker

    def best(self) -> Replica:
        """The replica in the best state: closed first, then half-open, fewest failures."""
        rank = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
        with self._lock:
            return min(self.replicas, key=lambda r: (rank[r.breaker], r.failures))

    def request(self, method: str, path: str, *, content: bytes | None = None,
                headers: Mapping[str, str] | None = None) -> Sent:
        """One request, synchronous, to the current replica or, while the ones asked are
        unavailable, to the next ones in turn (each at most once); the replica that answers
        stays current. Each round-trip ends within its client's timeout."""
        sent, tried = Sent(None, None), []
        failure = "every replica is benched (unavailable, or asked for a pause: Retry-After)"
        while (picked := self.pick(self.current, self.clock(), tried)) is not None:
            index, replica, is_probe = picked
            sent.moved += bool(tried)
            self.current = index
            tried.append(replica)
            try:
                response = replica.http.request(method, path, content=content, headers=headers)
            except httpx.HTTPError as exc:
                failure = f"{replica.url}: {type(exc).__name__}: {exc}"
                self.record(replica, Verdict.UNAVAILABLE, self.clock(), is_probe=is_probe)
                continue
            verdict = verdict_of(response.status_code)
            header = response.headers.get("retry-after")
            wait = None if header is None else retry_after_s(header)
            if verdict is Verdict.THROTTLED and wait is None:
                wait = retry_after_s(None)
            sent.retry_after |= wait is not None
            self.record(replica, verdict, self.clock(), is_probe=is_probe, retry_after=wait)
            if verdict is Verdict.UNAVAILABLE:
                failure = f"{replica.url}: HTTP {response.status_code}: {response.text[:200]!r}"
                continue
            sent.response, sent.verdict = response, verdict
            break
        sent.tried = len(tried)
        if sent.response is None:
            sent.failure = failure
        return sent

    @property
    def url(self) -> str:
        """The current replica's URL."""
        return self.replicas[self.current].url

    def close(self) -> None:
        for replica in self.replicas:
            replica.http.close()
