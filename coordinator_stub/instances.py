"""The instance registry: which MP servers are in the fleet, and when each last spoke.

Contract (WIRE.md, "Instances"; LMCache 0.5.6's `InstanceRegistry`):
- `register(request)` inserts or replaces the whole record (a re-registration counts as
  a heartbeat and keeps the instance's place in the listing); an empty `instance_id` is
  assigned `"mp-" + 32 hex`. Returns `(instance_id, re_registered)`.
- `heartbeat(id)` -> False for an unknown id (the caller answers 404, the server
  re-registers); `deregister(id)` -> whether it was registered (either way the caller
  answers 204).
- `listing()` in registration order; `silent(timeout)`: ids whose last heartbeat (or
  registration) is more than `timeout` seconds old, by the monotonic clock, so a wall
  clock step cannot reap a live fleet.

Membership only: fencing a departed instance's placements is the key directory's job
(`KeyDirectory.drop_instance`), which the HTTP layer runs after `deregister`. Used from
the event loop only (every operation is O(1) but `listing` and `silent`), so it needs no
lock. Registration and ingest are independent: events from an unregistered id are fine.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Callable

from blend_wire import InstanceInfo, InstancesReply, RegisterRequest


@dataclass
class _Instance:
    info: InstanceInfo
    last_heard: float  # monotonic seconds


class InstanceRegistry:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._clock, self._wall_clock = clock, wall_clock
        self._instances: dict[str, _Instance] = {}

    def register(self, request: RegisterRequest) -> tuple[str, bool]:
        instance_id = request.instance_id or f"mp-{uuid.uuid4().hex}"
        info = InstanceInfo(instance_id=instance_id, ip=request.ip,
                            http_port=request.http_port,
                            registration_time=self._wall_clock(),
                            metadata=dict(request.metadata),
                            p2p_advertised_url=request.p2p_advertised_url,
                            mq_port=request.mq_port)
        re_registered = instance_id in self._instances
        self._instances[instance_id] = _Instance(info, self._clock())
        return instance_id, re_registered

    def heartbeat(self, instance_id: str) -> bool:
        instance = self._instances.get(instance_id)
        if instance is None:
            return False
        instance.last_heard = self._clock()
        return True

    def deregister(self, instance_id: str) -> bool:
        return self._instances.pop(instance_id, None) is not None

    def listing(self) -> InstancesReply:
        return InstancesReply(instances=[i.info for i in self._instances.values()])

    def silent(self, timeout: float) -> list[str]:
        now = self._clock()
        return [instance_id for instance_id, instance in self._instances.items()
                if now - instance.last_heard > timeout]

    def __len__(self) -> int:
        return len(self._instances)

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._instances
