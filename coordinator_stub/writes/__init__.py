"""The coordinator's write paths behind one interface, `WritePath`: what the HTTP layer
calls for every write, whichever path the process runs (docs/DESIGN.md, "Coordinator
layout").

- `coordinator_stub.writes.local.LocalWrites`: one process, in memory: `/events` bodies
  through the fair ingest scheduler (`fair_ingest.py`), the registry changed in place.
- `coordinator_stub.writes.replicated.LogReplica` (`--event-log`, the `cluster` extra):
  every write a record of the event log, applied by every replica in log order.

Both validate bodies alike (`validation.py`) and end in `Coordinator.ingest`
(docs/DESIGN.md, "Coordinator ingest"). Both raise the service's refusals
(`coordinator_stub.errors`, `blend_wire.WireError`); a refused write changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from blend_wire import RegisterRequest
    from coordinator_stub.scopes import Scope


class WritePath(Protocol):
    #: Why this process stopped on its own (a replica that can no longer apply its log),
    #: or None.
    failure: str | None

    async def start(self) -> None:
        """Before serving (a replica restores and catches up with its log here)."""

    async def stop(self) -> None:
        """After serving: pending writes are answered or failed; nothing is left running."""

    async def events(self, body: bytes, scope: "Scope") -> bytes:
        """An `/events` body (read, within the byte budget): the reply body. Every batch
        is validated, and checked against `scope`, before the first is applied."""

    async def register(self, request: "RegisterRequest") -> bytes:
        """A decoded `POST /instances` (its scope checked): the reply body."""

    async def heartbeat(self, instance_id: str) -> bool:
        """Whether the instance is registered (False: it must re-register)."""

    async def drop(self, instance_id: str) -> None:
        """Deregister the instance, fence its L1 placements and forget its cursor."""

    async def reap(self, timeout: float) -> None:
        """The reaper's turn: drop instances silent for over `timeout` s, and release
        what ids that are gone and hold nothing still keep."""

    def stats(self) -> dict | None:
        """What `/directory/stats` adds about this path (under `"replica"`), or None."""


__all__ = ["WritePath"]
