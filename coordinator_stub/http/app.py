"""HTTP layer: the aiohttp application serving docs/WIRE.md's endpoints (structure:
docs/DESIGN.md, "Coordinator layout").

Contract:
- `create_app(config)` builds the application; `app[COORDINATOR]` is its `Coordinator`
  (tests use it to reach the directory), `app[WRITES]` its write path
  (`coordinator_stub.writes.WritePath`: local, or the event log with `--event-log`).
- Handlers read the body (within `max_body_bytes` and `body_timeout_s`; `/events` bodies
  also within the byte budget, `coordinator_stub.http.budget`), then hand the request to
  the service or the write path and answer its reply. The event loop only moves bytes and
  runs O(1) bookkeeping; what blocks runs on worker threads: blend lookups and scores on
  the readers' fair pool (`coordinator_stub.service.matchpool`, `match_workers` threads;
  a body of at most 256 KiB has its shape validated on the loop first), everything else
  on asyncio's default pool, ingest on its own scheduler thread.
- One error middleware answers every refusal (`blend_wire.Refusal`: `coordinator_stub.errors`,
  `blend_wire.WireError`, DESIGN.md "Refusals") by its own status, reason and headers, in
  LMCache's shapes: 422 `{"detail": [...]}` for a body breaking the wire contract; 400
  (`BadRequest`, or a body that cannot be read), 403 (`Forbidden`), 408 (body too slow),
  409 (`ChunkSizeConflict`), 413 (`TooLarge`), 429 (`OverQuota`) and 503 (`ServiceUnavailable`;
  `ShuttingDown`: `IngestClosed`, `PoolClosed`) with `Retry-After`, all `{"detail":
  "<why>"}`; 400/408/413 with `Connection: close` (the rest of the body cannot be framed).
  A heartbeat of an unknown id: 404. Each refusal is counted under
  `rejected_requests{reason}` (its class's `counted_as`); none changes state, none is a 500.
- Routes: `ROUTES`, each declared once with its role (`coordinator_stub.http.access`).
- Background work: asyncio tasks owned by the app's lifecycle (`cleanup_ctx`); the only
  one is the reaper (every `health_check_interval` s, 0: never), which calls the write
  path's `reap(instance_timeout)`.
- `/metrics` (Prometheus text) unless `enable_metrics` is off (then 404).
"""

from __future__ import annotations

import asyncio
import contextlib
from functools import partial
import logging
import time
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from blend_wire import (
    BLEND_LOOKUP_PATH,
    BLEND_SCORE_PATH,
    CHUNK_SIZE_PATH,
    DIRECTORY_KEYS_PATH,
    DIRECTORY_LOOKUP_PATH,
    EVENTS_PATH,
    HEALTH_PATH,
    INSTANCES_PATH,
    MAX_REGISTRATION_BODY_BYTES,
    METRICS_PATH,
    RETRY_AFTER_S,
    STATS_PATH,
    BlendLookupReply,
    BlendScoreRequest,
    HealthReply,
    HeartbeatReply,
    RequestTimeout,
    encode,
    uints_in,
)
from coordinator_stub.config import CoordinatorConfig
from coordinator_stub.errors import BadRequest, Forbidden, Refusal, ServiceUnavailable, TooLarge
from coordinator_stub.http.access import (ANYONE, Route, access_middleware, add_routes,
                                          caller_of, lists_instances, scope_of)
from coordinator_stub.http.budget import ByteBudget
from coordinator_stub.memory import TRIM_DELAY_S, give_back_memory
from coordinator_stub.http.connections import ConnectionGuard, connection_cap
from coordinator_stub.http.metrics import CONTENT_TYPE, CoordinatorMetrics
from coordinator_stub.scopes import ADMIN, EMITTER, READER
from coordinator_stub.service.coordinator import Coordinator
from coordinator_stub.service.matchpool import ClientGone, FairPool
from coordinator_stub.writes import WritePath
from coordinator_stub.writes.local import LocalWrites
from local_matcher import IndexBusy

log = logging.getLogger(__name__)

COORDINATOR = web.AppKey("coordinator", Coordinator)
#: The write path: `LocalWrites`, or the event log's `LogReplica` with `--event-log`.
WRITES = web.AppKey("writes", WritePath)
METRICS = web.AppKey("metrics", CoordinatorMetrics)  # absent with metrics off
#: Caps open connections when the app is served through it (`python -m coordinator_stub`).
CONNECTIONS = web.AppKey("connections", ConnectionGuard)
_MATCH_POOL = web.AppKey("match_pool", FairPool)
#: `/events` request bytes in flight (reserved before a body is read).
_BUDGET = web.AppKey("ingest_budget", ByteBudget)

T = TypeVar("T")
_JSON = "application/json"
#: Lookup bodies up to this size (about 48k tokens) are parsed on the loop.
_INLINE_PARSE_BYTES = 256 * 1024
#: Lookup bodies up to this size (about 18k tokens, well under a millisecond of matching)
#: are matched on the loop while the match pool is idle (`_matched`).
_INLINE_MATCH_BYTES = 96 * 1024
_HEALTHY = encode(HealthReply())


class _Unreadable(BadRequest):
    """A body that cannot be read as sent: corrupt gzip, broken chunked framing (400)."""

    counted_as = "unreadable"
    closes_connection = True


@web.middleware
async def _refusals(request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
    """The one place a refusal becomes an answer, by its own status, `{"detail"}` and
    headers, counted under its `counted_as` (docs/DESIGN.md, "Refusals"); `Connection:
    close` after a body not read to its end. aiohttp's own HTTP errors pass; any other
    exception is a bug, and aiohttp answers it 500."""
    try:
        return await handler(request)
    except Refusal as refusal:
        metrics = request.app.get(METRICS)
        if metrics is not None:
            metrics.rejected(refusal.counted_as)
        response = web.Response(status=refusal.status, body=encode({"detail": refusal.detail}),
                                content_type=_JSON, headers=refusal.headers)
        if refusal.closes_connection:
            response.force_close()
        return response


def _json(body: bytes) -> web.Response:
    return web.Response(body=body, content_type=_JSON)


async def _read_body(request: web.Request, limit: int | None = None,
                     limit_name: str = "--max-body-bytes") -> bytes:
    """The request's body, at most `limit` bytes (default: the app's body limit)."""
    limit = limit or request.app[COORDINATOR].config.max_body_bytes
    declared = request.content_length
    if declared is not None and declared > limit:
        # Refuse on the declared length, without reading (and buffering) the body at all.
        raise TooLarge(f"body of {declared} bytes exceeds {limit} ({limit_name})")
    timeout = request.app[COORDINATOR].config.body_timeout_s
    try:
        # A body without a declared length is cut off at the app's client_max_size (after
        # decompression, so a gzip bomb stops there too). A body trickling in is cut off
        # after `timeout`: it would otherwise hold its connection and buffer for ever.
        if request.content.is_eof():  # all of it is here already: no timer to arm
            body = await request.read()
        else:
            async with asyncio.timeout(timeout):
                body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise TooLarge(f"body exceeds {limit} bytes ({limit_name})") from None
    except TimeoutError:
        raise RequestTimeout(f"body not received within {timeout:g} s (--body-timeout)"
                             ) from None
    except (HttpProcessingError, web.RequestPayloadError) as exc:
        # Corrupt gzip/deflate, an encoding we cannot decode, broken chunked framing.
        cause = exc.__cause__ if isinstance(exc.__cause__, HttpProcessingError) else exc
        message = getattr(cause, "message", "") or str(cause)
        raise _Unreadable(f"body cannot be read: {message}".strip()) from None
    if len(body) > limit:  # sent without a length, or compressed
        raise TooLarge(f"body exceeds {limit} bytes ({limit_name})")
    return body


def _reader_of(request: web.Request) -> tuple[str, object]:
    """Whose turn a lookup takes at the matcher: its bearer token when access control is
    on (checked by then: a client cannot make up readers; the token itself, not how the
    header spells it), else the client's address."""
    caller = caller_of(request)
    if caller is not None:
        return "token", caller
    return "peer", request.remote


def _run(work: Callable[..., T], *args) -> Awaitable[T]:
    """`work(*args)` on asyncio's default executor: a cold request kept off the loop."""
    return asyncio.get_running_loop().run_in_executor(None, work, *args)


# --- events and lookups ------------------------------------------------------------------


async def _events(request: web.Request) -> web.Response:
    config = request.app[COORDINATOR].config
    budget = request.app[_BUDGET]
    # Reserve before reading: a body that does not fit is never buffered. Without a
    # declared length, or compressed, it may grow to the body limit.
    declared = request.content_length
    if declared is not None and declared > config.max_body_bytes:
        await _read_body(request)  # refuses it (413) on the declared length, unread
    size = (declared if declared is not None and not request.headers.get("Content-Encoding")
            else config.max_body_bytes)
    release = budget.try_reserve(size)
    if release is None:
        raise ServiceUnavailable(
            f"ingest is saturated ({config.max_ingest_bytes} request bytes in flight, "
            f"--max-ingest-bytes); retry after {RETRY_AFTER_S} s")
    try:
        body = await _read_body(request)
        coordinator = request.app[COORDINATOR]
        return _json(await request.app[WRITES].events(body,
                                                      coordinator.capped(scope_of(request))))
    finally:
        release()
        if budget.burst_over():
            asyncio.get_running_loop().call_later(TRIM_DELAY_S, _give_back_if_over, budget)


def _give_back_if_over(budget: ByteBudget) -> None:
    """A while after a burst seemed over (its last bodies freed, a tail that followed
    included): still nothing in flight, so give memory back, off the loop."""
    if budget.burst_over():
        budget.trimmed()
        asyncio.get_running_loop().run_in_executor(None, give_back_memory)


async def _matched(request: web.Request, parse: Callable, answer: Callable,
                   whole: Callable):
    """The reply value of a blend-lookup or blend-score body: `answer(parse(body, scope))`,
    or `whole(body, scope)` when the body is too large to parse on the loop.

    While the match pool has nothing to do, a small body is answered right here on the
    loop: handing it to a worker thread and back costs more CPU than matching it. Any
    other lookup takes its reader's turn on the pool (`service.matchpool`), and so does
    one that would wait for ingest writing the index: the loop never waits for it."""
    body = await _read_body(request)
    scope = scope_of(request)
    pool = request.app[_MATCH_POOL]
    reader = _reader_of(request)
    query = None
    if len(body) <= _INLINE_MATCH_BYTES and pool.idle:
        query = parse(body, scope=scope)
        try:
            return answer(query, wait=False)
        except IndexBusy:
            pass
    # Queued work whose client has gone (a router that gave up on its budget) is dropped
    # when a worker reaches it, not matched for nobody.
    submit = partial(pool.submit_async, reader, len(body), wanted=partial(_connected, request))
    try:
        if len(body) > _INLINE_PARSE_BYTES:
            return await submit(whole, body, scope)
        # The shape is validated on the loop (microseconds); the worker decodes the tokens
        # without the GIL and matches, so the loop keeps serving.
        return await submit(answer, parse(body, scope=scope) if query is None else query)
    except ClientGone:
        raise _ClientClosed() from None


class _ClientClosed(web.HTTPClientError):
    """The answer to a lookup dropped because its client left (nobody reads it)."""

    status_code = 499


def _connected(request: web.Request) -> bool:
    """The request's client is still connected (read from a worker thread: a moment
    stale at worst, which only runs one lookup more)."""
    transport = request.transport
    return transport is not None and not transport.is_closing()


async def _blend_lookup(request: web.Request) -> web.Response:
    coordinator = request.app[COORDINATOR]
    started = time.perf_counter()
    reply = await _matched(request, coordinator.parse_lookup, coordinator.matches,
                           coordinator.lookup)
    metrics = request.app.get(METRICS)
    if metrics is not None:
        found = (len(reply.matches) if type(reply) is BlendLookupReply
                 else uints_in(reply.columns.positions) if reply.columns is not None
                 else sum(len(content.positions) for content in reply.candidates))
        metrics.observe_lookup("blend-lookup", time.perf_counter() - started, found)
    return _json(encode(reply))


async def _blend_score(request: web.Request) -> web.Response:
    """As `_blend_lookup` (a router's token may be scoped to salts, as a reader's): scoring
    is a candidates lookup and then the selection per instance (CPU-bound)."""
    coordinator = request.app[COORDINATOR]
    started = time.perf_counter()
    everyone = lists_instances(request)  # else only instances holding some of it
    reply = await _matched(request, partial(coordinator.parse_lookup, shape=BlendScoreRequest),
                           partial(coordinator.scores, everyone=everyone),
                           partial(coordinator.score, everyone=everyone))
    metrics = request.app.get(METRICS)
    if metrics is not None:
        metrics.observe_lookup("blend-score", time.perf_counter() - started)
    return _json(encode(reply))


async def _directory_lookup(request: web.Request) -> web.Response:
    started = time.perf_counter()
    body = await _read_body(request)
    reply = await _run(request.app[COORDINATOR].directory_lookup, body)
    metrics = request.app.get(METRICS)
    if metrics is not None:
        metrics.observe_lookup("directory-lookup", time.perf_counter() - started)
    return _json(reply)


async def _directory_keys(request: web.Request) -> web.Response:
    return _json(await _run(request.app[COORDINATOR].directory_keys, dict(request.query)))


async def _stats(request: web.Request) -> web.Response:
    reply = await _run(request.app[COORDINATOR].stats)
    extra = request.app[WRITES].stats()
    if extra is not None:  # where this replica is in the log (an extra key of ours)
        reply = encode({**msgspec.json.decode(reply), "replica": extra})
    return _json(reply)


async def _health(request: web.Request) -> web.Response:
    return _json(_HEALTHY)


async def _metrics(request: web.Request) -> web.Response:
    metrics = request.app.get(METRICS)
    if metrics is None:
        raise web.HTTPNotFound(text="metrics are disabled (--disable-metrics)")
    body = await asyncio.get_running_loop().run_in_executor(None, metrics.render)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


# --- the instance registry -----------------------------------------------------------------


async def _register(request: web.Request) -> web.Response:
    body = await _read_body(request, MAX_REGISTRATION_BODY_BYTES,
                            "the registration body limit, WIRE.md")
    # Decoded (and checked against the token's scope) off the loop.
    registration = await _run(request.app[COORDINATOR].parse_register, body,
                              scope_of(request))
    return _json(await request.app[WRITES].register(registration))


async def _bind_chunk_size(request: web.Request) -> web.Response:
    """LMCache 0.5.7's `PUT /config/chunk-size` (service.coordinator). Servers call it, so
    it is an emitter's; the size binds the whole fleet, so not one held to some instances
    or salts."""
    if not scope_of(request).unrestricted:
        raise Forbidden("binding the fleet's chunk size needs an emitter token with no "
                        "instances= or salts= scope: it applies to every tenant")
    body = await _read_body(request)
    return _json(await _run(request.app[COORDINATOR].bind_chunk_size, body))


def _path_instance(request: web.Request) -> str:
    """The path's instance id, if the token may speak for it (else `Forbidden`)."""
    instance_id = request.match_info["instance_id"]
    scope_of(request).check_instance(instance_id, "the path's instance id")
    return instance_id


async def _heartbeat(request: web.Request) -> web.Response:
    instance_id = _path_instance(request)
    if not await request.app[WRITES].heartbeat(instance_id):
        return web.Response(status=404, content_type=_JSON, body=encode(
            {"error": f"unknown instance {instance_id}; re-register"}))
    return _json(encode(HeartbeatReply(instance_id=instance_id)))


async def _deregister(request: web.Request) -> web.Response:
    await request.app[WRITES].drop(_path_instance(request))
    return web.Response(status=204)


async def _instances(request: web.Request) -> web.Response:
    # Encoded off the loop: the listing grows with the fleet (up to 16 KiB of metadata
    # per instance).
    return _json(await _run(request.app[COORDINATOR].instances_listing))


# --- lifecycle -------------------------------------------------------------------------------


async def _worker_pools(app: web.Application) -> AsyncIterator[None]:
    """Threads live exactly as long as the running app."""
    app[_MATCH_POOL] = FairPool(app[COORDINATOR].config.match_workers, "match")
    yield
    app[_MATCH_POOL].shutdown(wait=True, cancel_futures=True)


async def _write_path(app: web.Application) -> AsyncIterator[None]:
    """The write path's life: a replica restores and catches up with its log before the
    app serves, and snapshots on the way out."""
    await app[WRITES].start()
    yield
    await app[WRITES].stop()


async def _reaper(app: web.Application) -> AsyncIterator[None]:
    """The background task that reaps silent instances, for the life of the app."""
    config = app[COORDINATOR].config
    task = None
    if config.health_check_interval > 0:
        task = asyncio.create_task(_reap_forever(app[WRITES], config.health_check_interval,
                                                 config.instance_timeout))
    yield
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _reap_forever(writes: WritePath, interval: float, timeout: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await writes.reap(timeout)
        except ServiceUnavailable as exc:  # the event log cannot take the record now
            log.warning("reaping silent instances deferred to the next interval: %s", exc)
        except Exception:  # never let one bad sweep end the reaper
            log.exception("reaping silent instances failed; retrying next interval")


def _writes_of(coordinator: Coordinator, metrics: CoordinatorMetrics | None) -> WritePath:
    on_reaped = metrics.reaped if metrics is not None else None
    config = coordinator.config
    if config.cluster is None:
        return LocalWrites(coordinator, on_reaped=on_reaped)
    from coordinator_stub.writes.replicated import LogReplica  # the `cluster` extra (nats-py)
    return LogReplica(coordinator, config.cluster, config.port, on_reaped=on_reaped)


#: Every route the coordinator serves, each with the role a token needs to call it (docs/
#: WIRE.md, "Access control"; enforced with access control on). Servers' writes are an
#: emitter's (`PUT /config/chunk-size` too: servers call it), lookups a reader's, the
#: directory queries, stats and metrics an admin's.
ROUTES = (
    Route("POST", EVENTS_PATH, _events, EMITTER),
    Route("POST", BLEND_LOOKUP_PATH, _blend_lookup, READER),
    Route("POST", BLEND_SCORE_PATH, _blend_score, READER),
    Route("POST", DIRECTORY_LOOKUP_PATH, _directory_lookup, ADMIN),
    Route("GET", DIRECTORY_KEYS_PATH, _directory_keys, ADMIN),
    Route("GET", STATS_PATH, _stats, ADMIN),
    Route("GET", HEALTH_PATH, _health, ANYONE),
    Route("GET", METRICS_PATH, _metrics, ADMIN),
    Route("POST", INSTANCES_PATH, _register, EMITTER),
    Route("GET", INSTANCES_PATH, _instances, EMITTER),
    Route("PUT", INSTANCES_PATH + "/{instance_id}/heartbeat", _heartbeat, EMITTER),
    Route("DELETE", INSTANCES_PATH + "/{instance_id}", _deregister, EMITTER),
    Route("PUT", CHUNK_SIZE_PATH, _bind_chunk_size, EMITTER),
)


def create_app(config: CoordinatorConfig | None = None) -> web.Application:
    """The coordinator as an aiohttp application (not yet started). With blend lookup on,
    this compiles every kernel first (see `Coordinator`), so a started app is ready."""
    config = config or CoordinatorConfig()
    app = web.Application(client_max_size=config.max_body_bytes)
    coordinator = app[COORDINATOR] = Coordinator(config)
    app[_BUDGET] = ByteBudget(config.max_ingest_bytes)
    app[CONNECTIONS] = ConnectionGuard(connection_cap(config.max_connections))
    app.middlewares.append(app[CONNECTIONS].middleware)
    if config.access_tokens:  # opt-in; checked before any handler reads a body
        app.middlewares.insert(0, access_middleware(config.access_tokens))
    app.middlewares.append(_refusals)
    if config.enable_metrics:
        app[METRICS] = CoordinatorMetrics(coordinator.directory,
                                          lambda: len(coordinator.instances), coordinator.quota)
    app[WRITES] = _writes_of(coordinator, app.get(METRICS))
    app.cleanup_ctx.append(_worker_pools)
    app.cleanup_ctx.append(_write_path)
    app.cleanup_ctx.append(_reaper)
    add_routes(app, ROUTES)
    return app
