"""Bearer-token authentication with roles.

Each configured token has a name and roles (producer, trainer, reader, admin; admin may
call everything; DescribeTable is open to every role, since clients need the schema). The presented token is compared with *every* configured one by
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
ANY_ROLE = "any"


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

    def identify(self, metadata: Iterable[tuple[str, str | bytes]]) -> Principal:
        """The principal of the call's bearer token (UNAUTHENTICATED if none matches)."""
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
        return match

    @staticmethod
    def authorize(principal: Principal, role: str) -> None:
        """PERMISSION_DENIED unless the principal has ``role`` (or admin). ``ANY_ROLE``:
        every authenticated principal may call."""
        if role != ANY_ROLE and role not in principal.roles and "admin" not in principal.roles:
            raise PermissionDenied(f"token {principal.name!r} (roles {sorted(principal.roles)}) may not "
                                   f"call this: it needs role {role!r}")
