"""Which clients may use the router, and which cache salts each may name.

`--client-token-file FILE` holds one line per client, `TOKEN [salts=S[,S...]]` (`#`
comments; `""` is the empty salt; a line without `salts=` may name any salt). With the file,
a request needs `Authorization: Bearer TOKEN` (`401` without a known one) and may be scored
only under a salt its token lists (`403` otherwise, before anything is scored or
forwarded). Without it the router is open and scores only the empty salt: a request
naming another salt is `403`, since the router could not tell whose cache it would be
asking about. Docs: docs/OPERATIONS.md, "Routing requests to where their KV is".
"""

from __future__ import annotations

import hashlib

from blend_wire import Forbidden, Unauthorized, parse_salt_list


class AccessConfigError(ValueError):
    """A client token file that cannot be used; the message says where and why."""


#: None: any salt (a token line without `salts=`).
Salts = frozenset[str] | None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class ClientAccess:
    """The client tokens (by digest) and the salts each may name; empty: the router is open."""

    def __init__(self, grants: dict[str, Salts] | None = None) -> None:
        self._salts: dict[bytes, Salts] = {_digest(t): s for t, s in (grants or {}).items()}

    @property
    def open(self) -> bool:
        return not self._salts

    @classmethod
    def from_file(cls, path: str) -> "ClientAccess":
        try:
            with open(path, encoding="utf-8") as handle:
                lines = handle.read().splitlines()
        except OSError as exc:
            raise AccessConfigError(f"cannot read client token file {path}: {exc}") from None
        grants: dict[str, Salts] = {}
        for number, line in enumerate(lines, start=1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            where = f"{path}:{number}"
            name, _, value = fields[1].partition("=") if len(fields) == 2 else ("", "", "")
            if len(fields) > 2 or (len(fields) == 2 and name != "salts"):
                raise AccessConfigError(f"{where}: expected 'TOKEN [salts=S[,S...]]'")
            if len(fields[0]) < 16:
                raise AccessConfigError(f"{where}: the token is {len(fields[0])} characters "
                                        "long; use at least 16 (e.g. `python -c 'import "
                                        "secrets; print(secrets.token_urlsafe())'`)")
            try:
                salts = parse_salt_list(value) if len(fields) == 2 else None
            except ValueError as exc:
                raise AccessConfigError(f"{where}: {exc}") from None
            if fields[0] in grants:
                raise AccessConfigError(f"{where}: this token is listed twice; give it one "
                                        "line with all its salts")
            grants[fields[0]] = salts
        if not grants:
            raise AccessConfigError(f"{path} lists no client token")
        return cls(grants)

    def salts_of(self, authorization: str) -> Salts:
        """The salts a client with this `Authorization` header may name; `Unauthorized`
        for a missing or unknown token. An open router: the empty salt only."""
        if self.open:
            return _EMPTY_SALT_ONLY
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer":
            salts = self._salts.get(_digest(token.strip()), ...)
            if salts is not ...:
                return salts
        raise Unauthorized("a bearer token is required (Authorization: Bearer <token>) and "
                           "this one is missing or unknown")

    def check_salt(self, salts: Salts, cache_salt: str) -> None:
        """`Forbidden` (403) unless `cache_salt` is one of `salts` (None: any)."""
        if salts is None or cache_salt in salts:
            return
        if self.open:
            raise Forbidden("this router takes no client tokens, so it scores only the "
                            "empty cache_salt; ask its operator for a client token "
                            "(--client-token-file) to name a salt")
        raise Forbidden(f"this token may not name cache_salt {cache_salt[:40]!r}")


_EMPTY_SALT_ONLY: Salts = frozenset({""})
