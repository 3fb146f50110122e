"""The coordinator's refusals, raised by the service and both write paths and answered by
the HTTP layer's one error middleware by their own status, reason and headers
(`blend_wire.errors`, docs/DESIGN.md "Refusals"). A refusal changes nothing; its message
says why and, where it can, what to do.

The generic ones are the wire's (`blend_wire.errors`), gathered here with the coordinator's
own, so the layers import their refusals from one place. `blend_wire.WireError` (a body
breaking the wire contract, 422) is the wire's too.
"""

from __future__ import annotations

from blend_wire.errors import (BadRequest, Conflict, Forbidden, Refusal, ServiceUnavailable,
                               ShuttingDown, TooLarge)


class ChunkSizeConflict(Conflict):
    """A chunk size the coordinator cannot bind (409, as LMCache answers). The message says
    why."""

    counted_as = "chunk_size_conflict"


__all__ = ["BadRequest", "ChunkSizeConflict", "Forbidden", "Refusal", "ServiceUnavailable",
           "ShuttingDown", "TooLarge"]
