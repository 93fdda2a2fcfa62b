"""Bearer-token authentication with roles.

Each configured token has a name and roles (producer, trainer, reader, admin; admin may
call everything). The presented token is compared with *every* configured one by
``hmac.compare_digest`` on SHA-256 digests, so timing reveals neither which token matched
nor how much of one did. Tokens are never logged; principals are named by token name.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Iterable, Sequence

from expstore.errors import PermissionDenied, Unauthenticated

from .config import TokenConfig

ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class Principal:
    name: str
    roles: frozenset[str]


class Authenticator:
    """With no tokens configured, every call is allowed as ``anonymous``."""

    def __init__(self, tokens: Sequence[TokenConfig]) -> None:
        self._entries = [(hashlib.sha256(t.secret().encode()).digest(), Principal(t.name, frozenset(t.roles)))
                         for t in tokens]

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]], role: str) -> Principal:
        if not self._entries:
            return Principal(ANONYMOUS, frozenset({"admin"}))
        header = next((v for k, v in metadata if k == "authorization"), None)
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        if not header or not header.startswith("Bearer "):
            raise Unauthenticated("missing bearer token: send metadata 'authorization: Bearer <token>'")
        digest = hashlib.sha256(header[len("Bearer "):].encode("utf-8", "surrogateescape")).digest()
        match = None
        for known, principal in self._entries:  # no early exit: constant time over tokens
            if hmac.compare_digest(known, digest):
                match = principal
        if match is None:
            raise Unauthenticated("unknown bearer token")
        if role not in match.roles and "admin" not in match.roles:
            raise PermissionDenied(f"token {match.name!r} (roles {sorted(match.roles)}) may not call this: "
                                   f"it needs role {role!r}")
        return match
