"""Bearer-token authentication of ``kvstore.v1.KVStore`` calls: the tokens file, the constant-time check, tenants.

A node authenticates when ``security.auth_tokens_file`` or ``security.auth_tokens``
is set. Every ``kvstore.v1.KVStore`` call must then carry the metadata
``authorization: Bearer <token>`` (RFC 6750); health and reflection stay open
for probes. ``kvstore.server.admission`` checks the token of every call
(UNAUTHENTICATED when it is missing or unknown) and hands the caller's
:class:`Principal` to the servicer, which checks that the token covers the
tenant (``cache_salt``) of each request's namespace (PERMISSION_DENIED otherwise).

The tokens file (YAML or JSON, read with ``yaml.safe_load``)::

    tokens:
      - name: team-a                 # shown in logs instead of the token; optional
        token_sha256: 782051b3740e0649c260204084a0a947280e4c7709a09c558c7c5ff48a92c7a6
        tenants: [team-a]            # cache_salt values this token may use
      - name: ops
        token: "a-plaintext-token-of-16-chars-or-more"   # accepted, but prefer token_sha256
        tenants: ["*"]               # every tenant: Clear of any namespace, etc.

``token_sha256`` is the hex SHA-256 of the token (``kvstore.security.token_sha256``,
or ``python -m kvstore.security`` for a new token), so the file need not hold
tokens. ``security.auth_tokens`` (e.g. ``KVSTORE_SECURITY__AUTH_TOKENS``) holds
the same document inline, or a compact list ``<token>=<tenant>,<tenant>;...`` in
which ``<token>`` may be ``sha256:<hex>``; ``<token>=`` grants the empty salt
(the default tenant). Both sources are merged.

The check hashes the presented token with SHA-256 and compares the digest with
**every** configured digest using ``hmac.compare_digest``, so the time taken
depends neither on how many leading characters of some token matched nor on
where in the list the match is.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import yaml

from kvstore.config import SecurityConfig
from kvstore.errors import ConfigError
from kvstore.security import AUTHORIZATION_KEY, BEARER_SCHEME, MIN_TOKEN_CHARS
from kvstore.error_codes import PermissionDeniedError, UnauthenticatedError

logger = logging.getLogger(__name__)

ALL_TENANTS = "*"
"""The tenant entry that grants every tenant (an operator's token)."""

_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_ENTRY_KEYS = frozenset({"name", "token", "token_sha256", "tenants"})


@dataclass(frozen=True, slots=True)
class Principal:
    """Who made a call: the name of the token it carried and the tenants that token covers.

    Attributes:
        name: the token's name from the configuration (never the token itself).
        tenants: ``cache_salt`` values the token may use.
        all_tenants: the token covers every tenant (``"*"``).
    """

    name: str
    tenants: frozenset[str]
    all_tenants: bool = False

    def covers(self, tenant: str) -> bool:
        """Whether this principal may use namespaces whose ``cache_salt`` is ``tenant``."""
        return self.all_tenants or tenant in self.tenants

    def authorize(self, tenant: str) -> None:
        """Check that this principal may use ``tenant``.

        Raises:
            PermissionDeniedError: if it may not.
        """
        if not self.covers(tenant):
            raise PermissionDeniedError(f"token {self.name!r} does not cover tenant (cache_salt) {tenant!r}")


@dataclass(frozen=True, slots=True)
class TokenEntry:
    """One configured token: its SHA-256 digest and the principal it authenticates.

    Attributes:
        digest: SHA-256 of the token's UTF-8 bytes, 32 bytes.
        principal: who a caller with this token is.
    """

    digest: bytes
    principal: Principal


def parse_tokens(text: str, source: str, *, compact: bool = False) -> list[TokenEntry]:
    """Parse a tokens document (or, with ``compact``, the one-line form) into entries.

    Args:
        text: a YAML/JSON document ``{tokens: [{name, token | token_sha256, tenants}]}``,
            or with ``compact`` set, ``<token>=<tenant>,...;...`` (``<token>`` may be
            ``sha256:<hex>``); see the module docstring.
        source: where the text came from, for error messages and default names.
        compact: accept the compact form too (it is used when the text does not
            start with ``{`` or ``tokens``).

    Returns:
        The entries, in order.

    Raises:
        ConfigError: on a malformed document, an unknown key, a token shorter
            than ``MIN_TOKEN_CHARS``, a bad digest, or a token with no tenants.
    """
    stripped = text.strip()
    if compact and stripped and not (stripped.startswith("{") or stripped.startswith("tokens")):
        return _parse_compact(stripped, source)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, f"cannot parse the tokens document: {exc}") from None
    if not isinstance(data, Mapping) or set(data) != {"tokens"} or not isinstance(data["tokens"], list):
        raise ConfigError(source, "a tokens document must be a mapping with one key, 'tokens', holding a list")
    entries = []
    for index, item in enumerate(data["tokens"]):
        where = f"{source}: tokens[{index}]"
        if not isinstance(item, Mapping):
            raise ConfigError(where, "must be a mapping with token or token_sha256, and tenants")
        unknown = set(item) - _ENTRY_KEYS
        if unknown:
            raise ConfigError(where, f"unknown keys {sorted(unknown)}; known: {sorted(_ENTRY_KEYS)}")
        if ("token" in item) == ("token_sha256" in item):
            raise ConfigError(where, "give exactly one of 'token' and 'token_sha256'")
        tenants = item.get("tenants")
        if isinstance(tenants, str):
            tenants = [tenants]
        if not isinstance(tenants, list) or not tenants or not all(isinstance(t, str) for t in tenants):
            raise ConfigError(where, "'tenants' must be a non-empty list of cache_salt strings (or '*')")
        name = item.get("name", f"{source}#{index}")
        if not isinstance(name, str) or not name:
            raise ConfigError(where, "'name' must be a non-empty string")
        if "token" in item:
            digest = _digest_of_token(item["token"], where)
        else:
            digest = _digest_of_hex(item["token_sha256"], where)
        entries.append(TokenEntry(digest, _principal(name, tenants)))
    return entries


def _parse_compact(text: str, source: str) -> list[TokenEntry]:
    entries = []
    for index, part in enumerate(p.strip() for p in re.split(r"[;\n]", text)):
        if not part:
            continue
        where = f"{source}: entry {index}"
        token, sep, tenant_text = part.partition("=")
        if not sep:
            raise ConfigError(where, "must be '<token>=<tenant>[,<tenant>...]' (the token is not shown)")
        token = token.strip()
        tenants = [t.strip() for t in tenant_text.split(",")]
        if token.startswith("sha256:"):
            digest = _digest_of_hex(token[len("sha256:"):], where)
        else:
            digest = _digest_of_token(token, where)
        entries.append(TokenEntry(digest, _principal(f"{source}#{index}", tenants)))
    if not entries:
        raise ConfigError(source, "holds no token")
    return entries


def _digest_of_token(token: Any, where: str) -> bytes:
    if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(where, f"a token must be a string of at least {MIN_TOKEN_CHARS} characters")
    if not token.isascii() or any(c.isspace() or not c.isprintable() for c in token):
        raise ConfigError(where, "a token must be printable ASCII without whitespace (it travels in gRPC metadata)")
    return hashlib.sha256(token.encode("utf-8")).digest()


def _digest_of_hex(value: Any, where: str) -> bytes:
    if not isinstance(value, str) or not _HEX64.match(value):
        raise ConfigError(where, "token_sha256 must be 64 hex characters (kvstore.security.token_sha256)")
    return bytes.fromhex(value)


def _principal(name: str, tenants: Iterable[str]) -> Principal:
    tenant_set = frozenset(tenants)
    return Principal(name, tenant_set - {ALL_TENANTS}, ALL_TENANTS in tenant_set)


class Authenticator:
    """Maps the bearer token of a call to its :class:`Principal`, in constant time per configured token.

    Args:
        entries: the configured tokens.

    Raises:
        ConfigError: if there are no entries, or two entries hold the same token.
    """

    def __init__(self, entries: Sequence[TokenEntry]) -> None:
        if not entries:
            raise ConfigError("security.auth_tokens", "token authentication is on but no token is configured")
        seen: dict[bytes, str] = {}
        for entry in entries:
            if entry.digest in seen:
                raise ConfigError(
                    "security.auth_tokens",
                    f"tokens {seen[entry.digest]!r} and {entry.principal.name!r} are the same token",
                )
            seen[entry.digest] = entry.principal.name
        self._entries = tuple(entries)

    @classmethod
    def from_config(cls, security: SecurityConfig) -> Authenticator | None:
        """The authenticator of ``security``, or ``None`` when authentication is off.

        Reads ``auth_tokens_file`` (a tokens document) and ``auth_tokens`` (a
        document or the compact form) and merges them.

        Raises:
            ConfigError: if the file cannot be read or either source is malformed.
        """
        entries: list[TokenEntry] = []
        if security.auth_tokens_file:
            path = Path(security.auth_tokens_file)
            try:
                text = path.read_text(encoding="utf-8")
            except OSError as exc:
                raise ConfigError("security.auth_tokens_file", f"cannot read {path}: {exc}") from None
            entries += parse_tokens(text, "security.auth_tokens_file")
        if security.auth_tokens:
            entries += parse_tokens(security.auth_tokens, "security.auth_tokens", compact=True)
        if not security.auth_tokens_file and not security.auth_tokens:
            return None
        return cls(entries)

    @property
    def num_tokens(self) -> int:
        """Configured tokens."""
        return len(self._entries)

    @property
    def principals(self) -> list[Principal]:
        """What each configured token authenticates as, in order (never the tokens themselves)."""
        return [entry.principal for entry in self._entries]

    def principal_of(self, token: str) -> Principal | None:
        """The principal of ``token``, or ``None`` if it is not configured.

        The SHA-256 of ``token`` is compared with every configured digest by
        ``hmac.compare_digest``; no comparison is skipped after a match.
        """
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        found: Principal | None = None
        for entry in self._entries:
            if hmac.compare_digest(digest, entry.digest) and found is None:
                found = entry.principal
        return found

    def authenticate(self, metadata: Iterable[tuple[str, Any]] | None) -> Principal:
        """The principal of a call from its metadata (``authorization: Bearer <token>``).

        Args:
            metadata: the call's ``(key, value)`` pairs (``context.invocation_metadata()``).

        Raises:
            UnauthenticatedError: if there is no ``authorization`` entry, more than
                one, one of another scheme, or an unknown token.
        """
        values = [value for key, value in (metadata or ()) if key.lower() == AUTHORIZATION_KEY]
        if len(values) != 1:
            raise UnauthenticatedError(
                f"send exactly one 'authorization: {BEARER_SCHEME} <token>' metadata entry (got {len(values)})"
            )
        value = values[0]
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = str(value).strip().partition(" ")
        if scheme.lower() != BEARER_SCHEME.lower() or not token.strip():
            raise UnauthenticatedError(f"the authorization metadata must be '{BEARER_SCHEME} <token>'")
        principal = self.principal_of(token.strip())
        if principal is None:
            raise UnauthenticatedError("unknown bearer token")
        return principal
