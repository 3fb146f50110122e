"""The event log's record kinds and how a replica applies them (docs/DESIGN.md,
"Coordinator replicas").

Contract:
- Kinds: `events` (an `/events` body's batches, `{"batches": [...]}`, with
  `"speaks_for": [P, ...]`, the poster's instance scope, when it had one), `register` (a
  `POST /instances` body with its id assigned), `beats` (a JSON list of ids heard from),
  `drop` (an instance id), `reap` (`{"timeout": s, "ids": [...]}`). `payloads(raws,
  batches, limit, speaks_for)` cuts validated batches into `events` payloads of at most
  `limit` bytes.
- `RecordApplier.apply(records)`, on the one apply thread, in stream order: every record
  whole or not at all, deterministic (a record that cannot be applied is skipped alike on
  every replica), by log time (`log_time`: the largest record time seen), never a local
  clock but for the replica's own half of reaping (`coordinator_stub.writes.liveness`).
  Its result per record id: the reply value, or the exception that refused it.
- `decoded`: `(batches, speaks_for)` the replica decoded when it validated a body it took,
  by record id; applied from there instead of decoding the record again.
"""

from __future__ import annotations

import logging
from typing import Callable

import msgspec

from blend_wire import CacheEventBatch, RegisterRequest, WireError, decode, encode
from coordinator_stub.durability.eventlog import LogRecord
from coordinator_stub.errors import TooLarge
from coordinator_stub.scopes import Scope
from coordinator_stub.writes.liveness import Liveness

log = logging.getLogger(__name__)

EVENTS = "events"
REGISTER = "register"
BEATS = "beats"
DROP = "drop"
REAP = "reap"

class EventsRecord(msgspec.Struct):
    batches: list[CacheEventBatch]
    # The instance ids and prefixes the poster's token speaks for (a shared pool's
    # placement another reporter holds changes only if they name it); None: any.
    speaks_for: list[str] | None = None


class Reap(msgspec.Struct):
    timeout: float
    # The ids the proposing replica found silent by its own monotonic clock; None (a
    # record from an older build): every id silent by log time.
    ids: list[str] | None = None


_UNKNOWN = object()


class RecordApplier:
    """A replica's state machine over the log: the coordinator's directory and registry,
    changed only by records."""

    def __init__(self, coordinator, liveness: Liveness,
                 on_reaped: Callable[[int], None] | None = None) -> None:
        self.coordinator = coordinator
        self.liveness = liveness
        self._on_reaped = on_reaped or (lambda count: None)
        self.log_time = 0.0  # the latest record's stream time
        self.in_directory = 0  # stream sequence of the last record applied
        self.records_rejected = 0
        self.decoded: dict[str, list] = {}

    def apply(self, records: list[LogRecord]) -> list[tuple[str, object]]:
        """On the apply thread: every record, in order. Deterministic: a record that
        cannot be applied is skipped alike on every replica."""
        results = []
        for record in records:
            self.in_directory = record.seq  # records are applied whole (or skipped)
            self.log_time = max(self.log_time, record.time)
            try:
                reply = self._apply(record)
            except WireError as exc:
                self.records_rejected += 1
                log.error("log record %d is not a valid %s record (%s); skipped",
                          record.seq, record.kind, exc)
                continue
            except Exception as exc:  # nothing of the record applied (all or nothing)
                self.records_rejected += 1
                log.exception("log record %d could not be applied; skipped", record.seq)
                results.append((record.record_id, exc))
                continue
            if reply is _UNKNOWN:
                self.records_rejected += 1
                log.error("log record %d has unknown kind %r; skipped", record.seq,
                          record.kind)
                continue
            results.append((record.record_id, reply))
        return results

    def _apply(self, record: LogRecord) -> object:
        coordinator = self.coordinator
        if record.kind == EVENTS:
            held = self.decoded.pop(record.record_id, None)
            if held is None:
                events = decode(record.payload, EventsRecord)
                held = events.batches, events.speaks_for
            batches, speaks_for = held
            return coordinator.ingest(batches, None if speaks_for is None
                                      else Scope(instances=tuple(speaks_for)))
        if record.kind == REGISTER:
            request = decode(record.payload, RegisterRequest)
            reply = coordinator.admit(request, at=self.log_time)
            self.liveness.heard(request.instance_id)
            return reply
        if record.kind == BEATS:
            now = self.liveness.clock()
            for instance_id in decode(record.payload, list[str]):
                if coordinator.heartbeat(instance_id, at=self.log_time):
                    self.liveness.heard(instance_id, now)
            return None
        if record.kind == DROP:
            self.depart(record.payload.decode())
            return None
        if record.kind == REAP:
            reap = decode(record.payload, Reap)
            timeout = reap.timeout
            reaped = coordinator.silent(timeout, now=self.log_time)
            if reap.ids is not None:  # both clocks must agree (docs/DESIGN.md)
                proposed = set(reap.ids)
                reaped = [instance_id for instance_id in reaped if instance_id in proposed]
            for instance_id in reaped:
                log.info("instance %s silent for over %g s of log time (record %d): "
                         "deregistered, L1 fenced", instance_id, timeout, record.seq)
                self.depart(instance_id)
            if reaped:
                self._on_reaped(len(reaped))
            # Ids not registered that hold nothing, idle across reap records: released.
            coordinator.release_ghosts(timeout, now=self.log_time)
            return reaped
        return _UNKNOWN

    def depart(self, instance_id: str) -> None:
        self.liveness.forget(instance_id)
        self.coordinator.depart(instance_id)


def payloads(raws: list[msgspec.Raw], batches: list, limit: int,
             speaks_for: tuple[str, ...] | None = None):
    """`({"batches": [...]}` payload, its decoded batches) of at most `limit` bytes each,
    batches in order; each payload says `speaks_for` (a scope's instances) when given."""
    opening = (b'{"batches":[' if speaks_for is None else
               b'{"speaks_for":' + encode(list(speaks_for)) + b',"batches":[')
    limit -= len(opening) - len(b'{"batches":[')
    group: list[bytes] = []
    decoded: list = []
    size = 0
    for raw, batch in zip(raws, batches):
        raw = bytes(raw)
        if len(raw) + 16 > limit:
            raise TooLarge(
                f"a batch of {len(raw)} bytes exceeds the event log's largest record "
                f"({limit} bytes: the NATS server's max_payload); send smaller batches or "
                "raise max_payload")
        if group and size + len(raw) + 16 > limit:
            yield opening + b",".join(group) + b"]}", decoded
            group, decoded, size = [], [], 0
        group.append(raw)
        decoded.append(batch)
        size += len(raw) + 1
    if group:
        yield opening + b",".join(group) + b"]}", decoded
