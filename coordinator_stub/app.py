"""HTTP layer: the aiohttp application serving WIRE.md's endpoints.

Contract:
- `create_app(config)` builds the application; `app[COORDINATOR]` is its `Coordinator`
  (tests use it to reach the directory, e.g. to enable blend lookup mid-life).
- The event loop only moves bytes. Every blocking step (validation, the directory lock,
  matching) runs on a worker thread:
  * ingest on ONE scheduler thread (`coordinator_stub.ingest`): bodies are validated and
    applied a batch at a time, emitters taking turns, so one client's flood delays
    another's batch by at most one batch's work; per instance, batches apply in order.
    Request bytes in flight are bounded: a body that does not fit is answered 503 with
    `Retry-After` before it is read;
  * lookups on `match_workers` threads (one by default: the index serialises matches
    under its own lock, so a second matcher only adds lock and GIL hand-offs), so a long
    query stalls neither ingest nor `/healthz` (which never leaves the loop). A lookup
    body of at most 256 KiB (~48k tokens) has its JSON shape validated on the loop first;
    the matcher thread decodes its tokens (a GIL-free kernel) and matches. Larger bodies
    are validated on the matcher thread too;
  * stats on asyncio's default pool: they wait for the directory lock, never a match.
- Errors: a body breaking the wire contract -> 422 `{"error": "<what and where>"}`; a body
  over `max_body_bytes` or a query over `max_query_tokens` -> 413; a body that cannot be
  read (corrupt gzip/deflate, unknown content encoding, broken chunking) -> 400; a body
  not complete within `body_timeout_s` of its headers -> 408. None affects other
  requests or the state, and none is a 500.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import AsyncIterator, Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from coordinator_stub.access import access_middleware
from coordinator_stub.config import CoordinatorConfig
from coordinator_stub.connections import ConnectionGuard, connection_cap
from coordinator_stub.service import Coordinator, TooLarge
from blend_wire import BLEND_LOOKUP_PATH, EVENTS_PATH, HEALTH_PATH, STATS_PATH, WireError, encode


COORDINATOR = web.AppKey("coordinator", Coordinator)
#: Caps open connections when the app is served through it (`python -m coordinator_stub`).
CONNECTIONS = web.AppKey("connections", ConnectionGuard)
_MATCH_POOL = web.AppKey("match_pool", concurrent.futures.ThreadPoolExecutor)

_JSON = "application/json"
#: Lookup bodies up to this size (about 48k tokens) are parsed on the loop.
_INLINE_PARSE_BYTES = 256 * 1024
_HEALTHY = encode({"status": "ok"})


#: Seconds a client refused for load should wait before retrying.
RETRY_AFTER_S = 1


class _Busy(Exception):
    """Too much in flight right now (-> 503 with Retry-After)."""


class _Unreadable(Exception):
    """A body that cannot be read as sent (-> 400, or 408 for `timed_out`)."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.status = 408 if timed_out else 400


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=encode({"error": message}), content_type=_JSON)


async def _read_body(request: web.Request) -> bytes:
    limit = request.app[COORDINATOR].config.max_body_bytes
    declared = request.content_length
    if declared is not None and declared > limit:
        # Refuse on the declared length, without reading (and buffering) the body at all.
        raise TooLarge(f"body of {declared} bytes exceeds {limit} (--max-body-bytes)")
    timeout = request.app[COORDINATOR].config.body_timeout_s
    try:
        # A body without a declared length is cut off at the app's client_max_size (after
        # decompression, so a gzip bomb stops there too). A body trickling in is cut off
        # after `timeout`: it would otherwise hold its connection and buffer for ever.
        async with asyncio.timeout(timeout):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise TooLarge(f"body exceeds {limit} bytes (--max-body-bytes)") from None
    except TimeoutError:
        raise _Unreadable(f"body not received within {timeout:g} s (--body-timeout)",
                          timed_out=True) from None
    except (HttpProcessingError, web.RequestPayloadError) as exc:
        # Corrupt gzip/deflate, an encoding we cannot decode, broken chunked framing.
        cause = exc.__cause__ if isinstance(exc.__cause__, HttpProcessingError) else exc
        message = getattr(cause, "message", "") or str(cause)
        raise _Unreadable(f"body cannot be read: {message}".strip()) from None


def _answers_errors(handler: Callable[[web.Request], Awaitable[bytes]]
                    ) -> Callable[[web.Request], Awaitable[web.Response]]:
    """Turn a handler's reply body, or its refusal, into the HTTP response."""
    async def respond(request: web.Request) -> web.Response:
        try:
            reply = await handler(request)
        except WireError as exc:
            return _error(422, str(exc))
        except TooLarge as exc:
            return _error(413, str(exc))
        except _Unreadable as exc:
            return _error(exc.status, str(exc))
        except _Busy as exc:
            response = _error(503, str(exc))
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            return response
        return web.Response(body=reply, content_type=_JSON)
    return respond


def _run(request: web.Request, pool: web.AppKey | None, work: Callable[..., bytes],
         *args) -> Awaitable[bytes]:
    executor = request.app[pool] if pool is not None else None  # None: asyncio's default
    return asyncio.get_running_loop().run_in_executor(executor, work, *args)


@_answers_errors
async def _events(request: web.Request) -> bytes:
    coordinator = request.app[COORDINATOR]
    config = coordinator.config
    # Reserve before reading: a body that does not fit is never buffered. Without a
    # declared length, or compressed, it may grow to the body limit.
    declared = request.content_length
    if declared is not None and declared > config.max_body_bytes:
        await _read_body(request)  # refuses it (413) on the declared length, unread
    size = (declared if declared is not None and not request.headers.get("Content-Encoding")
            else config.max_body_bytes)
    release = coordinator.ingest_budget.try_reserve(size)
    if release is None:
        raise _Busy(f"ingest is saturated ({config.max_ingest_bytes} request bytes in "
                    f"flight, --max-ingest-bytes); retry after {RETRY_AFTER_S} s")
    try:
        body = await _read_body(request)
        return await asyncio.wrap_future(coordinator.submit_events(body))
    finally:
        release()


@_answers_errors
async def _blend_lookup(request: web.Request) -> bytes:
    coordinator = request.app[COORDINATOR]
    body = await _read_body(request)
    if len(body) > _INLINE_PARSE_BYTES:
        return await _run(request, _MATCH_POOL, coordinator.lookup, body)
    # A small body's shape is validated right here (microseconds); the matcher thread
    # decodes its tokens without the GIL and matches, so the loop keeps serving.
    return await _run(request, _MATCH_POOL, coordinator.answer,
                      coordinator.parse_lookup(body))


@_answers_errors
async def _stats(request: web.Request) -> bytes:
    # asyncio's default pool: stats wait for the directory lock, never for a match.
    return await _run(request, None, request.app[COORDINATOR].stats)


async def _health(request: web.Request) -> web.Response:
    return web.Response(body=_HEALTHY, content_type=_JSON)


async def _worker_pools(app: web.Application) -> AsyncIterator[None]:
    """Threads live exactly as long as the running app."""
    config = app[COORDINATOR].config
    app[COORDINATOR].ingest_queue.start()
    app[_MATCH_POOL] = concurrent.futures.ThreadPoolExecutor(
        config.match_workers, thread_name_prefix="match")
    yield
    app[_MATCH_POOL].shutdown(wait=True, cancel_futures=True)
    app[COORDINATOR].ingest_queue.close()


def create_app(config: CoordinatorConfig | None = None) -> web.Application:
    """The coordinator as an aiohttp application (not yet started)."""
    config = config or CoordinatorConfig()
    app = web.Application(client_max_size=config.max_body_bytes)
    app[COORDINATOR] = Coordinator(config)
    app[CONNECTIONS] = ConnectionGuard(connection_cap(config.max_connections))
    app.middlewares.append(app[CONNECTIONS].middleware)
    if config.access_tokens:  # opt-in; checked before any handler reads a body
        app.middlewares.insert(0, access_middleware(config.access_tokens))
    app.cleanup_ctx.append(_worker_pools)
    app.router.add_post(EVENTS_PATH, _events)
    app.router.add_post(BLEND_LOOKUP_PATH, _blend_lookup)
    app.router.add_get(STATS_PATH, _stats)
    app.router.add_get(HEALTH_PATH, _health)
    return app
