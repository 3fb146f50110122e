"""The event log: a NATS JetStream stream every coordinator replica appends to and applies
(docs/DESIGN.md, "Coordinator replicas").

Contract:
- `EventLog(settings)`; `await open()` connects to any of the NATS servers (it follows
  the cluster on its own after that) and creates the stream if it does not exist (one
  subject, `<stream>.records`, file storage, `settings.replicas` copies, retention
  bounded by bytes, messages and age: the oldest records go first). An existing stream
  is used as it is. The wait for NATS is bounded by `settings.connect_timeout_s`
  (`--event-log-connect-timeout`, 30 s): logged when it starts and every 5 s after (not
  per attempt), then `LogUnavailable` naming the servers; cancelling `open()` (a signal
  during start-up) closes what it opened. `await close()` drains the connection.
- `await append(kind, payload, record_id)` returns the stream sequence once JetStream
  acknowledged the record (stored on a quorum of the stream's replicas). `record_id`
  doubles as JetStream's `Nats-Msg-Id`: a retried append inside the duplicate window is
  stored once. Raises `LogUnavailable` when the log cannot take it (no quorum, timeout).
- `read_from(seq)`: an async iterator of lists of `LogRecord`, in stream order, starting
  at stream sequence `seq`, for as long as the caller iterates. It survives losing a
  NATS node or its connection (the consumer is re-created from the next sequence it
  needs; a record lost in delivery is read again). A record the stream no longer holds
  (removed by retention before it was read) raises `LogGap`: the reader cannot go on
  without missing events, never silently.
- `bounds()`: `(first_seq, last_seq)` of the stream now; `created`: when the stream was
  created (a snapshot taken of another stream of the same name must not be resumed).
- `max_record_bytes`: the largest payload a record may carry (the server's max_payload
  less room for headers).
- `jetstream(timeout)`: a JetStream context on the same connection (the snapshot bucket,
  `coordinator_stub.durability.snapshot_stores`, uses it).

A record is `kind` (header `Blend-Kind`), `record_id` (header `Nats-Msg-Id`), an
opaque payload, and `time`: when the stream stored it (epoch seconds, stamped by the
stream's leader and kept with the record, so every reader sees the same value). The log
knows nothing of what records mean (`coordinator_stub.writes.replicated` does). Runs on the event
loop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import NotFoundError

from coordinator_stub.aio import cancel_until_done

log = logging.getLogger(__name__)

KIND_HEADER = "Blend-Kind"
ID_HEADER = "Nats-Msg-Id"
#: Headers and framing take a few hundred bytes of a message.
_HEADER_ROOM = 1024
#: Records fetched per round-trip while reading: as many as fit in about `_FETCH_BYTES`
#: (records of large `/events` bodies are ~1 MB; the server cuts off a client that has too
#: much outstanding), at most `_FETCH_MAX`.
_FETCH_BYTES = 8 << 20
_FETCH_MAX = 256
#: While the log is being opened, a line saying so at most this often (seconds).
_WAIT_LOG_S = 5.0


class LogUnavailable(RuntimeError):
    """The log did not take (or serve) a record in time; the caller may retry."""


class _Redeliver(Exception):
    """A record the stream holds was not delivered: read again from it."""


class LogGap(RuntimeError):
    """Records the reader needed are gone from the stream (retention removed them)."""

    def __init__(self, expected: int, found: int) -> None:
        super().__init__(f"the event log no longer holds records {expected}..{found - 1} "
                         f"(retention removed them before this replica applied them)")
        self.expected, self.found = expected, found


@dataclass(frozen=True)
class LogSettings:
    servers: tuple[str, ...]
    stream: str = "blend-events"
    replicas: int = 1
    max_bytes: int = 1 << 30
    max_msgs: int = 0  # 0: no limit by count
    max_age_s: float = 0.0  # 0: no limit by age
    duplicate_window_s: float = 120.0
    append_timeout_s: float = 5.0
    connect_timeout_s: float = 30.0


@dataclass(frozen=True)
class LogRecord:
    seq: int
    kind: str
    record_id: str
    payload: bytes
    time: float = 0.0  # when the stream stored it, epoch seconds


class EventLog:
    def __init__(self, settings: LogSettings) -> None:
        self.settings = settings
        self.subject = f"{settings.stream}.records"
        self.created: str = ""
        self._nc = None
        self._js = None
        self._closing = False
        self._waiting_since: float | None = None  # loop time the open began, while opening
        self._wait_logged = 0.0
        self._last_error: BaseException | None = None

    # --- lifecycle -------------------------------------------------------------------

    async def open(self) -> None:
        """Connect and make sure the stream exists, within `settings.connect_timeout_s`.

        The wait is logged once when it starts and then every `_WAIT_LOG_S` seconds (not
        per attempt), names the servers and says how long is left; at the deadline it
        raises `LogUnavailable`. Cancelling it (the coordinator got SIGINT/SIGTERM while
        starting) closes the half-open connection and returns promptly."""
        s = self.settings
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + s.connect_timeout_s
        self._last_error = None
        self._waiting_since = started
        self._wait_logged = 0.0
        try:
            while True:
                self._closing = False
                remaining = deadline - loop.time()
                try:
                    if remaining <= 0:
                        raise asyncio.TimeoutError()
                    nc = self._nc = NATS()
                    # nats-py retries the first connection forever when reconnects are
                    # unlimited (as they must be once connected): the deadline bounds it.
                    await _bounded(nc.connect(
                        servers=list(s.servers), connect_timeout=2, reconnect_time_wait=0.5,
                        max_reconnect_attempts=-1, name=f"coordinator_stub:{s.stream}",
                        error_cb=self._error, disconnected_cb=self._disconnected,
                        reconnected_cb=_log_reconnected), remaining)
                    self._js = nc.jetstream(timeout=s.append_timeout_s)
                    info = await _bounded(self._ensure_stream(),
                                          max(deadline - loop.time(), 0.1))
                    break
                except (NatsError, OSError, asyncio.TimeoutError) as exc:
                    if not isinstance(exc, asyncio.TimeoutError) or self._last_error is None:
                        self._last_error = exc  # a timeout says less than what the tries met
                    if self._nc is not None:
                        await self._close_quietly()
                    if loop.time() >= deadline:
                        raise LogUnavailable(
                            f"cannot reach the event log (stream {s.stream!r} at "
                            f"{','.join(s.servers)}) within {s.connect_timeout_s:g} s "
                            f"(--event-log-connect-timeout); last error: {self._last_error!r}. "
                            f"Start the NATS servers first, or check --event-log"
                        ) from None
                    self._log_waiting(self._last_error)
                    await asyncio.sleep(min(0.5, max(deadline - loop.time(), 0)))
        except BaseException:  # cancelled (a signal during start-up), or gave up
            if self._nc is not None:
                await self._close_quietly()
            raise
        finally:
            self._waiting_since = None
        self.created = str(info.created)
        log.info("event log: stream %s (%d copies, records %d..%d) on %s",
                 s.stream, info.config.num_replicas or 1, info.state.first_seq,
                 info.state.last_seq, self._nc.connected_url.netloc
                 if self._nc.connected_url else "?")

    def _log_waiting(self, error: BaseException | None) -> None:
        """While opening: one line when the wait starts, then one every `_WAIT_LOG_S`."""
        if self._waiting_since is None:
            return
        now = asyncio.get_running_loop().time()
        if self._wait_logged and now - self._wait_logged < _WAIT_LOG_S:
            return
        self._wait_logged = now
        left = self.settings.connect_timeout_s - (now - self._waiting_since)
        log.warning("waiting for the event log at %s (%r); giving up in %.0f s",
                    ",".join(self.settings.servers), error, max(left, 0))

    async def _error(self, exc: Exception) -> None:
        if self._waiting_since is not None:  # opening: one line per _WAIT_LOG_S, not per try
            self._last_error = exc
            self._log_waiting(exc)
        else:
            await _log_error(exc)

    async def _ensure_stream(self):
        s = self.settings
        try:
            return await self._js.stream_info(s.stream)
        except NotFoundError:
            pass
        config = api.StreamConfig(
            name=s.stream, subjects=[self.subject], retention=api.RetentionPolicy.LIMITS,
            discard=api.DiscardPolicy.OLD, storage=api.StorageType.FILE,
            num_replicas=s.replicas, max_bytes=s.max_bytes or -1,
            max_msgs=s.max_msgs or -1, max_age=s.max_age_s or None,
            duplicate_window=s.duplicate_window_s)
        await self._js.add_stream(config)
        return await self._js.stream_info(s.stream)

    async def close(self) -> None:
        if self._nc is not None:
            await self._close_quietly()

    async def _disconnected(self) -> None:
        if not self._closing:
            log.warning("NATS: disconnected; reconnecting")

    async def _close_quietly(self) -> None:
        self._closing = True
        nc, self._nc, self._js = self._nc, None, None
        try:
            await nc.close()
        except Exception:  # closing is best effort: the connection may be half gone
            log.debug("closing the NATS connection failed", exc_info=True)

    # --- writing -----------------------------------------------------------------------

    @property
    def max_record_bytes(self) -> int:
        return self._nc.max_payload - _HEADER_ROOM

    async def append(self, kind: str, payload: bytes, record_id: str) -> int:
        try:
            ack = await self._js.publish(self.subject, payload, stream=self.settings.stream,
                                         headers={KIND_HEADER: kind, ID_HEADER: record_id})
        except (NatsError, asyncio.TimeoutError) as exc:
            raise LogUnavailable(f"the event log did not acknowledge the append: "
                                 f"{exc!r}") from exc
        return ack.seq

    def jetstream(self, timeout: float):
        """A JetStream context on this connection whose calls wait up to `timeout` s (the
        snapshot bucket's chunks are MBs: `coordinator_stub.durability.snapshot_stores`)."""
        return self._nc.jetstream(timeout=timeout)

    # --- reading ------------------------------------------------------------------------

    async def bounds(self) -> tuple[int, int]:
        try:
            info = await self._js.stream_info(self.settings.stream)
        except (NatsError, asyncio.TimeoutError) as exc:
            raise LogUnavailable(f"cannot read the event log's bounds: {exc!r}") from exc
        return info.state.first_seq, info.state.last_seq

    async def read_from(self, seq: int) -> AsyncIterator[list[LogRecord]]:
        expected = seq
        record_bytes = 1 << 20  # a running estimate, to size each fetch (cautious at first)
        while True:
            sub = None
            try:
                sub = await self._js.pull_subscribe(
                    self.subject, stream=self.settings.stream, config=api.ConsumerConfig(
                        deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                        opt_start_seq=expected, ack_policy=api.AckPolicy.NONE,
                        inactive_threshold=30.0, mem_storage=True, num_replicas=1))
                idle = 0
                while True:
                    batch = max(1, min(_FETCH_MAX, _FETCH_BYTES // max(record_bytes, 1)))
                    try:
                        msgs = await sub.fetch(batch, timeout=1.0)
                    except asyncio.TimeoutError:
                        idle += 1
                        if idle % 5 == 0:  # is our consumer (and its server) still there?
                            await sub.consumer_info()
                        continue
                    if not msgs:  # a fetch may come back with only status messages
                        continue
                    idle = 0
                    record_bytes = (record_bytes + sum(len(m.data) for m in msgs)
                                    // len(msgs)) // 2
                    records = []
                    for msg in msgs:
                        found = msg.metadata.sequence.stream
                        if found < expected:  # redelivered after a consumer re-creation
                            continue
                        if found > expected:
                            first, _ = await self.bounds()
                            if first > expected:
                                raise LogGap(expected, found)
                            # Still in the stream: lost in delivery (a dropped connection).
                            raise _Redeliver(f"record {expected} was not delivered")
                        headers = msg.headers or {}
                        records.append(LogRecord(
                            found, headers.get(KIND_HEADER, ""), headers.get(ID_HEADER, ""),
                            msg.data, msg.metadata.timestamp.timestamp()))
                        expected = found + 1
                    if records:
                        yield records
            except LogGap:
                raise
            except (NatsError, asyncio.TimeoutError, OSError, _Redeliver) as exc:
                log.warning("event log reader lost its consumer (%r); re-creating it at "
                            "record %d", exc, expected)
                await asyncio.sleep(0.5)
            finally:
                if sub is not None:
                    try:
                        await sub.unsubscribe()
                    except Exception:  # the connection may be reconnecting
                        pass


async def _bounded(step, timeout: float):
    """`step`'s result within `timeout` s, else `asyncio.TimeoutError`; if this is cancelled,
    so is `step`. Not `asyncio.wait_for`: nats-py's connect loop retries on any Exception,
    and a cancellation that meets a failed connection attempt inside its own `wait_for`
    (Python 3.11) is lost, so one cancel may not end it: `cancel_until_done` insists."""
    task = asyncio.ensure_future(step)
    try:
        await asyncio.wait({task}, timeout=timeout)
    except BaseException:
        await cancel_until_done(task)
        raise
    if not task.done():
        await cancel_until_done(task)
        raise asyncio.TimeoutError()
    return task.result()


async def _log_error(exc: Exception) -> None:
    log.warning("NATS: %r", exc)


async def _log_reconnected() -> None:
    log.info("NATS: reconnected")


__all__ = ["EventLog", "LogGap", "LogRecord", "LogSettings", "LogUnavailable"]
