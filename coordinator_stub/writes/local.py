"""The `WritePath` of one coordinator process holding everything in memory
(`coordinator_stub.writes`): `/events` bodies through the fair ingest scheduler
(`fair_ingest.py`) into `Coordinator.ingest`, the registry changed in place.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Callable

from blend_wire import encode
from coordinator_stub.scopes import Scope
from coordinator_stub.writes.fair_ingest import FairIngest

log = logging.getLogger(__name__)


class LocalWrites:
    """The `WritePath` of one coordinator process holding everything in memory: `/events`
    bodies go through the coordinator's `FairIngest`, the registry changes in place, and
    what takes the directory lock (registering, fencing, releasing) runs off the loop."""

    failure: str | None = None  # one process never stops on its own

    def __init__(self, coordinator, on_reaped: Callable[[int], None] | None = None) -> None:
        self.coordinator = coordinator  # a coordinator_stub.service.coordinator.Coordinator
        self.ingest_queue = FairIngest(coordinator.ingest)
        self._on_reaped = on_reaped or (lambda count: None)

    async def start(self) -> None:
        self.ingest_queue.start()

    async def stop(self) -> None:
        self.ingest_queue.close()

    async def events(self, body: bytes, scope: Scope) -> bytes:
        return await asyncio.wrap_future(self.submit(body, scope))

    def submit(self, body: bytes, scope: Scope | None = None) -> concurrent.futures.Future:
        """Queue an `/events` body; the future's result is the reply body (`bytes`), or
        the refusal (`WireError`, `Forbidden` for a batch outside `scope`): nothing of the
        body applied."""
        reply: concurrent.futures.Future = concurrent.futures.Future()

        def done(job: concurrent.futures.Future) -> None:
            error = job.exception()
            if error is not None:
                reply.set_exception(error)
            else:
                reply.set_result(encode(job.result().reply()))
        self.ingest_queue.submit(body, None if scope is None or scope.unrestricted else scope
                                 ).add_done_callback(done)
        return reply

    async def register(self, request) -> bytes:
        # A chunk size it carries is bound, and its L1 readmitted, under the directory lock.
        return await _off_loop(self.coordinator.register, request)

    async def heartbeat(self, instance_id: str) -> bool:
        return self.coordinator.heartbeat(instance_id)

    async def drop(self, instance_id: str) -> None:
        """Deregister, then fence the instance's L1 and forget its cursor (off the loop: it
        takes the directory lock, between two batches). A client that waits for its last
        `/events` reply before deregistering (LMCache's servers do) has it applied first."""
        self.coordinator.deregister(instance_id)
        await _off_loop(self.coordinator.drop_instance, instance_id)

    async def reap(self, timeout: float) -> None:
        for instance_id in self.coordinator.silent(timeout):
            log.info("instance %s silent for over %.0f s: deregistered, L1 fenced",
                     instance_id, timeout)
            await self.drop(instance_id)
            self._on_reaped(1)
        released = await _off_loop(self.coordinator.release_ghosts, timeout)
        if released:
            log.info("%d unregistered ids holding nothing, silent for over %.0f s: their "
                     "ingest cursors and capacity rows released", len(released), timeout)

    def stats(self) -> None:
        return None


def _off_loop(work: Callable, *args):
    """`work(*args)` on asyncio's default pool."""
    return asyncio.get_running_loop().run_in_executor(None, work, *args)
