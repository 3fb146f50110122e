"""The plugin's one HTTP policy: how the coordinator client and the reporter talk to it.

The rest of its contract: docs/CONTRACTS.md, `plugin.http`.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import threading
import time
from typing import Iterable, Iterator

import httpcore
import httpx

from blend_wire import is_loopback_host

__all__ = ["DeadlineTransport", "coordinator_http"]

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
    (docs/CONTRACTS.md, `plugin.http`)."""

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
