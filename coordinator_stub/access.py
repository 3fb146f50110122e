"""Opt-in access control: bearer tokens with roles, checked before any handler runs.

Off unless tokens are configured, so LMCache's servers and tools work unchanged (they send
no token). With tokens, every request but `GET /healthz` needs
`Authorization: Bearer <token>`, and the token's roles decide what it may do:

| role      | may call                                                               |
| --------- | ---------------------------------------------------------------------- |
| `emitter` | `POST /events`, `/instances` and everything under it (serving processes) |
| `reader`  | `POST /directory/blend-lookup` (serving processes), `POST /directory/blend-score` (routers) |
| `admin`   | everything: the directory queries (`/directory/lookup`, `/keys`, `/stats`), which return tenants' token ids, and `/metrics` |

No token, or one that is not configured: `401` (with `WWW-Authenticate: Bearer`); a known
token without the role: `403`. Bodies are `{"detail": "<why>"}`.

Where tokens come from (`tokens_from(file, environ)`): a token file, one `ROLE TOKEN` per
line (`#` starts a comment; a token listed under two roles has both), and the environment
variables `COORDINATOR_EMITTER_TOKEN`, `COORDINATOR_READER_TOKEN`,
`COORDINATOR_ADMIN_TOKEN` (each one token, or several separated by commas, e.g. while
rotating). A serving process needs a token with both `emitter` and `reader`.

Tokens are compared by their SHA-256 digests (a dict lookup), so the time a check takes
does not depend on how much of a guess is right.
"""

from __future__ import annotations

import hashlib
import os
from typing import Awaitable, Callable, Iterable, Mapping

from aiohttp import web

from blend_wire import (BLEND_LOOKUP_PATH, BLEND_SCORE_PATH, EVENTS_PATH, HEALTH_PATH,
                        INSTANCES_PATH, encode)

EMITTER, READER, ADMIN = "emitter", "reader", "admin"
ROLES = (EMITTER, READER, ADMIN)
ENV_TOKENS = {EMITTER: "COORDINATOR_EMITTER_TOKEN", READER: "COORDINATOR_READER_TOKEN",
              ADMIN: "COORDINATOR_ADMIN_TOKEN"}


class AccessConfigError(ValueError):
    """A token file or variable that cannot be used; the message says where and why."""


def tokens_from(path: str | None = None, environ: Mapping[str, str] | None = None
                ) -> tuple[tuple[str, str], ...]:
    """`(role, token)` pairs from a token file and the environment; empty: access control off."""
    pairs: list[tuple[str, str]] = []
    if path:
        try:
            with open(path, encoding="utf-8") as handle:
                lines = handle.read().splitlines()
        except OSError as exc:
            raise AccessConfigError(f"cannot read token file {path}: {exc}") from None
        for number, line in enumerate(lines, start=1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) != 2 or fields[0] not in ROLES:
                raise AccessConfigError(f"{path}:{number}: expected 'ROLE TOKEN' with ROLE one "
                                        f"of {', '.join(ROLES)}")
            pairs.append((fields[0], fields[1]))
    env = os.environ if environ is None else environ
    for role, name in ENV_TOKENS.items():
        for token in env.get(name, "").split(","):
            if token.strip():
                pairs.append((role, token.strip()))
    for role, token in pairs:
        if len(token) < 16:
            raise AccessConfigError(f"a {role} token is {len(token)} characters long; use at "
                                    "least 16 (e.g. `python -c 'import secrets; "
                                    "print(secrets.token_urlsafe())'`)")
    return tuple(pairs)


def required_role(method: str, path: str) -> str | None:
    """The role a request needs (None: open to anyone)."""
    if path == HEALTH_PATH:
        return None
    if path == EVENTS_PATH or path == INSTANCES_PATH or path.startswith(INSTANCES_PATH + "/"):
        return EMITTER
    if path == BLEND_LOOKUP_PATH or path == BLEND_SCORE_PATH:
        return READER
    return ADMIN  # directory queries, metrics, and whatever is added later


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def _refusal(status: int, detail: str) -> web.Response:
    response = web.Response(status=status, body=encode({"detail": detail}),
                            content_type="application/json")
    if status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="coordinator"'
    return response


def access_middleware(pairs: Iterable[tuple[str, str]]):
    """An aiohttp middleware enforcing the roles of `pairs` (see module doc)."""
    roles_of: dict[bytes, set[str]] = {}
    for role, token in pairs:
        roles_of.setdefault(_digest(token), set()).add(role)
    roles = {digest: frozenset(found) for digest, found in roles_of.items()}

    @web.middleware
    async def check(request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        needed = required_role(request.method, request.path)
        if needed is None:
            return await handler(request)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        granted = roles.get(_digest(token.strip())) if scheme.lower() == "bearer" else None
        if granted is None:
            return _refusal(401, "a bearer token is required (Authorization: Bearer <token>) "
                                 "and this one is missing or unknown")
        if needed not in granted and ADMIN not in granted:
            return _refusal(403, f"{request.method} {request.path} needs a token with the "
                                 f"{needed} role; this one has {', '.join(sorted(granted))}")
        return await handler(request)

    return check
