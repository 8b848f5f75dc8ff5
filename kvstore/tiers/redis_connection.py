"""The Redis tier's connection: its settings checked, its redis-py client made, and what a failed round trip is.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Sequence, TypeVar
from urllib.parse import urlsplit

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvstore.config import RedisTierConfig
from kvstore.errors import ConfigError

logger = logging.getLogger(__name__)

UNREACHABLE_ERRORS = (
    rexc.ConnectionError,  # includes AuthenticationError, BusyLoadingError, MaxConnectionsError
    rexc.TimeoutError,
    rexc.ClusterError,  # includes ClusterDownError, MasterDownError
    rexc.RedisClusterException,  # includes SlotNotCoveredError
    asyncio.TimeoutError,
    OSError,
)
"""Errors that mean the server could not be reached or answered nothing useful: they count against the breaker."""


class RoundTripFailed(Exception):
    """One round trip to Redis failed: what the connection helpers raise, and the tier turns into a miss or an
    ``UnavailableError``; it never leaves the tier.

    Attributes:
        unreachable: whether it counts against the breaker (a connection error or
            timeout), as opposed to an error reply from a server that is up.
    """

    def __init__(self, message: str, *, unreachable: bool) -> None:
        super().__init__(message)
        self.unreachable = unreachable


_A = TypeVar("_A")
_B = TypeVar("_B")


async def await_both(first: Awaitable[_A], second: Awaitable[_B]) -> tuple[_A, _B]:
    """Await two commands sent at once (on two connections, or nodes); raises the first one's error, if any,
    after both have ended."""
    a, b = await asyncio.gather(first, second, return_exceptions=True)
    if isinstance(a, BaseException):
        raise a
    if isinstance(b, BaseException):
        raise b
    return a, b


def check_url(cfg: RedisTierConfig) -> str:
    """The scheme of ``cfg.url`` (``redis``, ``rediss`` or ``unix``), checked against the other settings.

    Raises:
        ConfigError: if the URL is empty or of another scheme, a cluster is given ``unix://``,
            or TLS files are given without ``rediss://``.
    """
    if not cfg.url:
        raise ConfigError("url", "is empty: the Redis tier is disabled")
    scheme = urlsplit(cfg.url).scheme
    if scheme not in ("redis", "rediss", "unix"):
        raise ConfigError("url", f"must start with redis://, rediss:// or unix://, got {scheme!r}")
    if cfg.cluster and scheme == "unix":
        raise ConfigError("cluster", "a Redis Cluster is reached over TCP, not unix://")
    if scheme != "rediss" and (cfg.ssl_ca_certs or cfg.ssl_certfile or cfg.ssl_keyfile):
        raise ConfigError("url", "ssl_ca_certs, ssl_certfile and ssl_keyfile need a rediss:// URL")
    return scheme


def read_password(cfg: RedisTierConfig) -> str:
    """The password: ``cfg.password``, or the first line of ``cfg.password_file``.

    Raises:
        ConfigError: if both are set, or the file cannot be read.
    """
    if cfg.password and cfg.password_file:
        raise ConfigError("password_file", "set password or password_file, not both")
    if not cfg.password_file:
        return cfg.password
    try:
        with open(cfg.password_file, encoding="utf-8") as handle:
            return handle.read().rstrip("\r\n")
    except OSError as exc:
        raise ConfigError("password_file", f"cannot read {cfg.password_file}: {exc}") from exc


def redacted_url(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***`` (for logs and errors)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")).geturl()


def make_client(cfg: RedisTierConfig, scheme: str, password: str) -> Any:
    """A redis-py asyncio client (``RedisCluster`` when ``cfg.cluster``) with the tier's timeouts and one retry.

    Args:
        cfg: the ``store.redis`` section.
        scheme: ``cfg.url``'s scheme (:func:`check_url`).
        password: :func:`read_password`'s.
    """
    kwargs: dict[str, Any] = {
        "socket_connect_timeout": cfg.connect_timeout_s,
        "socket_timeout": cfg.socket_timeout_s,
        # One immediate retry on a dropped connection (e.g. a pooled socket
        # that a restarted server closed); timeouts are not retried.
        "retry": Retry(NoBackoff(), 1, supported_errors=(rexc.ConnectionError,)),
        "health_check_interval": 0,
        "client_name": "kvstore",
    }
    if cfg.username:
        kwargs["username"] = cfg.username
    if password:
        kwargs["password"] = password
    if scheme == "rediss":
        for field in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            if getattr(cfg, field):
                kwargs[field] = getattr(cfg, field)
    if cfg.cluster:
        return RedisCluster.from_url(cfg.url, **kwargs)
    return aioredis.Redis.from_url(cfg.url, **kwargs)


async def mget(client: Any, cluster: bool, names: list[str]) -> list[bytes | None]:
    """``MGET`` of ``names`` (in a cluster ``mget_nonatomic``: one ``MGET`` per slot, pipelined per node)."""
    values: list[bytes | None] = await (client.mget_nonatomic(names) if cluster else client.mget(names))
    return values


async def set_many(client: Any, names: list[str], values: list[bytes],
                   px_ms: int | None | Sequence[int | None]) -> list[Any]:
    """A non-transactional pipeline of ``SET name value [PX px_ms]`` (one ``px_ms`` for all, or one per name); the
    replies, error replies among them."""
    pipe = client.pipeline(transaction=False)
    each = px_ms if isinstance(px_ms, (list, tuple)) else [px_ms] * len(names)
    for name, value, px in zip(names, values, each):
        pipe.set(name, value, px=px)
    replies: list[Any] = await pipe.execute(raise_on_error=False)
    return replies


async def pipelined(client: Any, command: str, names: Sequence[str | bytes]) -> list[Any]:
    """A non-transactional pipeline of ``COMMAND name`` for each name; the replies, error replies among them."""
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.execute_command(command.upper(), name)
    replies: list[Any] = await pipe.execute(raise_on_error=False)
    return replies


async def scan(client: Any, node: Any, cursor: int, pattern: str, count: int) -> tuple[int, list[bytes]]:
    """One ``SCAN`` step from ``cursor`` (of cluster node ``node``; ``None`` for a single server): the next cursor
    and the names found."""
    if node is None:
        next_cursor, names = await client.scan(cursor=cursor, match=pattern, count=count)
        return int(next_cursor), list(names)
    cursors, names = await client.scan(cursor=cursor, match=pattern, count=count, target_nodes=node)
    return int(cursors[node.name]), list(names)


async def config_get_max_bulk_len(client: Any, cluster: bool, name: str) -> int | None:
    """The server's ``proto-max-bulk-len`` (``CONFIG GET``), bytes; ``None`` if it does not allow the command
    (logged) or answers something else.

    Raises:
        redis.exceptions.RedisError: any other failure, for the caller's round trip to count.
    """
    kwargs = {"target_nodes": RedisCluster.RANDOM} if cluster else {}
    try:
        reply = await client.config_get("proto-max-bulk-len", **kwargs)
    except rexc.ResponseError as exc:
        if isinstance(exc, rexc.ClusterError):
            raise
        # CONFIG is disabled, renamed or not allowed to this ACL user: not an error.
        logger.info("redis tier %s: cannot read proto-max-bulk-len (%s); assuming 512 MiB", name, exc)
        return None
    value = reply.get("proto-max-bulk-len", reply.get(b"proto-max-bulk-len")) if isinstance(reply, dict) else None
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
