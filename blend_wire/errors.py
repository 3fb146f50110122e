"""Refusals: the requests a server of this project answers with a 4xx or 503, one hierarchy
for the coordinator and the router (docs/DESIGN.md, "Refusals").

A `Refusal` carries what its answer needs: its class's HTTP `status`, its `reason` (the
message: what was refused and, where it can, what to do) and any `headers` (`Retry-After`).
Each server turns any refusal into its answer in one place, by these alone: the coordinator's
error middleware (`coordinator_stub.http.app`), the router's request handler
(`blend_router.app`). A refusal changes nothing on the server. An exception that is not a
refusal reaching a server's edge is a bug, answered 500.

The classes are named for their status, as HTTP names it; a server's own refusals subclass
them where the server counts them apart (`counted_as`, the coordinator's
`rejected_requests{reason}` label) or where their name says more (`WireError`, a body
breaking the wire contract).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import ClassVar, Mapping

#: Seconds a client refused for load, or by a server shutting down, waits before retrying.
RETRY_AFTER_S = 1


class Refusal(Exception):
    """A request the server will not serve: answered `status`, `{"detail": reason}` (a
    subclass may give a richer `detail`) and `headers`."""

    status: ClassVar[int] = 400
    #: The label the coordinator counts it under (`rejected_requests{reason}`).
    counted_as: ClassVar[str] = "refused"
    #: The body was not read to its end, so the rest of it cannot be framed: the answer says
    #: `Connection: close` and the connection is closed after it (the client opens a new
    #: one), rather than reset under the client's next request.
    closes_connection: ClassVar[bool] = False
    headers: Mapping[str, str] = MappingProxyType({})

    def __init__(self, reason: str, *, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(reason)
        if headers:
            self.headers = dict(headers)

    @property
    def reason(self) -> str:
        return str(self)

    @property
    def detail(self) -> object:
        """The answer body's `detail`: the reason, in the shape the status promises."""
        return self.reason


class BadRequest(Refusal):
    """A well-formed request the server cannot serve (400), as LMCache answers a directory
    lookup whose tokens could not form keys."""

    status = 400
    counted_as = "bad_request"


class Unauthorized(Refusal):
    """No known bearer token (401)."""

    status = 401
    counted_as = "unauthorized"


class Forbidden(Refusal):
    """A request outside its token's role or scope (403); the reason names what was refused."""

    status = 403
    counted_as = "forbidden"


class RequestTimeout(Refusal):
    """A body that did not arrive in time (408)."""

    status = 408
    counted_as = "unreadable"
    closes_connection = True


class Conflict(Refusal):
    """A request at odds with what the server has already bound (409)."""

    status = 409
    counted_as = "conflict"


class TooLarge(Refusal):
    """A request beyond a configured limit (413); the reason says which limit."""

    status = 413
    counted_as = "too_large"
    closes_connection = True


class Unprocessable(Refusal):
    """A malformed request: a body that is not the shape the endpoint takes (422). The
    developers' guide's answer to malformed input, and FastAPI's (so LMCache's)."""

    status = 422
    counted_as = "validation"


class TooManyRequests(Refusal):
    """A caller over its quota (429), told when to try again (`Retry-After`)."""

    status = 429
    counted_as = "too_many_requests"

    def __init__(self, reason: str, *, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(reason, headers={"Retry-After": str(retry_after_s)})


class ServiceUnavailable(Refusal):
    """A request the server cannot take right now (503, `Retry-After`): ingest saturated,
    an event log without quorum."""

    status = 503
    counted_as = "busy"

    def __init__(self, reason: str, *, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(reason, headers={"Retry-After": str(retry_after_s)})


class ShuttingDown(ServiceUnavailable):
    """A request caught by the server's shutdown (503, `Retry-After`): it did not run, or
    not to its end (the reason says which); another replica, or this one restarted, takes
    it."""

    counted_as = "shutting_down"


__all__ = ["RETRY_AFTER_S", "BadRequest", "Conflict", "Forbidden", "Refusal", "RequestTimeout",
           "ServiceUnavailable", "ShuttingDown", "TooLarge", "TooManyRequests", "Unauthorized",
           "Unprocessable"]
