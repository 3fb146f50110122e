"""How many instance ids a scoped token may bring into the coordinator (docs/OPERATIONS.md,
"Access control"): registrations and `/events` emitters together, per scope.

Every id costs memory while the coordinator keeps it (a registry record, a gate cursor,
placements, series in `/metrics`), and an emitter scoped to a prefix (`instances=srv-*`) or
only to salts could make up as many as it likes. `InstanceQuota.admit(scope, id)` counts the
ids each scope brought in; past `cap` (`--max-instances-per-scope`) a new one is refused
(`OverQuota`, 429) once the scope's ids the coordinator no longer keeps (not registered,
no cursor, no placement: `live` says) are let go. An unscoped token (an operator's, or
LMCache's servers' with access control off) is not counted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from blend_wire import RETRY_AFTER_S
from coordinator_stub.errors import Forbidden
from coordinator_stub.scopes import Scope


class OverQuota(Forbidden):
    """A scope's instance ids are at their cap: 429, with `Retry-After` the instance
    timeout, after which a silent id holding nothing is let go. A `Forbidden`, so a write
    path refusing a batch outside its token's scope refuses this one alike."""

    status = 429
    counted_as = "instance_cap"

    def __init__(self, reason: str, *, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(reason, headers={"Retry-After": str(retry_after_s)})


class InstanceQuota:
    def __init__(self, cap: int, live: Callable[[str], bool],
                 retry_after_s: int = RETRY_AFTER_S) -> None:
        self.cap = cap  # 0: no cap
        self._live = live
        self.retry_after_s = retry_after_s  # what a refused scope is told to wait
        self._ids: dict[tuple, set[str]] = {}
        self._lock = threading.Lock()
        self.refused = 0

    def admit(self, scope: Scope, instance_id: str, where: str) -> None:
        """Count `instance_id` for `scope` (nothing for an unscoped one), or `OverQuota`."""
        if self.cap <= 0 or scope.unrestricted:
            return
        with self._lock:
            ids = self._ids.setdefault((scope.instances, scope.salts), set())
            if instance_id in ids:
                return
            if len(ids) >= self.cap:  # let go of what the coordinator no longer keeps
                ids.difference_update([i for i in ids if not self._live(i)])
            if len(ids) >= self.cap:
                self.refused += 1
                raise OverQuota(
                    f"this token's scope already has {len(ids)} instance ids in the "
                    f"coordinator, its cap (--max-instances-per-scope {self.cap}); "
                    f"{instance_id[:100]!r} ({where}) is refused until some of them leave "
                    "(deregistered, or silent past --instance-timeout and holding nothing)",
                    retry_after_s=self.retry_after_s)
            ids.add(instance_id)

    def counted(self) -> int:
        """Instance ids counted for every scope together."""
        with self._lock:
            return sum(len(ids) for ids in self._ids.values())


@dataclass(frozen=True)
class CappedScope(Scope):
    """A scope whose `/events` batches also count their emitter against `quota`."""

    quota: InstanceQuota | None = field(default=None, compare=False)

    def check_batch(self, batch, index: int) -> None:
        super().check_batch(batch, index)
        if self.quota is not None:
            self.quota.admit(self, batch.instance_id, f"$.batches[{index}].instance_id")


def capped(scope: Scope, quota: InstanceQuota) -> Scope:
    """`scope` with its `/events` emitters counted (an unscoped one as it is)."""
    if scope.unrestricted or quota.cap <= 0:
        return scope
    return CappedScope(scope.instances, scope.salts, quota)


__all__ = ["CappedScope", "InstanceQuota", "OverQuota", "capped"]
