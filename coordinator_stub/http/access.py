"""Opt-in access control at the HTTP edge: each request's token is checked for the role its
route needs before any handler runs (docs/WIRE.md, "Access control").

Contract:
- `add_routes(app, routes)`: each `Route` is declared once, with the role a token needs to
  call it (`ANYONE`: no token); the app refuses to start while it serves a route declared
  without a role (`RouteWithoutRole`), so a new route cannot fall to some default.
- `access_middleware(grants)` (grants from `coordinator_stub.scopes.tokens_from`): a request
  needs `Authorization: Bearer <token>` with its route's role (a request no route serves,
  404 or 405: `admin`, so a caller without it learns nothing of what is served). `admin`
  may do everything. No token, or an unknown one: 401 with `WWW-Authenticate: Bearer`; a
  token without the role: 403; bodies `{"detail": "<why>"}`.
- `scope_of(request)`: the token's `Scope` for that role (`ANY` with access control off),
  which the service checks the request against; `caller_of(request)`: the token's digest
  (the header's spelling aside), whose turn a lookup takes; `lists_instances(request)`:
  whether the token may list the registry (emitter or admin).

Tokens are compared by their SHA-256 digests (a dict lookup), so the time a check takes
does not depend on how much of a guess is right.
"""

from __future__ import annotations

import hashlib
from typing import Awaitable, Callable, Iterable, NamedTuple

from aiohttp import web

from blend_wire import encode
from coordinator_stub.scopes import ADMIN, ANY, EMITTER, READER, Scope

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: The role of a route anyone may call, without a token (`GET /healthz`).
ANYONE = "anyone"
_ROLES = (ANYONE, READER, EMITTER, ADMIN)


class Route(NamedTuple):
    """One route the coordinator serves and the role a token needs to call it."""

    method: str
    path: str
    handler: Handler
    role: str


class RouteWithoutRole(RuntimeError):
    """The app serves a route not declared with a role (a bug: the app does not start)."""


#: Each declared handler's role (a `GET` route's implicit `HEAD` shares its handler).
_ROLE_OF = web.AppKey("role_of", dict)


def add_routes(app: web.Application, routes: Iterable[Route]) -> None:
    """Serve `routes` on `app`, each with its role; on start-up, `RouteWithoutRole` for any
    route the app serves that was not declared so (added to `app.router` directly)."""
    role_of = app.setdefault(_ROLE_OF, {})
    for route in routes:
        if route.role not in _ROLES or role_of.get(route.handler, route.role) != route.role:
            raise ValueError(f"{route.method} {route.path}: role {route.role!r} is not one of "
                             f"{_ROLES}, or its handler is declared with another one")
        role_of[route.handler] = route.role
        if route.method == "GET":  # with its HEAD, as aiohttp serves a GET
            app.router.add_get(route.path, route.handler)
        else:
            app.router.add_route(route.method, route.path, route.handler)
    if _every_route_has_a_role not in app.on_startup:
        app.on_startup.insert(0, _every_route_has_a_role)  # before the workers start


async def _every_route_has_a_role(app: web.Application) -> None:
    role_of = app.get(_ROLE_OF, {})
    missing = sorted(f"{route.method} {route.resource.canonical}"
                     for route in app.router.routes() if route.handler not in role_of)
    if missing:
        raise RouteWithoutRole(f"routes without a role: {', '.join(missing)}; declare each "
                               "in the app's route list with the role it needs")


def _role_of(request: web.Request) -> str:
    """The role `request`'s route needs; `admin` for a request no route serves."""
    return request.app[_ROLE_OF].get(request.match_info.handler, ADMIN)


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
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        needed = _role_of(request)
        if needed == ANYONE:
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
