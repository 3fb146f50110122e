"""The instance registry: which MP servers are in the fleet, and when each last spoke.

Contract (WIRE.md, "Instances"; LMCache 0.5.6's `InstanceRegistry`):
- `register(request)` inserts or replaces the whole record (a re-registration counts as
  a heartbeat and keeps the instance's place in the listing); an empty `instance_id` is
  assigned `"mp-" + 32 hex` (`with_instance_id`). Returns `(instance_id, re_registered)`.
- `heartbeat(id)` -> False for an unknown id (the caller answers 404, the server
  re-registers); `deregister(id)` -> whether it was registered (either way the caller
  answers 204).
- `listing()` and `ids()` in registration order; `silent(timeout)`: ids whose last heartbeat (or
  registration) is more than `timeout` seconds old.
- Time: one process on its own reads its clocks (registration time by the wall clock,
  silence by the monotonic clock, so a wall clock step cannot reap a live fleet).
  Replicas over an event log (`coordinator_stub.writes.replicated`) pass `at`/`now`, the log's
  time, instead: then every replica fed the same records holds the same registry, down
  to registration times, and reaps the same instances at the same record.
- Thread-safe (one lock, held for O(1) work, or O(instances) for `listing`/`silent`): a
  replica's apply thread writes it while the event loop answers heartbeats and listings.
  Pickles without its lock (snapshots); `restore_from` takes another registry's records.

Membership only: fencing a departed instance's placements is the key directory's job
(`KeyDirectory.drop_instance`), which the caller runs after `deregister`. Registration
and ingest are independent: events from an unregistered id are fine.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import msgspec

from blend_wire import InstanceInfo, InstancesReply, RegisterRequest


@dataclass
class _Instance:
    info: InstanceInfo
    last_heard: float  # monotonic seconds, or the log's time (replicas)


def with_instance_id(request: RegisterRequest) -> RegisterRequest:
    """The request with its `instance_id`, assigned (`"mp-" + 32 hex`) when empty."""
    if request.instance_id:
        return request
    return msgspec.structs.replace(request, instance_id=f"mp-{uuid.uuid4().hex}")


class InstanceRegistry:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._clock, self._wall_clock = clock, wall_clock
        self._instances: dict[str, _Instance] = {}
        self._lock = threading.Lock()

    def register(self, request: RegisterRequest, *, at: float | None = None
                 ) -> tuple[str, bool]:
        request = with_instance_id(request)
        info = InstanceInfo(instance_id=request.instance_id, ip=request.ip,
                            http_port=request.http_port,
                            registration_time=self._wall_clock() if at is None else at,
                            metadata=dict(request.metadata),
                            p2p_advertised_url=request.p2p_advertised_url,
                            mq_port=request.mq_port)
        heard = self._clock() if at is None else at
        with self._lock:
            re_registered = request.instance_id in self._instances
            self._instances[request.instance_id] = _Instance(info, heard)
        return request.instance_id, re_registered

    def heartbeat(self, instance_id: str, *, at: float | None = None) -> bool:
        heard = self._clock() if at is None else at
        with self._lock:
            instance = self._instances.get(instance_id)
            if instance is None:
                return False
            instance.last_heard = max(instance.last_heard, heard)
            return True

    def deregister(self, instance_id: str) -> bool:
        with self._lock:
            return self._instances.pop(instance_id, None) is not None

    def listing(self) -> InstancesReply:
        with self._lock:
            return InstancesReply(instances=[i.info for i in self._instances.values()])

    def ids(self) -> list[str]:
        """Registered instance ids, in registration order."""
        with self._lock:
            return list(self._instances)

    def silent(self, timeout: float, *, now: float | None = None) -> list[str]:
        now = self._clock() if now is None else now
        with self._lock:
            return [instance_id for instance_id, instance in self._instances.items()
                    if now - instance.last_heard > timeout]

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._instances)

    def restore_from(self, other: "InstanceRegistry") -> None:
        """Take `other`'s records (a loaded snapshot, or an empty registry) in place."""
        with self._lock:
            self._instances = dict(other._instances)

    def __getstate__(self) -> dict:
        with self._lock:
            state = dict(vars(self), _instances=dict(self._instances))
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._instances)

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._instances
