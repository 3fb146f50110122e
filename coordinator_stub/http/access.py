"""Opt-in access control at the HTTP edge: each request's token is checked for the role its
path needs before any handler runs (docs/WIRE.md, "Access control").

Contract:
- `access_middleware(grants)` (grants from `coordinator_stub.scopes.tokens_from`): every
  request but `GET /healthz` needs `Authorization: Bearer <token>`. `required_role(method,
  path)`: `emitter` for `/events`, `/instances` (and under it) and `PUT /config/chunk-size`,
  `reader` for the blend lookup and score, `admin` (which may do everything) for the rest.
  No token, or an unknown one: 401 with `WWW-Authenticate: Bearer`; a token without the
  role: 403; bodies `{"detail": "<why>"}`.
- `scope_of(request)`: the token's `Scope` for that role (`ANY` with access control off),
  which the service checks the request against; `caller_of(request)`: the token's digest
  (the header's spelling aside), whose turn a lookup takes; `lists_instances(request)`:
  whether the token may list the registry (emitter or admin).

Tokens are compared by their SHA-256 digests (a dict lookup), so the time a check takes
does not depend on how much of a guess is right.
"""

from __future__ import annotations

import hashlib
from typing import Awaitable, Callable, Iterable

from aiohttp import web

from blend_wire import (BLEND_LOOKUP_PATH, BLEND_SCORE_PATH, CHUNK_SIZE_PATH, EVENTS_PATH, HEALTH_PATH,
                        INSTANCES_PATH, encode)
from coordinator_stub.scopes import ADMIN, ANY, EMITTER, READER, Scope


def required_role(method: str, path: str) -> str | None:
    """The role a request needs (None: open to anyone)."""
    if path == HEALTH_PATH:
        return None
    if (path == EVENTS_PATH or path == INSTANCES_PATH or path.startswith(INSTANCES_PATH + "/")
            or path == CHUNK_SIZE_PATH):
        return EMITTER
    if path == BLEND_LOOKUP_PATH or path == BLEND_SCORE_PATH:
        return READER
    return ADMIN  # directory queries, metrics, and whatever is added later


#: The scope the request's token has for the role its path needs (absent: access off).
SCOPE = web.RequestKey("scope", Scope)


#: The digest of the request's token (absent: access off): who is asking, however the
#: header spells it, for the match workers' fair queuing (one reader, one flow).
CALLER = web.RequestKey("caller", bytes)
#: Whether the token may list the registry (`GET /instances`: emitter or admin); absent:
#: access off, anyone may.
LISTS_INSTANCES = web.RequestKey("lists_instances", bool)


def scope_of(request: web.Request) -> Scope:
    return request.get(SCOPE, ANY)


def caller_of(request: web.Request) -> bytes | None:
    """The digest of the request's token (None with access control off)."""
    return request.get(CALLER)


def lists_instances(request: web.Request) -> bool:
    """Whether the request's token may list every registered instance."""
    return request.get(LISTS_INSTANCES, True)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def _token_digest(header: str) -> bytes | None:
    """The digest of a `Bearer` header's token: the scheme in any case, the token between
    any whitespace (`bearer  T` is `Bearer T`); None when it is not one."""
    parts = header.split(None, 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return None
    return _digest(parts[1].strip())


def _refusal(status: int, detail: str) -> web.Response:
    response = web.Response(status=status, body=encode({"detail": detail}),
                            content_type="application/json")
    if status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="coordinator"'
    return response


def access_middleware(grants: Iterable[tuple]):
    """An aiohttp middleware enforcing the roles of `grants` (`(role, token)` or `(role,
    token, scope)`; see module doc), and leaving each request its scope (`scope_of`)."""
    scopes_of: dict[bytes, dict[str, Scope]] = {}
    for role, token, *scope in grants:
        scope = scope[0] if scope else ANY
        held = scopes_of.setdefault(_digest(token), {})
        held[role] = held[role].joined(scope) if role in held else scope

    @web.middleware
    async def check(request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        needed = required_role(request.method, request.path)
        if needed is None:
            return await handler(request)
        digest = _token_digest(request.headers.get("Authorization", ""))
        granted = scopes_of.get(digest) if digest is not None else None
        if granted is None:
            return _refusal(401, "a bearer token is required (Authorization: Bearer <token>) "
                                 "and this one is missing or unknown")
        request[CALLER] = digest
        request[LISTS_INSTANCES] = ADMIN in granted or EMITTER in granted
        if ADMIN in granted:
            request[SCOPE] = ANY
        elif needed in granted:
            request[SCOPE] = granted[needed]
        else:
            return _refusal(403, f"{request.method} {request.path} needs a token with the "
                                 f"{needed} role; this one has {', '.join(sorted(granted))}")
        return await handler(request)

    return check
