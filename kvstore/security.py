"""Client-side security helpers: TLS channel credentials, bearer-token metadata, and making tokens.

A client of a node that runs with TLS and token authentication (see
``docs/security.md``)::

    from kvstore.client import KVStoreClient
    from kvstore.security import bearer_metadata, channel_credentials

    client = KVStoreClient(
        "kvstore.internal:50051",
        credentials=channel_credentials("ca.crt", cert_file="client.crt", key_file="client.key"),
        metadata=bearer_metadata(os.environ["KVSTORE_TOKEN"]),
    )

``python -m kvstore.security`` prints a fresh random token and the
``token_sha256`` line that puts it in a tokens file without the token itself.
"""

from __future__ import annotations

import argparse
import os
import hashlib
import secrets
from pathlib import Path
from typing import Mapping, Sequence

import grpc

from kvstore.errors import ConfigError, InvalidArgumentError

AUTHORIZATION_KEY = "authorization"
"""The metadata key of the bearer token (gRPC metadata keys are lower case; RFC 6750 section 2.1)."""

BEARER_SCHEME = "Bearer"
"""The authentication scheme of :data:`AUTHORIZATION_KEY` values (RFC 6750)."""

MIN_TOKEN_CHARS = 16
"""The shortest token a server accepts in its configuration, characters."""

DEFAULT_TOKEN_BYTES = 32
"""Random bytes in a token made by :func:`new_token` (256 bits, URL-safe base64: 43 characters)."""


def token_sha256(token: str) -> str:
    """The lowercase hex SHA-256 of a token's UTF-8 bytes: what a tokens file stores as ``token_sha256``.

    Args:
        token: the bearer token, as sent by clients.

    Returns:
        64 hex characters.
    """
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def new_token(num_bytes: int = DEFAULT_TOKEN_BYTES) -> str:
    """A fresh random bearer token from the OS CSPRNG (``secrets.token_urlsafe``).

    Args:
        num_bytes: random bytes in the token (the text is about 1.3 times longer).

    Raises:
        ValueError: if ``num_bytes`` is under 16 (128 bits).
    """
    if num_bytes < 16:
        raise ValueError(f"a token needs at least 16 random bytes, got {num_bytes}")
    return secrets.token_urlsafe(num_bytes)


def bearer_metadata(token: str) -> list[tuple[str, str]]:
    """The call metadata that authenticates a client: ``[("authorization", "Bearer <token>")]``.

    Pass it as ``KVStoreClient(..., metadata=bearer_metadata(token))``.

    Raises:
        ValueError: if the token is empty or holds whitespace or non-ASCII
            characters (gRPC metadata values must be printable ASCII).
    """
    if not token or not token.isascii() or any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError("a bearer token must be non-empty printable ASCII without whitespace")
    return [(AUTHORIZATION_KEY, f"{BEARER_SCHEME} {token}")]


def call_metadata(metadata: Sequence[tuple[str, str | bytes]] | Mapping[str, str | bytes] | None
                  ) -> tuple[tuple[str, str | bytes], ...]:
    """The metadata a client sends with every call, checked: ``None`` is none, a mapping gives its items.

    Args:
        metadata: ``(key, value)`` pairs (e.g. :func:`bearer_metadata`), a mapping of them, or ``None``.

    Returns:
        The pairs, as a tuple.

    Raises:
        InvalidArgumentError: if it is not pairs of a lower-case ``str`` key and a ``str`` value
            (``bytes`` only for keys ending in ``-bin``), as gRPC requires.
    """
    if metadata is None:
        return ()
    if isinstance(metadata, (str, bytes)):
        raise InvalidArgumentError(f"metadata must be (key, value) pairs, e.g. bearer_metadata(token), "
                                   f"got {type(metadata).__name__}")
    pairs = tuple(metadata.items() if isinstance(metadata, Mapping) else metadata)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise InvalidArgumentError(f"metadata must be (key, value) pairs, e.g. bearer_metadata(token), "
                                       f"got {pair!r}")
        key, value = pair
        if key != key.lower() or not key:
            raise InvalidArgumentError(f"metadata key {key!r} must be non-empty and lower case (gRPC)")
        if not isinstance(value, str if not key.endswith("-bin") else (str, bytes)):
            raise InvalidArgumentError(f"metadata value of {key!r} must be a str, got {type(value).__name__}")
    return pairs


def channel_credentials(
    ca_file: str | Path | None = None,
    *,
    cert_file: str | Path | None = None,
    key_file: str | Path | None = None,
) -> grpc.ChannelCredentials:
    """TLS credentials for a client channel, from PEM files; pass them as ``KVStoreClient(credentials=...)``.

    Args:
        ca_file: CA certificate(s) that the server's certificate must chain to;
            ``None`` for the system's roots.
        cert_file: client certificate, for a server that requires mutual TLS.
        key_file: the client certificate's private key.

    Raises:
        ConfigError: if only one of ``cert_file`` and ``key_file`` is given, or a
            file cannot be read.
    """
    if bool(cert_file) != bool(key_file):
        raise ConfigError("tls", "a client certificate and its key must be given together")

    def read(path: str | Path | None) -> bytes | None:
        if not path:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError("tls", f"cannot read {path}: {exc}") from exc

    return grpc.ssl_channel_credentials(
        root_certificates=read(ca_file), private_key=read(key_file), certificate_chain=read(cert_file)
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Print a new token and the tokens-file entry that holds only its SHA-256 (``--help`` explains)."""
    parser = argparse.ArgumentParser(
        prog="python -m kvstore.security",
        description="Print a new random bearer token, its SHA-256, and the tokens-file entry that grants it "
                    "without holding the token itself (docs/security.md).",
        epilog="Example: python -m kvstore.security > token.txt; put the token_sha256 line in the node's "
               "tokens file (security.auth_tokens_file) and give the token to the client (KVSTORE_TOKEN).",
    )
    parser.parse_args(argv)
    token = new_token()
    print(f"token:        {token}")
    print(f"token_sha256: {token_sha256(token)}")
    print("tokens file entry:")
    print(f"  - name: <who>\n    token_sha256: {token_sha256(token)}\n    tenants: [<cache_salt>]")


if __name__ == "__main__":
    main()


def read_bearer_token(setting: str, token_file: str | None, token_env: str,
                      environ: Mapping[str, str] | None = None) -> str | None:
    """A connector's bearer token: ``token_file``'s content, else the variable ``token_env``'s value, else ``None``.

    Args:
        setting: the settings' name in errors (e.g. ``kv_connector_extra_config``).
        token_file: a file holding the token, or ``None``.
        token_env: the environment variable read when no file is given.
        environ: the environment (``os.environ`` when ``None``).

    Raises:
        ConfigError: if ``token_file`` cannot be read or is empty.
    """
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{setting}.token_file", f"cannot read {token_file}: {exc}") from None
        if not token:
            raise ConfigError(f"{setting}.token_file", f"{token_file} is empty")
        return token
    value = (os.environ if environ is None else environ).get(token_env, "").strip()
    return value or None
