"""The service's refusals: raised by the service and both write paths, mapped to a status
and reason by the HTTP layer's one error middleware (docs/WIRE.md, "Validation errors").
A refusal changes nothing; its message says why and, where it can, what to do.
`blend_wire.WireError` (a body breaking the wire contract, 422) is the wire's own.
"""

from __future__ import annotations


class BadRequest(Exception):
    """A well-formed request the coordinator cannot serve (-> 400), as LMCache answers
    a token lookup whose names could not form a key. The message says why."""


class Forbidden(Exception):
    """A request outside its token's scope (-> 403). The message names what was refused."""


class ChunkSizeConflict(Exception):
    """A chunk size the coordinator cannot bind (-> 409). The message says why."""


class TooLarge(Exception):
    """A request beyond a configured limit (-> 413). The message says which limit."""


class ServiceUnavailable(Exception):
    """A write the coordinator cannot take right now, e.g. its event log has no quorum, or
    ingest is saturated (-> 503 with Retry-After). The message says why."""


__all__ = ["BadRequest", "ChunkSizeConflict", "Forbidden", "ServiceUnavailable", "TooLarge"]
