"""HTTP layer: the aiohttp application serving WIRE.md's endpoints.

Contract:
- `create_app(config)` builds the application; `app[COORDINATOR]` is its `Coordinator`
  (tests use it to reach the directory, e.g. to enable blend lookup mid-life).
- The event loop only moves bytes and runs O(1) bookkeeping (the instance registry,
  `/healthz`). Every blocking step (validation of large bodies, the directory lock,
  matching) runs on a worker thread:
  * ingest on ONE scheduler thread (`coordinator_stub.writes.local`): bodies are validated and
    applied a batch at a time, emitters fairly queued by bytes, so however many clients
    flood, another's batch waits for at most the batch step already running; per
    instance, batches apply in order. Request bytes in flight are bounded: a body that
    does not fit is answered 503 with `Retry-After` before it is read. When the last
    of a burst (64 MiB or more) has gone, the freed heap is given back to the OS
    (`give_back_memory`) on asyncio's default pool;
  * blend lookups and blend scores on `match_workers` threads (one by default: the index serialises
    matches under its own lock, so a second matcher only adds lock and GIL hand-offs),
    so a long query stalls neither ingest nor `/healthz`; readers (a bearer token, or a
    client address without access control) take turns there by start-time fair
    queuing on query bytes (`coordinator_stub.service.matchpool`), so one reader's huge
    queries delay another's small one by at most the lookup running. A lookup body of at most
    256 KiB (~48k tokens) has its JSON shape validated on the loop first; the matcher
    thread decodes its tokens (a GIL-free kernel) and matches. Larger bodies are
    validated on the matcher thread too;
  * stats, directory queries, metrics scrapes and fencing a departed instance on
    asyncio's default pool: they never wait for a match (fencing takes the directory
    lock between two batches, like a batch).
- Background work is one pattern: an asyncio task owned by the app's lifecycle
  (`cleanup_ctx`), cancelled on shutdown. The only one is the reaper: every
  `health_check_interval` seconds (0: never) it deregisters instances silent for more
  than `instance_timeout` and fences their L1 placements, as `DELETE /instances/{id}`,
  and releases the ingest cursor and capacity rows of ids that are not registered, hold
  no placement and sent no batch for as long (ids that never registered, or stopped).
  With `--event-log` the registry lives in the log (`coordinator_stub.writes.replicated`):
  registrations, heartbeats, departures and the reaper's decisions go through the
  replica, which applies them on every replica at the same point of the stream.
- Errors, in LMCache's shapes: a request breaking the wire contract -> 422
  `{"detail": [{"type", "loc", "msg", "input"}]}`; a token lookup naming what no key can
  carry -> 400 `{"detail": "<why>"}`; a body over `max_body_bytes` or a query over
  `max_query_tokens` -> 413; a request outside its token's scope (`coordinator_stub.http.access`)
  -> 403; a body that cannot be read (corrupt gzip/deflate, unknown
  content encoding, broken chunking) -> 400; a body not complete within `body_timeout_s`
  of its headers -> 408 (these three with `Connection: close`: the rest of the body
  cannot be framed); ingest saturated -> 503 with `Retry-After` (these
  `{"detail": "<why>"}`); a heartbeat of an unknown id -> 404
  `{"error": "unknown instance <id>; re-register"}`. None changes any state, and none
  is a 500.
- `/metrics` (Prometheus text) unless `enable_metrics` is off (then 404).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from coordinator_stub.http.access import Forbidden, access_middleware, scope_of
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
    STATS_PATH,
    BlendLookupReply,
    BlendScoreRequest,
    HealthReply,
    HeartbeatReply,
    WireError,
    encode,
)
from coordinator_stub.config import CoordinatorConfig
from coordinator_stub.http.connections import ConnectionGuard, connection_cap
from coordinator_stub.writes.local import give_back_memory
from coordinator_stub.service.matchpool import FairPool
from coordinator_stub.http.metrics import CONTENT_TYPE, CoordinatorMetrics
from coordinator_stub.service.coordinator import (BadRequest, ChunkSizeConflict, Coordinator,
                                      ServiceUnavailable, TooLarge)

log = logging.getLogger(__name__)

COORDINATOR = web.AppKey("coordinator", Coordinator)
METRICS = web.AppKey("metrics", CoordinatorMetrics)  # absent with metrics off
#: Caps open connections when the app is served through it (`python -m coordinator_stub`).
CONNECTIONS = web.AppKey("connections", ConnectionGuard)
_MATCH_POOL = web.AppKey("match_pool", FairPool)
#: The replica applying the event log (`--event-log`), or None for one in-memory process.
REPLICA = web.AppKey("replica", object)

T = TypeVar("T")
_JSON = "application/json"
#: Lookup bodies up to this size (about 48k tokens) are parsed on the loop.
_INLINE_PARSE_BYTES = 256 * 1024
_HEALTHY = encode(HealthReply())


#: Seconds a client refused for load should wait before retrying.
RETRY_AFTER_S = 1


class _Busy(Exception):
    """Too much in flight right now (-> 503 with Retry-After)."""


class _Unreadable(Exception):
    """A body that cannot be read as sent (-> 400, or 408 for `timed_out`)."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.status = 408 if timed_out else 400


def _detail(status: int, detail, reason: str, request: web.Request) -> web.Response:
    metrics = request.app.get(METRICS)
    if metrics is not None:
        metrics.rejected(reason)
    return web.Response(status=status, body=encode({"detail": detail}), content_type=_JSON)


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
        async with asyncio.timeout(timeout):
            body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise TooLarge(f"body exceeds {limit} bytes ({limit_name})") from None
    except TimeoutError:
        raise _Unreadable(f"body not received within {timeout:g} s (--body-timeout)",
                          timed_out=True) from None
    except (HttpProcessingError, web.RequestPayloadError) as exc:
        # Corrupt gzip/deflate, an encoding we cannot decode, broken chunked framing.
        cause = exc.__cause__ if isinstance(exc.__cause__, HttpProcessingError) else exc
        message = getattr(cause, "message", "") or str(cause)
        raise _Unreadable(f"body cannot be read: {message}".strip()) from None
    if len(body) > limit:  # sent without a length, or compressed
        raise TooLarge(f"body exceeds {limit} bytes ({limit_name})")
    return body


def _closing(response: web.Response) -> web.Response:
    """A refusal of a body not read to its end (too large, undecodable, too slow): what
    is left of it on the connection cannot be framed, so the reply says `Connection:
    close` and the connection is closed after it (the client opens a new one) rather
    than reset under the client's next request."""
    response.force_close()
    return response


def _answers_errors(handler: Callable[[web.Request], Awaitable[bytes]]
                    ) -> Callable[[web.Request], Awaitable[web.Response]]:
    """Turn a handler's reply body, or its refusal, into the HTTP response."""
    async def respond(request: web.Request) -> web.Response:
        try:
            reply = await handler(request)
        except WireError as exc:
            return _detail(422, exc.detail, "validation", request)
        except BadRequest as exc:
            return _detail(400, str(exc), "bad_request", request)
        except Forbidden as exc:
            return _detail(403, str(exc), "forbidden", request)
        except TooLarge as exc:
            return _closing(_detail(413, str(exc), "too_large", request))
        except ChunkSizeConflict as exc:
            return _detail(409, str(exc), "chunk_size_conflict", request)
        except _Unreadable as exc:
            return _closing(_detail(exc.status, str(exc), "unreadable", request))
        except (_Busy, ServiceUnavailable) as exc:
            response = _detail(503, str(exc), "busy", request)
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            return response
        return web.Response(body=reply, content_type=_JSON)
    return respond


def _reader_of(request: web.Request) -> tuple[str, str | None]:
    """Whose turn a lookup takes at the matcher: its bearer token when access control is
    on (checked by then: a client cannot make up readers), else the client's address."""
    if request.app[COORDINATOR].config.access_tokens:
        return "token", request.headers.get("Authorization", "")
    return "peer", request.remote


def _run(request: web.Request, pool: web.AppKey | None, work: Callable[..., T],
         *args) -> Awaitable[T]:
    executor = request.app[pool] if pool is not None else None  # None: asyncio's default
    return asyncio.get_running_loop().run_in_executor(executor, work, *args)


# --- events and lookups ------------------------------------------------------------------


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
        replica = request.app[REPLICA]
        scope = scope_of(request)
        if replica is not None:  # appended to the event log, then applied from it
            return await replica.submit_events(body, scope)
        return await asyncio.wrap_future(coordinator.submit_events(body, scope))
    finally:
        release()
        if coordinator.ingest_budget.burst_over():
            # Once this handler is done (its body freed), off the loop.
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.run_in_executor, None, give_back_memory)


@_answers_errors
async def _blend_lookup(request: web.Request) -> bytes:
    coordinator = request.app[COORDINATOR]
    started = time.perf_counter()
    body = await _read_body(request)
    scope = scope_of(request)
    # Readers take turns at the matcher, by query size (coordinator_stub.service.matchpool).
    pool, reader = request.app[_MATCH_POOL], _reader_of(request)
    if len(body) > _INLINE_PARSE_BYTES:
        job = pool.submit(reader, len(body), coordinator.lookup, body, scope)
    else:
        # A small body's shape is validated right here (microseconds); the matcher thread
        # decodes its tokens without the GIL and matches, so the loop keeps serving.
        job = pool.submit(reader, len(body), coordinator.matches,
                          coordinator.parse_lookup(body, scope=scope))
    reply = await asyncio.wrap_future(job)
    metrics = request.app.get(METRICS)
    if metrics is not None:
        found = (len(reply.matches) if type(reply) is BlendLookupReply
                 else sum(len(content.positions) for content in reply.candidates))
        metrics.observe_lookup("blend-lookup", time.perf_counter() - started, found)
    return encode(reply)


@_answers_errors
async def _blend_score(request: web.Request) -> bytes:
    """As `_blend_lookup`, on the match pool: scoring is a candidates lookup and then the
    selection per instance (CPU-bound)."""
    coordinator = request.app[COORDINATOR]
    started = time.perf_counter()
    body = await _read_body(request)
    scope = scope_of(request)  # a router's token may be scoped to salts, as a reader's
    pool, reader = request.app[_MATCH_POOL], _reader_of(request)  # turns, as lookups
    if len(body) > _INLINE_PARSE_BYTES:
        job = pool.submit(reader, len(body), coordinator.score, body, scope)
    else:
        job = pool.submit(reader, len(body), coordinator.scores,
                          coordinator.parse_lookup(body, BlendScoreRequest, scope))
    reply = await asyncio.wrap_future(job)
    metrics = request.app.get(METRICS)
    if metrics is not None:
        metrics.observe_lookup("blend-score", time.perf_counter() - started)
    return encode(reply)


@_answers_errors
async def _directory_lookup(request: web.Request) -> bytes:
    started = time.perf_counter()
    body = await _read_body(request)
    reply = await _run(request, None, request.app[COORDINATOR].directory_lookup, body)
    metrics = request.app.get(METRICS)
    if metrics is not None:
        metrics.observe_lookup("directory-lookup", time.perf_counter() - started)
    return reply


@_answers_errors
async def _directory_keys(request: web.Request) -> bytes:
    return await _run(request, None, request.app[COORDINATOR].directory_keys,
                      dict(request.query))


@_answers_errors
async def _stats(request: web.Request) -> bytes:
    reply = await _run(request, None, request.app[COORDINATOR].stats)
    replica = request.app[REPLICA]
    if replica is not None:  # where this replica is in the log (an extra key of ours)
        reply = encode({**msgspec.json.decode(reply), "replica": replica.stats()})
    return reply


async def _health(request: web.Request) -> web.Response:
    return web.Response(body=_HEALTHY, content_type=_JSON)


async def _metrics(request: web.Request) -> web.Response:
    metrics = request.app.get(METRICS)
    if metrics is None:
        raise web.HTTPNotFound(text="metrics are disabled (--disable-metrics)")
    body = await asyncio.get_running_loop().run_in_executor(None, metrics.render)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


# --- the instance registry -----------------------------------------------------------------


@_answers_errors
async def _register(request: web.Request) -> bytes:
    coordinator = request.app[COORDINATOR]
    body = await _read_body(request, MAX_REGISTRATION_BODY_BYTES,
                            "the registration body limit, WIRE.md")
    # Decoded (and checked against the token's scope) off the loop.
    registration = await _run(request, None, coordinator.parse_register, body,
                              scope_of(request))
    replica = request.app[REPLICA]
    if replica is not None:  # through the log: every replica registers it alike
        await _run(request, None, coordinator.check_registration, registration)
        return await replica.submit_register(registration)
    # Off the loop: a chunk size it carries is bound, and its L1 readmitted, under the
    # directory lock.
    return await _run(request, None, coordinator.register, registration)


@_answers_errors
async def _bind_chunk_size(request: web.Request) -> bytes:
    """LMCache 0.5.7's `PUT /config/chunk-size` (service.py). Servers call it, so it is an
    emitter's; the size binds the whole fleet, so not one held to some instances or salts."""
    if not scope_of(request).unrestricted:
        raise Forbidden("binding the fleet's chunk size needs an emitter token with no "
                        "instances= or salts= scope: it applies to every tenant")
    body = await _read_body(request)
    return await _run(request, None, request.app[COORDINATOR].bind_chunk_size, body)


def _outside_scope(request: web.Request, instance_id: str) -> web.Response | None:
    """403 when the token may not speak for `instance_id` (heartbeat, deregister)."""
    try:
        scope_of(request).check_instance(instance_id, "the path's instance id")
    except Forbidden as exc:
        return _detail(403, str(exc), "forbidden", request)
    return None


async def _heartbeat(request: web.Request) -> web.Response:
    instance_id = request.match_info["instance_id"]
    refused = _outside_scope(request, instance_id)
    if refused is not None:
        return refused
    replica = request.app[REPLICA]
    known = (await replica.heartbeat(instance_id) if replica is not None
             else request.app[COORDINATOR].heartbeat(instance_id))
    if not known:
        return web.Response(status=404, content_type=_JSON, body=encode(
            {"error": f"unknown instance {instance_id}; re-register"}))
    return web.Response(body=encode(HeartbeatReply(instance_id=instance_id)),
                        content_type=_JSON)


async def _deregister(request: web.Request) -> web.Response:
    instance_id = request.match_info["instance_id"]
    refused = _outside_scope(request, instance_id)
    if refused is not None:
        return refused
    try:
        await _drop(request.app, instance_id)
    except ServiceUnavailable as exc:  # the event log could not take it: nothing changed
        return _detail(503, str(exc), "busy", request)
    return web.Response(status=204)


async def _instances(request: web.Request) -> web.Response:
    # Encoded off the loop: the listing grows with the fleet (up to 16 KiB of metadata
    # per instance).
    body = await _run(request, None, request.app[COORDINATOR].instances_listing)
    return web.Response(body=body, content_type=_JSON)


async def _drop(app: web.Application, instance_id: str) -> None:
    """Deregister, then fence the instance's L1 and forget its cursor (off the loop: it
    takes the directory lock, between two batches). A client that waits for its last
    `/events` reply before deregistering (LMCache's servers do) has it applied first."""
    coordinator = app[COORDINATOR]
    replica = app[REPLICA]
    if replica is not None:  # through the log, so every replica drops it at the same point
        await replica.submit_drop(instance_id)
        return
    coordinator.deregister(instance_id)
    await asyncio.get_running_loop().run_in_executor(
        None, coordinator.drop_instance, instance_id)


# --- lifecycle -------------------------------------------------------------------------------


async def _worker_pools(app: web.Application) -> AsyncIterator[None]:
    """Threads live exactly as long as the running app."""
    config = app[COORDINATOR].config
    app[COORDINATOR].ingest_queue.start()
    app[_MATCH_POOL] = FairPool(config.match_workers, "match")
    yield
    app[_MATCH_POOL].shutdown(wait=True, cancel_futures=True)
    app[COORDINATOR].ingest_queue.close()


async def _reaper(app: web.Application) -> AsyncIterator[None]:
    """The background task that reaps silent instances, for the life of the app."""
    config = app[COORDINATOR].config
    task = None
    if config.health_check_interval > 0:
        task = asyncio.create_task(_reap_forever(app, config.health_check_interval,
                                                 config.instance_timeout))
    yield
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _reap_forever(app: web.Application, interval: float, timeout: float) -> None:
    coordinator = app[COORDINATOR]
    replica = app[REPLICA]
    while True:
        await asyncio.sleep(interval)
        try:
            if replica is not None:  # a `reap` record decides, by log time, on every replica
                await replica.reap(timeout)
                continue
            for instance_id in coordinator.instances.silent(timeout):
                log.info("instance %s silent for over %.0f s: deregistered, L1 fenced",
                         instance_id, timeout)
                await _drop(app, instance_id)
                metrics = app.get(METRICS)
                if metrics is not None:
                    metrics.reaped()
            released = await asyncio.get_running_loop().run_in_executor(
                None, coordinator.release_ghosts, timeout)
            if released:
                log.info("%d unregistered ids holding nothing, silent for over %.0f s: "
                         "their ingest cursors and capacity rows released", len(released),
                         timeout)
        except ServiceUnavailable as exc:  # the event log cannot take the record now
            log.warning("reaping silent instances deferred to the next interval: %s", exc)
        except Exception:  # never let one bad sweep end the reaper
            log.exception("reaping silent instances failed; retrying next interval")


async def _replica_lifecycle(app: web.Application) -> AsyncIterator[None]:
    """With `--event-log`: restore and catch up before serving; snapshot on the way out."""
    replica = app[REPLICA]
    try:
        await replica.start()
    except BaseException:  # cancelled by a signal during start-up, or it failed
        await asyncio.shield(replica.stop(snapshot=False))
        raise
    yield
    await replica.stop()


def create_app(config: CoordinatorConfig | None = None) -> web.Application:
    """The coordinator as an aiohttp application (not yet started). With blend lookup on,
    this compiles every kernel first (see `Coordinator`), so a started app is ready."""
    config = config or CoordinatorConfig()
    app = web.Application(client_max_size=config.max_body_bytes)
    coordinator = app[COORDINATOR] = Coordinator(config)
    app[CONNECTIONS] = ConnectionGuard(connection_cap(config.max_connections))
    app.middlewares.append(app[CONNECTIONS].middleware)
    if config.access_tokens:  # opt-in; checked before any handler reads a body
        app.middlewares.insert(0, access_middleware(config.access_tokens))
    if config.enable_metrics:
        app[METRICS] = CoordinatorMetrics(coordinator.directory,
                                          lambda: len(coordinator.instances))
    app.cleanup_ctx.append(_worker_pools)
    app.cleanup_ctx.append(_reaper)
    app[REPLICA] = None
    if config.cluster is not None:
        from coordinator_stub.writes.replicated import LogReplica  # needs the `cluster` extra (nats-py)
        metrics = app.get(METRICS)
        app[REPLICA] = LogReplica(app[COORDINATOR], config.cluster, config.port,
                                  on_reaped=metrics.reaped if metrics is not None else None)
        app.cleanup_ctx.append(_replica_lifecycle)
    app.router.add_post(EVENTS_PATH, _events)
    app.router.add_post(BLEND_LOOKUP_PATH, _blend_lookup)
    app.router.add_post(BLEND_SCORE_PATH, _blend_score)
    app.router.add_post(DIRECTORY_LOOKUP_PATH, _directory_lookup)
    app.router.add_get(DIRECTORY_KEYS_PATH, _directory_keys)
    app.router.add_get(STATS_PATH, _stats)
    app.router.add_get(HEALTH_PATH, _health)
    app.router.add_get(METRICS_PATH, _metrics)
    app.router.add_post(INSTANCES_PATH, _register)
    app.router.add_get(INSTANCES_PATH, _instances)
    app.router.add_put(INSTANCES_PATH + "/{instance_id}/heartbeat", _heartbeat)
    app.router.add_delete(INSTANCES_PATH + "/{instance_id}", _deregister)
    app.router.add_put(CHUNK_SIZE_PATH, _bind_chunk_size)
    return app
