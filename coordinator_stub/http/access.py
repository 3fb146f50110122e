"""Opt-in access control: bearer tokens with roles, checked before any handler runs.

Off unless tokens are configured, so LMCache's servers and tools work unchanged (they send
no token). With tokens, every request but `GET /healthz` needs
`Authorization: Bearer <token>`, and the token's roles decide what it may do:

| role      | may call                                                               |
| --------- | ---------------------------------------------------------------------- |
| `emitter` | `POST /events`, `/instances` and everything under it, `PUT /config/chunk-size` (serving processes; binding the chunk size needs an emitter with no scope) |
| `reader`  | `POST /directory/blend-lookup` (serving processes), `POST /directory/blend-score` (routers) |
| `admin`   | everything: the directory queries (`/directory/lookup`, `/keys`, `/stats`), which return tenants' token ids, and `/metrics` |

No token, or one that is not configured: `401` (with `WWW-Authenticate: Bearer`); a known
token without the role: `403`. Bodies are `{"detail": "<why>"}`.

Where tokens come from (`tokens_from(file, environ)`): a token file, one line per grant,

    ROLE TOKEN [instances=P[,P...]] [salts=S[,S...]]

(`#` starts a comment; a token listed under two roles has both), and the environment
variables `COORDINATOR_EMITTER_TOKEN`, `COORDINATOR_READER_TOKEN`,
`COORDINATOR_ADMIN_TOKEN`: each a list of grants separated by `;`, a grant being `TOKEN
[instances=...] [salts=...]` as in the file; a grant without scope fields may list several
tokens separated by commas (today's form, e.g. while rotating). A serving process needs a
token with both `emitter` and `reader`.

Scopes (`Scope`): `P` is an instance id, or a prefix ending in `*` (`*` alone: any); `S`
a cache salt, `""` for the empty salt (a salt holding `,`, `"` or whitespace cannot be
named). A scope left out means any. An `emitter` may post `/events` batches only with
instance ids it matches and entries only under its salts, and register, heartbeat and
deregister only ids it matches (registering needs an explicit `instance_id` then); a
`reader` may ask blend lookups only for its salts. Outside its scope a request is refused
`403` naming what was refused, and nothing of it is applied (an `/events` body is checked
batch by batch as it is validated, all before any is applied). `admin` is never scoped.
The same token and role on two lines: the scopes add up.

Tokens are compared by their SHA-256 digests (a dict lookup), so the time a check takes
does not depend on how much of a guess is right.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable, Mapping

from aiohttp import web

from blend_wire import (BLEND_LOOKUP_PATH, BLEND_SCORE_PATH, CHUNK_SIZE_PATH, EVENTS_PATH, HEALTH_PATH,
                        INSTANCES_PATH, MAX_NAME_CHARS, check_cache_salt, encode)

EMITTER, READER, ADMIN = "emitter", "reader", "admin"
ROLES = (EMITTER, READER, ADMIN)
ENV_TOKENS = {EMITTER: "COORDINATOR_EMITTER_TOKEN", READER: "COORDINATOR_READER_TOKEN",
              ADMIN: "COORDINATOR_ADMIN_TOKEN"}
#: The scope fields each role may carry.
_SCOPE_FIELDS = {EMITTER: ("instances", "salts"), READER: ("salts",), ADMIN: ()}


class AccessConfigError(ValueError):
    """A token file or variable that cannot be used; the message says where and why."""


class Forbidden(Exception):
    """A request outside its token's scope (-> 403). The message names what was refused."""


@dataclass(frozen=True)
class Scope:
    """What a token may speak for. None: any (a scope left out)."""

    instances: tuple[str, ...] | None = None  # ids, and prefixes ending in `*`
    salts: frozenset[str] | None = None

    @property
    def unrestricted(self) -> bool:
        return self.instances is None and self.salts is None

    def allows_instance(self, instance_id: str) -> bool:
        if self.instances is None:
            return True
        return any(instance_id.startswith(p[:-1]) if p.endswith("*") else instance_id == p
                   for p in self.instances)

    def check_instance(self, instance_id: str, where: str) -> None:
        if not self.allows_instance(instance_id):
            raise Forbidden(f"this token may not speak for instance {instance_id[:100]!r} "
                            f"({where}); its scope is instances={','.join(self.instances)}")

    def check_salt(self, cache_salt: str, where: str) -> None:
        if self.salts is not None and cache_salt not in self.salts:
            raise Forbidden(f"this token may not use cache_salt {cache_salt!r} ({where}); "
                            f"its scope is salts={_salt_list(self.salts)}")

    def check_batch(self, batch, index: int) -> None:
        """An `/events` batch (`blend_wire.CacheEventBatch`): its id and every entry's salt."""
        if self.unrestricted:
            return
        self.check_instance(batch.instance_id, f"$.batches[{index}].instance_id")
        if self.salts is not None:
            for i, entry in enumerate(batch.entries):
                self.check_salt(entry.key.cache_salt,
                                f"$.batches[{index}].entries[{i}].key.cache_salt")

    def joined(self, other: "Scope") -> "Scope":
        """What either scope allows (the same token and role granted twice)."""
        instances = (None if self.instances is None or other.instances is None
                     else tuple(dict.fromkeys(self.instances + other.instances)))
        salts = None if self.salts is None or other.salts is None else self.salts | other.salts
        return Scope(instances, salts)


ANY = Scope()


def _salt_list(salts: frozenset[str]) -> str:
    return ",".join(salt if salt else '""' for salt in sorted(salts))


def _parse_scope(role: str, fields: list[str], where: str) -> Scope:
    """`instances=...` / `salts=...` fields of one grant."""
    values: dict[str, list[str]] = {}
    for field in fields:
        name, equals, value = field.partition("=")
        if not equals or name not in ("instances", "salts"):
            raise AccessConfigError(f"{where}: {field[:40]!r} is not a scope; expected "
                                    "instances=P[,P...] or salts=S[,S...]")
        if name not in _SCOPE_FIELDS[role]:
            raise AccessConfigError(f"{where}: a {role} token cannot be scoped by {name} "
                                    f"(scopes of {role}: "
                                    f"{', '.join(_SCOPE_FIELDS[role]) or 'none'})")
        if name in values:
            raise AccessConfigError(f"{where}: {name}= given twice; list them in one field")
        items = value.split(",")
        if not value or not all(items):
            raise AccessConfigError(f"{where}: {name}= has an empty item; write the empty "
                                    'salt as "" (e.g. salts="",tenant-a)')
        values[name] = items
    instances = values.get("instances")
    for pattern in instances or ():
        if "*" in pattern[:-1] or len(pattern) > MAX_NAME_CHARS:
            raise AccessConfigError(f"{where}: instance pattern {pattern[:40]!r} must be an "
                                    "id, or a prefix ending in '*' (no other '*')")
    salts = None
    if "salts" in values:
        salts = frozenset("" if item == '""' else item for item in values["salts"])
        for salt in salts:
            try:
                check_cache_salt(salt)
            except ValueError as exc:
                raise AccessConfigError(f"{where}: {exc}") from None
            if '"' in salt:
                raise AccessConfigError(f"{where}: salt {salt[:40]!r} holds a quote; only "
                                        '"" (the empty salt) is written with quotes')
    return Scope(None if instances is None else tuple(instances), salts)


def tokens_from(path: str | None = None, environ: Mapping[str, str] | None = None
                ) -> tuple[tuple[str, str, Scope], ...]:
    """`(role, token, scope)` grants from a token file and the environment; empty: access
    control off."""
    grants: list[tuple[str, str, Scope]] = []
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
            if len(fields) < 2 or fields[0] not in ROLES:
                raise AccessConfigError(
                    f"{path}:{number}: expected 'ROLE TOKEN [instances=P,...] [salts=S,...]' "
                    f"with ROLE one of {', '.join(ROLES)}")
            grants.append((fields[0], fields[1],
                           _parse_scope(fields[0], fields[2:], f"{path}:{number}")))
    env = os.environ if environ is None else environ
    for role, name in ENV_TOKENS.items():
        for part in env.get(name, "").split(";"):
            fields = part.split()
            if not any("=" in field for field in fields[1:]):
                # No scope: one token, or several separated by commas.
                grants.extend((role, token.strip(), ANY) for token in part.split(",")
                              if token.strip())
            else:
                grants.append((role, fields[0], _parse_scope(role, fields[1:], name)))
    for role, token, _ in grants:
        if len(token) < 16:
            raise AccessConfigError(f"a {role} token is {len(token)} characters long; use at "
                                    "least 16 (e.g. `python -c 'import secrets; "
                                    "print(secrets.token_urlsafe())'`)")
    return tuple(grants)


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


def scope_of(request: web.Request) -> Scope:
    return request.get(SCOPE, ANY)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


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
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        granted = scopes_of.get(_digest(token.strip())) if scheme.lower() == "bearer" else None
        if granted is None:
            return _refusal(401, "a bearer token is required (Authorization: Bearer <token>) "
                                 "and this one is missing or unknown")
        if ADMIN in granted:
            request[SCOPE] = ANY
        elif needed in granted:
            request[SCOPE] = granted[needed]
        else:
            return _refusal(403, f"{request.method} {request.path} needs a token with the "
                                 f"{needed} role; this one has {', '.join(sorted(granted))}")
        return await handler(request)

    return check
