"""A clock step on one host cannot reap the fleet (issue 19, item 6).

Before: replicas reaped by the log's time alone (the stream leader's clock stamps every
record), so a forward step of the NATS host's clock past `--instance-timeout` made every
instance whose beats had not been logged since the step silent at the next `reap`
record: most of the fleet was deregistered and fenced. Now the proposing replica names,
in the `reap` record, the ids it has not heard of for over the timeout by its own
monotonic clock, and an id is dropped only when the log's time agrees: both clocks must
say it is silent. A dead instance is still reaped, at one record, alike everywhere.

The replica here runs its apply path and its reaper without a NATS server: the records
it would read are built with the stream times a stepped clock would stamp, and what it
appends is captured and applied the same way.
"""

from __future__ import annotations

import itertools

from blend_wire import RegisterRequest, encode
from coordinator_stub.config import ClusterConfig, CoordinatorConfig
from coordinator_stub.durability.eventlog import LogRecord
from coordinator_stub.writes.replicated import BEATS, REAP, REGISTER, LogReplica
from coordinator_stub.service.coordinator import Coordinator
from helpers import FakeClock

LANE = "unit"

TIMEOUT = 30.0


class _CapturedLog:
    """Stands in for the stream's append: keeps what the replica appends."""

    def __init__(self) -> None:
        self.appended: list[tuple[str, bytes]] = []

    async def append(self, kind: str, payload: bytes, record_id: str) -> None:
        self.appended.append((kind, payload))


async def test_a_forward_step_of_the_log_hosts_clock_reaps_only_the_silent():
    cluster = ClusterConfig(servers=("nats://127.0.0.1:4222",), apply_timeout_s=0.01)
    config = CoordinatorConfig(instance_timeout=TIMEOUT, cluster=cluster)
    replica = LogReplica(Coordinator(config), cluster, port=0)
    clock = FakeClock(0.0)
    replica.liveness.clock = clock  # the replica's monotonic clock
    replica.log = captured = _CapturedLog()
    seqs = itertools.count(1)

    def stream(kind: str, payload: bytes, at: float) -> None:
        replica.applier.apply([LogRecord(seq=next(seqs), kind=kind, record_id="r",
                                          payload=payload, time=at)])

    try:
        for name in ("live-1", "live-2", "dead"):
            stream(REGISTER, encode(RegisterRequest(instance_id=name, ip="10.0.0.1",
                                                    http_port=8000)), 5000.0)
        await replica.reap(TIMEOUT)  # the reaper's first look: nobody is overdue
        assert captured.appended == []
        clock.advance(20)
        stream(BEATS, encode(["live-1", "live-2"]), 5020.0)
        clock.advance(20)  # dead: 40 s silent here; the live ones 20 s
        # The NATS host's clock jumps an hour ahead: the next record is stamped +3600 s.
        # live-2's next beat is not logged yet (beats are logged every timeout/3).
        stream(BEATS, encode(["live-1"]), 8620.0)
        await replica.reap(TIMEOUT)
        [(kind, payload)] = [(k, p) for k, p in captured.appended if k == REAP]
        stream(kind, payload, 8621.0)
        listed = replica.coordinator.instances.listing().instances
        assert [i.instance_id for i in listed] == ["live-1", "live-2"]
        # And live-2 is still one heartbeat away from being logged, not re-registering.
        assert await replica.heartbeat("live-2")
    finally:
        replica._apply.shutdown()
        replica._validate.shutdown()
