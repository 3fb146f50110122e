"""Bearer-token grants and their scopes, free of HTTP (docs/WIRE.md, "Access control").

Contract:
- `tokens_from(file, environ)`: the `(role, token, scope)` grants of a token file (`ROLE
  TOKEN [instances=P,...] [salts=S,...]` lines; `#` starts a comment at the start of a
  line or after whitespace, and is part of a field anywhere else) and of the
  `COORDINATOR_*_TOKEN` variables; empty: access control off. A file or variable that
  cannot be used raises `AccessConfigError` saying where and why.
- `Scope`: what a token may speak for (instance ids or prefixes ending in `*`, cache
  salts; None: any). Its `check_*` methods raise `coordinator_stub.errors.Forbidden`
  naming what was refused; the service calls them before anything is applied.
- The roles are enforced per path by the HTTP layer (`coordinator_stub.http.access`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

from blend_wire import MAX_NAME_CHARS, parse_salt_list
from coordinator_stub.errors import Forbidden

EMITTER, READER, ADMIN = "emitter", "reader", "admin"
ROLES = (EMITTER, READER, ADMIN)
ENV_TOKENS = {EMITTER: "COORDINATOR_EMITTER_TOKEN", READER: "COORDINATOR_READER_TOKEN",
              ADMIN: "COORDINATOR_ADMIN_TOKEN"}
#: The scope fields each role may carry.
_SCOPE_FIELDS = {EMITTER: ("instances", "salts"), READER: ("salts",), ADMIN: ()}


class AccessConfigError(ValueError):
    """A token file or variable that cannot be used; the message says where and why."""


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
#: A comment: `#` at the start of a line or after whitespace, to the end of the line. A `#`
#: inside a field belongs to it (`0123456789abcdefSECRET#more` is one token).
_COMMENT = re.compile(r"(?:^|\s)#.*")


def _salt_list(salts: frozenset[str]) -> str:
    return ",".join(salt if salt else '""' for salt in sorted(salts))


def _parse_scope(role: str, fields: list[str], where: str) -> Scope:
    """`instances=...` / `salts=...` fields of one grant."""
    values: dict[str, list[str] | frozenset[str]] = {}
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
        if name == "salts":
            try:
                values[name] = parse_salt_list(value)
            except ValueError as exc:
                raise AccessConfigError(f"{where}: {exc}") from None
            continue
        items = value.split(",")
        if not value or not all(items):
            raise AccessConfigError(f"{where}: {name}= has an empty item")
        values[name] = items
    instances = values.get("instances")
    for pattern in instances or ():
        if "*" in pattern[:-1] or len(pattern) > MAX_NAME_CHARS:
            raise AccessConfigError(f"{where}: instance pattern {pattern[:40]!r} must be an "
                                    "id, or a prefix ending in '*' (no other '*')")
    salts = values.get("salts")
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
            line = _COMMENT.sub("", line).strip()
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
