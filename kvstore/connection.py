"""How a command-line client reaches a node: its target, TLS and bearer token, from flags, the environment or files.

Every ``kvstore`` subcommand that talks to a node (``health``, ``stats``,
``loadtest``, ``demo --target``) takes the same options through
:func:`add_connection_arguments` and turns them into ``KVStoreClient`` keyword
arguments with :meth:`Connection.client_kwargs`. Each option also reads an
environment variable, so that a probe in a container image needs no flags and
a token never has to appear on a command line (where ``ps`` shows it):

=========================  ==========================  ===============================================
flag                       environment                 meaning
=========================  ==========================  ===============================================
``--tls``                  ``KVSTORE_TLS=1``           TLS, trusting the system's root certificates
``--tls-ca FILE``          ``KVSTORE_TLS_CA``          TLS, trusting the CA certificate(s) in FILE
``--tls-cert FILE``        ``KVSTORE_TLS_CERT``        client certificate, for mutual TLS
``--tls-key FILE``         ``KVSTORE_TLS_KEY``         its private key
``--tls-server-name NAME`` ``KVSTORE_TLS_SERVER_NAME`` the name the server's certificate must carry,
                                                       when it differs from the target's host
``--token-file FILE``      ``KVSTORE_TOKEN_FILE``      bearer token, the file's first line
``--token TOKEN``          ``KVSTORE_TOKEN``           bearer token itself (prefer the file or the variable)
=========================  ==========================  ===============================================

A flag wins over its variable. The token comes from the first of
``--token-file``, ``--token``, ``KVSTORE_TOKEN_FILE`` and ``KVSTORE_TOKEN`` that
is set. The server side of these settings is ``security.*`` (``docs/security.md``).
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvstore.errors import ConfigError

DEFAULT_PORT = 50051
"""The port of ``kvstore serve`` (``server.port``), used for a target that names none."""

ENV_TLS = "KVSTORE_TLS"
ENV_TLS_CA = "KVSTORE_TLS_CA"
ENV_TLS_CERT = "KVSTORE_TLS_CERT"
ENV_TLS_KEY = "KVSTORE_TLS_KEY"
ENV_TLS_SERVER_NAME = "KVSTORE_TLS_SERVER_NAME"
ENV_TOKEN = "KVSTORE_TOKEN"
ENV_TOKEN_FILE = "KVSTORE_TOKEN_FILE"
CLIENT_ENV: tuple[str, ...] = (ENV_TLS, ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY, ENV_TLS_SERVER_NAME, ENV_TOKEN,
                               ENV_TOKEN_FILE)
"""The environment variables of the command-line client; ``kvstore serve`` reads none of them."""

_TRUE = ("1", "true", "yes", "on")
_HOST_PORT = re.compile(r"^(?:\[[^\]]+\]|[^:\[\]]+):\d+$")
_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:")
"""gRPC name-resolver schemes (gRPC's ``doc/naming.md``): such a target is passed on as it is."""


def with_default_port(target: str) -> str:
    """``target`` with ``:50051`` appended when it names a host but no port (``localhost`` -> ``localhost:50051``).

    gRPC would otherwise use port 443 for a bare host name. Targets with a
    scheme (``unix:``, ``dns:///``, ``ipv4:``) are left as they are.

    Raises:
        ConfigError: on an empty target or a port that is not a number.
    """
    text = target.strip()
    if not text:
        raise ConfigError("target", "must be HOST:PORT, got an empty string")
    if text.startswith(_SCHEMES) or _HOST_PORT.match(text):
        return text
    if text.startswith("[") and text.endswith("]"):  # [::1]
        return f"{text}:{DEFAULT_PORT}"
    if ":" not in text:
        return f"{text}:{DEFAULT_PORT}"
    if text.count(":") > 1 and "[" not in text:  # a bare IPv6 address
        return f"[{text}]:{DEFAULT_PORT}"
    raise ConfigError("target", f"the port of {target!r} must be a number (HOST:PORT, e.g. 127.0.0.1:{DEFAULT_PORT})")


def target_argument(text: str) -> str:
    """The argparse ``type`` of ``--target``: :func:`with_default_port`, reporting a bad target as a usage error.

    An empty target is passed on as it is, for the client to refuse in one line.
    """
    if not text.strip():
        return text
    try:
        return with_default_port(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class Connection:
    """The TLS and token settings of a client, as the options and the environment give them.

    Attributes:
        tls: use TLS (also implied by ``tls_ca_file`` or ``tls_cert_file``).
        tls_ca_file: PEM CA certificate(s) the server's certificate must chain to; empty for the system's roots.
        tls_cert_file: PEM client certificate (mutual TLS).
        tls_key_file: PEM private key of ``tls_cert_file``.
        tls_server_name: the name to check the server's certificate against instead of the target's host
            (gRPC's ``grpc.ssl_target_name_override``), e.g. ``kvstore.internal`` for a probe of ``127.0.0.1``.
        token: the bearer token; never shown by ``repr``.
    """

    tls: bool = False
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_server_name: str = ""
    token: str = field(default="", repr=False)

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Connection:
        """The settings of parsed :func:`add_connection_arguments` options, the environment filling the gaps.

        Args:
            args: parsed options; a missing attribute counts as not given.
            env: the environment; ``os.environ`` when ``None``.

        Raises:
            ConfigError: naming the flag (and variable) of a token file that cannot be read or is
                empty, a client certificate without its key (or the reverse), a TLS option on a
                plaintext connection, or a token that is not printable ASCII.
        """
        environ = os.environ if env is None else env

        def pick(name: str, variable: str) -> str:
            value = getattr(args, name, None)
            return str(value) if value else environ.get(variable, "").strip()

        token_file = getattr(args, "token_file", None)
        token_flag = getattr(args, "token", None)
        if token_file:
            token = _read_token("--token-file", token_file)
        elif token_flag:
            token = token_flag.strip()
        elif environ.get(ENV_TOKEN_FILE, "").strip():
            token = _read_token(ENV_TOKEN_FILE, environ[ENV_TOKEN_FILE].strip())
        else:
            token = environ.get(ENV_TOKEN, "").strip()
        connection = cls(
            tls=bool(getattr(args, "tls", False)) or environ.get(ENV_TLS, "").strip().lower() in _TRUE,
            tls_ca_file=pick("tls_ca", ENV_TLS_CA),
            tls_cert_file=pick("tls_cert", ENV_TLS_CERT),
            tls_key_file=pick("tls_key", ENV_TLS_KEY),
            tls_server_name=pick("tls_server_name", ENV_TLS_SERVER_NAME),
            token=token,
        )
        connection.check()
        return connection

    @property
    def uses_tls(self) -> bool:
        """Whether the channel is TLS."""
        return self.tls or bool(self.tls_ca_file or self.tls_cert_file)

    def check(self) -> None:
        """Raise :class:`ConfigError` on settings that cannot work together (see :meth:`from_args`)."""
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("--tls-cert/--tls-key", f"a client certificate and its key go together "
                                                      f"({ENV_TLS_CERT} and {ENV_TLS_KEY})")
        if self.tls_server_name and not self.uses_tls:
            raise ConfigError("--tls-server-name", "applies only to TLS: give --tls or --tls-ca too")
        if self.token and (not self.token.isascii() or any(c.isspace() or not c.isprintable() for c in self.token)):
            raise ConfigError("token", "a bearer token must be printable ASCII without whitespace")

    def client_kwargs(self) -> dict[str, Any]:
        """``credentials``, ``metadata`` and ``channel_options`` for ``KVStoreClient`` or ``AsyncKVStoreClient``.

        Raises:
            ConfigError: if a TLS file cannot be read.
        """
        from kvstore.security import bearer_metadata, channel_credentials

        kwargs: dict[str, Any] = {"metadata": bearer_metadata(self.token) if self.token else []}
        if self.uses_tls:
            kwargs["credentials"] = channel_credentials(self.tls_ca_file or None, cert_file=self.tls_cert_file or None,
                                                        key_file=self.tls_key_file or None)
        if self.tls_server_name:
            kwargs["channel_options"] = [("grpc.ssl_target_name_override", self.tls_server_name)]
        return kwargs

    def describe(self) -> str:
        """A short label for messages, without the token: ``plaintext``, ``TLS``, ``mutual TLS``, ``+ token``."""
        kind = "mutual TLS" if self.tls_cert_file else "TLS" if self.uses_tls else "plaintext"
        return kind + (" + token" if self.token else "")


def redact(argv: Sequence[str]) -> list[str]:
    """``argv`` with the value of every ``--token`` replaced by ``***``, for command lines written to reports."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("***")
            hide_next = False
        elif arg == "--token":
            out.append(arg)
            hide_next = True
        elif arg.startswith("--token="):
            out.append("--token=***")
        else:
            out.append(arg)
    return out


def _read_token(source: str, path: str) -> str:
    """The first line of a token file, stripped.

    Raises:
        ConfigError: naming ``source`` if the file cannot be read or holds no token.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(source, f"cannot read the token file {path}: {exc}") from None
    token = lines[0].strip() if lines else ""
    if not token:
        raise ConfigError(source, f"the token file {path} is empty")
    return token


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the TLS and token options (see the module docstring) to ``parser``, in a group of their own."""
    group = parser.add_argument_group(
        "connection security (a node with security.* set; each option also reads the variable named)")
    group.add_argument("--tls", action="store_true", default=False,
                       help=f"use TLS with the system's root certificates (or {ENV_TLS}=1)")
    group.add_argument("--tls-ca", metavar="FILE", help=f"use TLS, trusting this PEM CA certificate ({ENV_TLS_CA})")
    group.add_argument("--tls-cert", metavar="FILE", help=f"client certificate for mutual TLS ({ENV_TLS_CERT})")
    group.add_argument("--tls-key", metavar="FILE", help=f"private key of --tls-cert ({ENV_TLS_KEY})")
    group.add_argument("--tls-server-name", metavar="NAME",
                       help=f"name the server's certificate must carry, when not the target's host "
                            f"({ENV_TLS_SERVER_NAME})")
    group.add_argument("--token-file", metavar="FILE",
                       help=f"bearer token: the first line of FILE ({ENV_TOKEN_FILE}, or the token in {ENV_TOKEN})")
    group.add_argument("--token", metavar="TOKEN",
                       help=f"bearer token (visible in ps: prefer --token-file or {ENV_TOKEN})")
