"""The typed configuration of every component, loaded in one place from a file and the environment.

Precedence, lowest first: defaults, a TOML or YAML file, environment variables,
then explicit overrides (command-line flags). Environment variables name a
field by its dotted path, upper-cased, with ``__`` between levels::

    KVSTORE_STORE__MEMORY__CAPACITY_BYTES=8GiB
    KVSTORE_SERVER__PORT=50051

and the common settings have short aliases (see ``ENV_ALIASES``). Fields whose
name ends in ``_bytes`` accept sizes such as ``8GiB``, ``512MB`` or ``4096``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from kvstore.errors import ConfigError
from kvstore.policy import DEFAULT_PRIORITY, POLICY_NAMES, resolve_policy_name

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": KiB, "kib": KiB, "mi": MiB, "mib": MiB, "gi": GiB, "gib": GiB, "ti": TiB, "tib": TiB,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")

DEFAULT_HISTORY_BLOCKS = 65536
"""Removals the miss history remembers by default (``store.miss_history_blocks``, ``kvstore.store.misses``)."""


def parse_size(value: str | int | float) -> int:
    """Parse a size such as ``8GiB``, ``1.5GB``, ``512MiB`` or ``4096`` into bytes.

    Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB,
    GB, TB) powers of 1000, as in IEC 80000-13.

    Raises:
        ValueError: on anything else, or a negative size.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return int(value)
    match = _SIZE.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (use e.g. 8GiB, 512MB, 4096)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _require(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ConfigError(name, message)


@dataclass(frozen=True, slots=True)
class MemoryTierConfig:
    """The memory tier: a preallocated page pool on the host or a GPU, or blocks on the host's heap.

    Attributes:
        enabled: whether the store has a memory tier.
        capacity_bytes: pool size (or the heap tier's capacity), bytes.
        device: ``cpu`` or ``cuda:N``.
        page_bytes: page size of the pool, its unit of allocation, bytes; a block takes ``ceil(nbytes / page_bytes)``
            pages, so its capacity is its own length rounded up to a page (``kvstore.tiers.memory``).
        pin_memory: use pinned host memory for a ``cpu`` pool when CUDA is available.
        storage: ``pages`` for the page pool (``kvstore.tiers.memory``: preallocated,
            pinnable, for blocks that move to and from a GPU); ``heap`` for one
            ``bytes`` object per block, stored as the node's ready Get reply
            (``kvstore.tiers.heap``: no copy per Get, ``cpu`` only); ``shared`` for
            sealed shared-memory slabs that same-host clients read in place
            (``kvstore.shm.node.pool``: ``kvstore serve`` with ``shared_memory.enabled``,
            ``cpu`` only); ``auto`` for ``shared`` in ``kvstore serve`` on ``cpu``
            with the same-host data plane on, ``heap`` there with it off, and
            ``pages`` elsewhere.
    """

    enabled: bool = True
    capacity_bytes: int = 1 * GiB
    device: str = "cpu"
    page_bytes: int = 256
    pin_memory: bool = True
    storage: str = "auto"

    def __post_init__(self) -> None:
        _require(self.page_bytes > 0 and self.page_bytes % 64 == 0, "page_bytes",
                 "must be a positive multiple of 64 (every block and its payload start 64-byte aligned)")
        _require(self.capacity_bytes >= 0, "capacity_bytes", "must be >= 0")
        _require(self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device) is not None,
                 "device", f"must be 'cpu' or 'cuda:N', got {self.device!r}")
        _require(self.storage in ("auto", "pages", "heap", "shared"), "storage",
                 f"must be 'auto', 'pages', 'heap' or 'shared', got {self.storage!r}")
        _require(self.storage not in ("heap", "shared") or self.device == "cpu", "storage",
                 f"{self.storage!r} holds blocks in host memory; it cannot be used with device {self.device!r}")


COMPRESSION_CODECS = ("none", "blosc2", "zstd", "lz4")
"""Lossless codecs of the LMDB and Redis tiers (``kvstore.tiers.compression.Codec``)."""

@dataclass(frozen=True, slots=True)
class DiskTierConfig:
    """The disk tier: an LMDB environment.

    Attributes:
        path: directory of the LMDB environment; empty disables the tier.
        capacity_bytes: the most bytes ``data.mdb`` takes (LMDB's map size); blocks fill
            ``kvstore.tiers.lmdb.usable_bytes`` of it, three quarters of a large one (``docs/disk.md``).
        sync: fsync every write transaction (durable, slower).
        compression: store blocks compressed, losslessly: ``none``, ``blosc2``, ``zstd`` or ``lz4``
            (``kvstore.tiers.compression``; ``docs/encodings.md`` has the measured trade).
    """

    path: str = ""
    capacity_bytes: int = 8 * GiB
    sync: bool = False
    compression: str = "none"

    def __post_init__(self) -> None:
        _require(self.capacity_bytes >= 0, "capacity_bytes", "must be >= 0")
        _require(self.compression in COMPRESSION_CODECS, "compression", f"must be one of {list(COMPRESSION_CODECS)}")


@dataclass(frozen=True, slots=True)
class RedisTierConfig:
    """The shared Redis (or Redis Cluster) tier.

    Attributes:
        url: ``redis://``, ``rediss://`` (TLS) or ``unix://`` URL; empty disables the tier.
        cluster: use redis-py's cluster client (the URL names any one node).
        prefix: first part of every key, ``<prefix>:<namespace tag hex>:<block hash hex>``.
        mode: ``write_back`` (only demoted blocks reach Redis) or ``write_through``
            (every put reaches Redis asynchronously, so other nodes can hit it).
        ttl_s: expiry of every key, seconds; 0 for none (Redis' ``maxmemory`` evicts).
        connect_timeout_s: TCP connect timeout, seconds.
        socket_timeout_s: per-command timeout, seconds.
        max_value_bytes: larger values are refused before they are sent, bytes.
        breaker_failures: consecutive failures that open the circuit breaker; <= 0 turns it off.
        breaker_reset_s: seconds the breaker stays open before one trial call.
        username: ACL user name (Redis 6+), empty for the default user.
        password: AUTH password, empty for none.
        password_file: file holding the password; read once at start.
        ssl_ca_certs: CA bundle for ``rediss://``.
        ssl_certfile: client certificate for mutual TLS.
        ssl_keyfile: client key for mutual TLS.
        compression: store blocks compressed, losslessly (as :class:`DiskTierConfig`): ``none``, ``blosc2``,
            ``zstd`` or ``lz4``; every node sharing the Redis reads either.
    """

    url: str = ""
    cluster: bool = False
    prefix: str = "kvstore"
    mode: str = "write_through"
    ttl_s: float = 0.0
    connect_timeout_s: float = 0.5
    socket_timeout_s: float = 0.5
    max_value_bytes: int = 512 * MiB
    breaker_failures: int = 3
    breaker_reset_s: float = 1.0
    username: str = ""
    password: str = ""
    password_file: str = ""
    ssl_ca_certs: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    compression: str = "none"

    def __post_init__(self) -> None:
        _require(self.compression in COMPRESSION_CODECS, "compression", f"must be one of {list(COMPRESSION_CODECS)}")
        _require(self.mode in ("write_back", "write_through"), "mode",
                 f"must be 'write_back' or 'write_through', got {self.mode!r}")
        _require(self.connect_timeout_s > 0, "connect_timeout_s", "must be > 0")
        _require(self.socket_timeout_s > 0, "socket_timeout_s", "must be > 0")
        _require(self.ttl_s >= 0, "ttl_s", "must be >= 0")
        _require(":" not in self.prefix, "prefix", "must not contain ':'")
        _require(self.breaker_reset_s >= 0, "breaker_reset_s", "must be >= 0")
        _require(self.max_value_bytes > 0, "max_value_bytes", "must be > 0")
        problem = redis_url_problem(self.url) if self.url else None
        _require(problem is None, "url", problem or "")


def redis_url_problem(url: str) -> str | None:
    """What is wrong with a ``store.redis.url``, with the fix; ``None`` for a URL redis-py reads as meant.

    redis-py's own parser takes ``redis:/127.0.0.1:6379`` (one slash) as no host and
    connects to localhost, and reads ``localhost:6379`` as a scheme: both are refused
    here, with the whole value quoted and the URL the user most likely meant.
    """
    from urllib.parse import urlsplit

    fix = "set --redis-url (store.redis.url, KVSTORE_REDIS_URL) to"
    parts = urlsplit(url)
    if "://" not in url and parts.scheme not in ("redis", "rediss", "unix"):
        return (f"{url!r} is not a Redis URL: it must start with redis://, rediss:// (TLS) or unix://; "
                f"{fix} e.g. 'redis://{url.strip('/')}/0'")
    if parts.scheme not in ("redis", "rediss", "unix"):
        return (f"{url!r} has the scheme {parts.scheme!r}: it must start with redis://, rediss:// (TLS) or unix://; "
                f"{fix} e.g. 'redis://{url.split('://', 1)[1].strip('/')}'")
    if parts.scheme == "unix":
        return None if parts.path else f"{url!r} names no socket: {fix} e.g. 'unix:///run/redis/redis.sock'"
    if not url.startswith(f"{parts.scheme}://"):
        rest = url.split(":", 1)[1].lstrip("/")
        return f"{url!r} has no host (a URL has two slashes after the scheme): {fix} e.g. '{parts.scheme}://{rest}'"
    if not parts.hostname:
        return f"{url!r} names no host: {fix} e.g. '{parts.scheme}://127.0.0.1:6379/0'"
    try:
        parts.port
    except ValueError:
        return f"{url!r} has a port that is not a number: {fix} e.g. '{parts.scheme}://{parts.hostname}:6379/0'"
    return None


@dataclass(frozen=True, slots=True)
class PinsConfig:
    """TTLs (pins): a block with a TTL is evicted only after every block without one until its TTL runs out,
    counted from its last hit or put (``docs/agentic.md``). These bounds keep pins from filling a tier.

    Attributes:
        max_ttl_s: the longest TTL taken, seconds; a longer one is clamped to it and counted (``ttl_clamped``).
        max_tier_fraction: the share of each local tier's capacity pinned blocks may take, ``(0, 1]``.
        max_bytes: pinned bytes over every local tier; 0 for no bound beyond the tiers' shares.
        max_tenant_bytes: pinned bytes of one tenant (``cache_salt``) over every local tier; 0 for none.
            Pinned blocks count against the tenant's quota (``limits.tenant_quota_bytes``) as any other.
    """

    max_ttl_s: float = 3600.0
    max_tier_fraction: float = 0.5
    max_bytes: int = 0
    max_tenant_bytes: int = 0

    def __post_init__(self) -> None:
        _require(0 < self.max_ttl_s <= 366 * 86400, "max_ttl_s", "must be > 0 and at most a year")
        _require(0 < self.max_tier_fraction <= 1, "max_tier_fraction", "must be in (0, 1]")
        _require(self.max_bytes >= 0, "max_bytes", "must be >= 0 (0 for no bound)")
        _require(self.max_tenant_bytes >= 0, "max_tenant_bytes", "must be >= 0 (0 for no bound)")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """The tiered store: which tiers, and how blocks move between them.

    Attributes:
        memory: the memory tier.
        disk: the LMDB tier (enabled by a path).
        redis: the Redis tier (enabled by a URL).
        promote_on_hit: copy a lower-tier hit into the memory tier.
        demote_min_priority: evicted blocks below this priority are dropped, not demoted
            (closing the store demotes them too where the disk has free room for them).
        max_block_bytes: the largest encoded block accepted, bytes.
        default_priority: priority of puts that name none, and after retention ends.
        policy: the eviction policy of every local tier: ``default`` (the node's default,
            ``kvstore.policy.DEFAULT_POLICY``), ``lru``, ``slru``, ``adaptive`` or ``session``; the names
            ``kvstore simulate --policy`` takes (``docs/simulate.md``, ``docs/agentic.md``).
        pins: the bounds on TTLs.
        miss_history_blocks: removals of blocks remembered to name the cause of a later miss
            (``kvstore.store.misses``; about 100 bytes each); 0 remembers none.
    """

    memory: MemoryTierConfig = field(default_factory=MemoryTierConfig)
    disk: DiskTierConfig = field(default_factory=DiskTierConfig)
    redis: RedisTierConfig = field(default_factory=RedisTierConfig)
    promote_on_hit: bool = True
    demote_min_priority: int = 0
    max_block_bytes: int = 64 * MiB
    default_priority: int = DEFAULT_PRIORITY
    policy: str = "default"
    pins: PinsConfig = field(default_factory=PinsConfig)
    miss_history_blocks: int = DEFAULT_HISTORY_BLOCKS

    def __post_init__(self) -> None:
        try:
            resolve_policy_name(self.policy)
        except ValueError:
            raise ConfigError("policy", f"unknown policy {self.policy!r}; known: default, "
                                        f"{', '.join(POLICY_NAMES)}") from None
        _require(0 <= self.demote_min_priority <= 101, "demote_min_priority", "must be in [0, 101]")
        _require(0 <= self.default_priority <= 100, "default_priority", "must be in [0, 100]")
        _require(self.max_block_bytes > 0, "max_block_bytes", "must be > 0")
        _require(self.miss_history_blocks >= 0, "miss_history_blocks", "must be >= 0")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The gRPC server.

    Attributes:
        host: bind address.
        port: gRPC port; 0 picks a free one, -1 listens on no TCP port (``unix_socket`` only).
        unix_socket: a Unix socket path to listen on as well (e.g. ``/run/kvstore/kvstore.sock``; clients
            connect to ``unix:///run/kvstore/kvstore.sock``), made ``0660``: whoever may write to it may
            call the node, so a pod or compose project needs no open port. Empty: none.
        metrics_port: Prometheus HTTP port; 0 picks a free one, -1 disables.
        metrics_host: bind address of the metrics endpoint.
        max_message_bytes: largest gRPC message sent or received, bytes; blocks move in chunks of this size.
        grace_s: seconds in-flight calls get to drain on shutdown.
        shutdown_delay_s: seconds a node that is shutting down keeps its port open
            first, answering health checks with NOT_SERVING and KVStore calls with
            UNAVAILABLE, so that readiness probes and load balancers see it leave
            (a "lame duck" period); 0 closes the port at once.
        log_level: ``DEBUG``, ``INFO``, ``WARNING`` or ``ERROR``.
        log_format: ``json`` (one object a line) or ``text``.
        event_loop: the asyncio event loop ``kvstore serve`` runs on: ``uvloop`` (libuv; a
            256 KiB Get took 2-7% less time in A/B runs of ``benchmarks/bench_service.py``'s node),
            ``asyncio`` (the standard library's), or ``auto``: uvloop where it is installed.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    unix_socket: str = ""
    metrics_port: int = 9400
    metrics_host: str = "127.0.0.1"
    max_message_bytes: int = 4 * MiB
    grace_s: float = 10.0
    shutdown_delay_s: float = 0.0
    log_level: str = "INFO"
    log_format: str = "json"
    event_loop: str = "auto"

    def __post_init__(self) -> None:
        _require(-1 <= self.port <= 65535, "port", f"must be in [-1, 65535], got {self.port}")
        _require(self.port >= 0 or bool(self.unix_socket), "port",
                 "-1 (no TCP port) needs server.unix_socket, or the node listens nowhere")
        _require(-1 <= self.metrics_port <= 65535, "metrics_port", f"must be in [-1, 65535], got {self.metrics_port}")
        _require(64 * KiB <= self.max_message_bytes <= 64 * MiB, "max_message_bytes", "must be in [64KiB, 64MiB]")
        _require(self.grace_s >= 0, "grace_s", "must be >= 0")
        _require(0 <= self.shutdown_delay_s < math.inf, "shutdown_delay_s", "must be >= 0 and finite")
        _require(self.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "log_level",
                 f"must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        _require(self.log_format in ("json", "text"), "log_format", "must be 'json' or 'text'")
        _require(self.event_loop in ("auto", "uvloop", "asyncio"), "event_loop",
                 f"must be 'auto', 'uvloop' or 'asyncio', got {self.event_loop!r}")


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Per-request and per-tenant limits enforced by the server (``docs/security.md``).

    The server's modules that enforce them: ``kvstore.server.inflight`` (calls in flight),
    ``kvstore.server.quota`` (bytes per tenant), ``kvstore.server.budgets`` (bytes of replies and Put
    bodies in flight) and ``kvstore.server.watchdog`` (stream length).

    Each breach has its status: too many hashes is INVALID_ARGUMENT; a block over
    ``store.max_block_bytes``, too many calls in flight, or a Put over the quota
    is RESOURCE_EXHAUSTED.

    Attributes:
        max_hashes_per_request: block hashes one Lookup, Get, Put or Delete may name.
        max_inflight_per_connection: concurrent calls one client connection (``context.peer()``) may have.
        tenant_quota_bytes: bytes one tenant (``cache_salt``) may hold across local tiers; 0 for no quota.
        max_put_bytes: bytes one Put stream may carry; the server buffers a whole Put
            before storing it, so this bounds that buffer (RESOURCE_EXHAUSTED beyond it).
        max_stream_s: seconds one Get or Put stream may last, whatever the client's
            deadline; past it (checked every min(1, max_stream_s / 4) seconds) the call ends
            with DEADLINE_EXCEEDED. A Get holds its
            blocks leased (unevictable) and a Put holds its buffer while the client is
            slow, so this bounds what a stalled or hostile client can pin. A Get's last
            message leaves with its status after the leases are released, and is not
            bounded by this: a reader stalled on it holds that message and its call's
            in-flight slot until the call's deadline or connection ends (``docs/security.md``).
        connection_reply_bytes: bytes of Get replies one connection may have in flight
            (read, not yet sent and acknowledged by gRPC); a Get past it waits, without reading
            or pinning anything, until earlier replies end (``kvstore.server.budgets.ReplyBudget``).
        tenant_reply_bytes: the same over every connection of one tenant (``cache_salt``).
        connection_put_bytes: bytes of Put bodies one connection's Puts may hold while the node receives
            them; a Put past it waits before it reads on (``kvstore.server.budgets.PutBudget``).
        tenant_put_bytes: the same over every connection of one tenant.
    """

    max_hashes_per_request: int = 8192
    max_inflight_per_connection: int = 256
    tenant_quota_bytes: int = 0
    max_put_bytes: int = 1 * GiB
    max_stream_s: float = 60.0
    connection_reply_bytes: int = 64 * MiB
    tenant_reply_bytes: int = 512 * MiB
    connection_put_bytes: int = 256 * MiB
    tenant_put_bytes: int = 1 * GiB

    def __post_init__(self) -> None:
        _require(self.max_hashes_per_request > 0, "max_hashes_per_request", "must be > 0")
        _require(self.max_inflight_per_connection > 0, "max_inflight_per_connection", "must be > 0")
        _require(self.tenant_quota_bytes >= 0, "tenant_quota_bytes", "must be >= 0 (0 for no quota)")
        _require(self.max_put_bytes > 0, "max_put_bytes", "must be > 0")
        _require(0 < self.max_stream_s < math.inf, "max_stream_s", "must be > 0 and finite")
        _require(self.connection_reply_bytes > 0, "connection_reply_bytes", "must be > 0")
        _require(self.tenant_reply_bytes > 0, "tenant_reply_bytes", "must be > 0")
        _require(self.connection_put_bytes > 0, "connection_put_bytes", "must be > 0")
        _require(self.tenant_put_bytes > 0, "tenant_put_bytes", "must be > 0")


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """TLS and bearer-token authentication of the gRPC server (``docs/security.md``, ``SECURITY.md``).

    Attributes:
        tls_cert_file: PEM server certificate (chain); TLS is on when set.
        tls_key_file: PEM server key.
        tls_client_ca_file: PEM CA that client certificates must chain to; when
            set, clients without such a certificate cannot connect (mutual TLS).
        auth_tokens_file: YAML/JSON file mapping tokens (or their SHA-256) to
            tenants; auth is on when this or ``auth_tokens`` is set (format in
            ``kvstore.server.auth``).
        auth_tokens: the same mapping inline, or the compact ``<token>=<tenant>,...;...``
            form, e.g. from ``KVSTORE_SECURITY__AUTH_TOKENS``.
        require_sha256: refuse namespaces hashed with xxh3 (INVALID_ARGUMENT);
            ``None`` (the default) means on exactly when auth is on.
    """

    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    auth_tokens_file: str = ""
    auth_tokens: str = ""
    require_sha256: bool | None = None

    def __post_init__(self) -> None:
        _require(bool(self.tls_cert_file) == bool(self.tls_key_file), "tls_key_file",
                 "tls_cert_file and tls_key_file must be set together")
        _require(not self.tls_client_ca_file or bool(self.tls_cert_file), "tls_client_ca_file",
                 "mutual TLS needs tls_cert_file and tls_key_file")


@dataclass(frozen=True, slots=True)
class SharedMemoryConfig:
    """The same-host data plane: block bytes through shared memory for clients on the node's host
    (``docs/shared-memory.md``; ``kvstore.shm``).

    A client on another host, or one that cannot reach the handoff socket, moves its
    bytes on the bulk path (``bulk``), or over gRPC; so does every client when this is off.

    Attributes:
        enabled: offer the same-host path (on Linux; elsewhere it is off with a log line).
        handoff_socket: the Unix socket where clients receive their sessions' segments; empty:
            ``<server.unix_socket>.shm`` when that is set (one shared directory carries both),
            else an abstract socket (no file; reachable from the node's network namespace).
        segment_bytes: size of each of a session's two segments (one for Gets, one for Puts),
            bytes; memory is taken only as pages are written, and a Get larger than this uses gRPC.
        max_sessions: same-host clients at once; more use gRPC.
        max_sessions_per_tenant: sessions one token (tenant) may have open at once, so that one
            cannot take them all; more are refused with RESOURCE_EXHAUSTED and use gRPC.
        tenant_leased_bytes: bytes of get segments one token's leases may hold at once; a Get past
            it goes over gRPC. 0: no bound of its own.
        max_leased_bytes: bytes of get segments every lease together may hold (the node's budget
            for same-host replies, beside the memory tier's capacity); 0: no bound.
        release_after_s: seconds after a lease ends before the node gives its pages back to the
            kernel (a client that reads again meanwhile reuses warm pages). 30 by default: a Get into
            pages given back pays a fresh page fault per 4 KiB page, which made a 16 MiB same-host
            Get after one idle second 6x slower than back to back (27 ms against 4.5 ms here,
            ``benchmarks/results/hitpath.md``); a worker that hits at least every 30 s never pays it.
        seal_get_segments: seal get segments with ``F_SEAL_FUTURE_WRITE``, so that no process, of
            the node's uid or root, can write them; their pages then stay until the session ends
            (``docs/shared-memory.md``).
        lease_s: seconds a Get's blocks stay in the client's segment unless it releases them first.
        grant_s: seconds a client has to redeem its session's grant on the handoff socket.
    """

    enabled: bool = True
    handoff_socket: str = ""
    segment_bytes: int = 256 * MiB
    max_sessions: int = 256
    max_sessions_per_tenant: int = 64
    tenant_leased_bytes: int = 1 * GiB
    max_leased_bytes: int = 4 * GiB
    release_after_s: float = 30.0
    seal_get_segments: bool = False
    lease_s: float = 30.0
    grant_s: float = 10.0

    def __post_init__(self) -> None:
        _require(self.segment_bytes >= 64 * KiB, "segment_bytes", "must be >= 64KiB")
        _require(self.max_sessions > 0, "max_sessions", "must be > 0")
        _require(self.max_sessions_per_tenant > 0, "max_sessions_per_tenant", "must be > 0")
        _require(self.tenant_leased_bytes >= 0, "tenant_leased_bytes", "must be >= 0 (0 for no bound)")
        _require(self.max_leased_bytes >= 0, "max_leased_bytes", "must be >= 0 (0 for no bound)")
        _require(0 <= self.release_after_s < math.inf, "release_after_s", "must be >= 0 and finite")
        _require(0 < self.lease_s < math.inf, "lease_s", "must be > 0 and finite")
        _require(0 < self.grant_s < math.inf, "grant_s", "must be > 0 and finite")


@dataclass(frozen=True, slots=True)
class BulkConfig:
    """The bulk path: block bytes of remote clients on a plain socket, off gRPC (``docs/scaleout.md``; ``kvstore.bulk``).

    A client calls ``BulkGet`` or ``BulkPut`` over gRPC, which checks its token,
    tenant and limits, leases the prefix or reserves room for the Put, and
    returns a one-time grant; the bytes then move on a connection to this
    listener (``recv_into`` the caller's tensors, ``sendmsg`` from the leased
    blocks). A client that cannot reach it uses Get and Put.

    Attributes:
        enabled: offer the bulk path.
        host: the listener's bind address; empty: ``server.host``. Off loopback, a node with bearer tokens
            offers it only over TLS (``security.tls_cert_file``: the listener then speaks TLS with the node's
            certificate, and asks for client certificates when ``security.tls_client_ca_file`` is set).
        port: its TCP port; 0 picks a free one (offered in ``Capabilities``; set one where only chosen ports
            are reachable, e.g. a container's).
        advertise_host: the host clients are told to connect to; empty: the host they reached gRPC at.
        max_connections: bulk connections at once; more are refused (the client uses gRPC).
        grant_s: seconds a grant may be redeemed in; an unredeemed Get grant's lease ends then.
        idle_s: seconds a connection may wait for its next grant before the node closes it.
        min_bytes_per_s: the slowest a transfer may run: each has ``min_transfer_s + its bytes / this`` to
            finish, so a peer that reads or sends slowly holds its lease or room, and a thread, for a bounded time.
        min_transfer_s: what every transfer may take beside its bytes, seconds.
        tenant_grant_bytes: bytes one tenant's outstanding grants (leased Gets, Puts' room) may hold; past it,
            its calls use Get and Put.
        max_grant_bytes: the same over every tenant.
    """

    enabled: bool = True
    host: str = ""
    port: int = 0
    advertise_host: str = ""
    max_connections: int = 256
    grant_s: float = 10.0
    idle_s: float = 60.0
    min_bytes_per_s: int = 64 * MiB
    min_transfer_s: float = 5.0
    tenant_grant_bytes: int = 1 * GiB
    max_grant_bytes: int = 4 * GiB

    def __post_init__(self) -> None:
        _require(0 <= self.port <= 65535, "port", f"must be in [0, 65535], got {self.port}")
        _require(self.max_connections > 0, "max_connections", "must be > 0")
        _require(0 < self.grant_s < math.inf, "grant_s", "must be > 0 and finite")
        _require(0 < self.idle_s < math.inf, "idle_s", "must be > 0 and finite")
        _require(self.min_bytes_per_s > 0, "min_bytes_per_s", "must be > 0")
        _require(0 < self.min_transfer_s < math.inf, "min_transfer_s", "must be > 0 and finite")
        _require(self.tenant_grant_bytes > 0, "tenant_grant_bytes", "must be > 0")
        _require(self.max_grant_bytes > 0, "max_grant_bytes", "must be > 0")


@dataclass(frozen=True, slots=True)
class EventsConfig:
    """The node's KV event stream for routers (``docs/events.md``; ``kvstore.events``); off unless ``endpoint`` is set.

    On a node with bearer tokens, subscribers authenticate with their token and
    each reads only the events of the tenants its token covers (``kvstore.events.access``).

    Attributes:
        endpoint: ZMQ address the node binds its PUB socket to, e.g. ``tcp://127.0.0.1:5557`` or
            ``ipc:///run/kvstore/events``; empty: no events. A node that authenticates its clients
            (tokens or client certificates) refuses a non-local one, unless it has tokens and
            ``allow_remote`` is set.
        replay_endpoint: the replay ROUTER's address; empty: the next tcp port (ipc: the path plus
            ``.replay``); ``off``: no replays.
        topic: the first frame of every batch (with tokens: the prefix of every stream's topic).
        hwm: ZMQ high-water mark per subscriber, batches; past it a slow subscriber misses batches (and replays).
        buffer_steps: batches kept for replay, per stream.
        buffer_bytes: bytes of batches kept for replay, per stream (the oldest go first).
        max_queue_events: block changes queued for the publisher before the node drops them (counted,
            and announced to subscribers as a clear).
        max_replays: replays served at once; more are refused (``error: busy``) until one ends.
        max_replays_per_stream: replays of one stream (one token's tenants) served at once.
        replay_hwm: batches queued on the node for one replay peer; the rest is sent as it reads.
        replay_stall_s: seconds a replay peer may read nothing before its replay is dropped.
        allow_remote: on a node with tokens, publish on a non-local endpoint (subscribers' tokens cross the
            network in the clear); a node that authenticates with client certificates alone cannot.
    """

    endpoint: str = ""
    replay_endpoint: str = ""
    topic: str = "kvstore"
    hwm: int = 100_000
    buffer_steps: int = 10_000
    buffer_bytes: int = 64 * MiB
    max_queue_events: int = 1_000_000
    max_replays: int = 64
    max_replays_per_stream: int = 16
    replay_hwm: int = 64
    replay_stall_s: float = 10.0
    allow_remote: bool = False

    def __post_init__(self) -> None:
        _require(not self.endpoint or self.endpoint.startswith(("tcp://", "ipc://", "inproc://")), "endpoint",
                 f"must be a ZMQ tcp://, ipc:// or inproc:// address, got {self.endpoint!r}")
        _require(self.hwm > 0, "hwm", f"must be > 0 (ZMQ reads 0 as no bound), got {self.hwm}")
        _require(self.buffer_steps > 0, "buffer_steps", f"must be > 0, got {self.buffer_steps}")
        _require(self.max_queue_events > 0, "max_queue_events", f"must be > 0, got {self.max_queue_events}")
        _require(self.buffer_bytes > 0, "buffer_bytes", f"must be > 0, got {self.buffer_bytes}")
        _require(self.max_replays > 0, "max_replays", f"must be > 0, got {self.max_replays}")
        _require(0 < self.max_replays_per_stream <= self.max_replays, "max_replays_per_stream",
                 f"must be in [1, max_replays={self.max_replays}], got {self.max_replays_per_stream}")
        _require(self.replay_hwm > 0, "replay_hwm", f"must be > 0 (ZMQ reads 0 as no bound), got {self.replay_hwm}")
        _require(self.replay_stall_s > 0, "replay_stall_s", f"must be > 0, got {self.replay_stall_s}")


@dataclass(frozen=True, slots=True)
class Config:
    """Everything ``kvstore serve`` and the embedded store read."""

    store: StoreConfig = field(default_factory=StoreConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    shared_memory: SharedMemoryConfig = field(default_factory=SharedMemoryConfig)
    bulk: BulkConfig = field(default_factory=BulkConfig)
    events: EventsConfig = field(default_factory=EventsConfig)


ENV_PREFIX = "KVSTORE_"
ENV_ALIASES: dict[str, str] = {
    "KVSTORE_HOST": "server.host",
    "KVSTORE_PORT": "server.port",
    "KVSTORE_UNIX_SOCKET": "server.unix_socket",
    "KVSTORE_SHARED_MEMORY": "shared_memory.enabled",
    "KVSTORE_BULK": "bulk.enabled",
    "KVSTORE_METRICS_PORT": "server.metrics_port",
    "KVSTORE_LOG_LEVEL": "server.log_level",
    "KVSTORE_MEMORY_CAPACITY": "store.memory.capacity_bytes",
    "KVSTORE_DISK_PATH": "store.disk.path",
    "KVSTORE_DISK_CAPACITY": "store.disk.capacity_bytes",
    "KVSTORE_REDIS_URL": "store.redis.url",
    "KVSTORE_POLICY": "store.policy",
    "KVSTORE_EVENTS_ENDPOINT": "events.endpoint",
}
"""Short environment names of the common settings, and the dotted field each sets."""


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Load the configuration: defaults, then the file, the environment and the overrides.

    Args:
        path: a ``.toml``, ``.yaml`` or ``.yml`` file whose tables mirror :class:`Config`.
        env: environment to read ``KVSTORE_*`` variables from; ``os.environ`` when ``None``.
        overrides: dotted field paths to values, e.g. ``{"server.port": 0}``; ``None`` values are skipped.

    Raises:
        ConfigError: naming the field, for an unknown field, a value of the wrong
            type, an out-of-range value, a malformed Redis URL (:func:`redis_url_problem`),
            a disk capacity with no disk path set anywhere (an empty path turns the tier
            off), or an unreadable file.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        _merge(tree, _read_file(Path(path)), "")
    environ = os.environ if env is None else env
    for name, value in sorted(environ.items()):
        if name in ENV_ALIASES:
            _set_path(tree, ENV_ALIASES[name], value)
        elif name.startswith(ENV_PREFIX) and "__" in name:
            _set_path(tree, name[len(ENV_PREFIX):].lower().replace("__", "."), value)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_path(tree, dotted, value)
    config = build(Config, tree, "")
    disk = tree.get("store", {}).get("disk", {})
    if "capacity_bytes" in disk and "path" not in disk:  # a path set to "" turns the tier off on purpose
        raise ConfigError("store.disk.capacity_bytes", "is set but store.disk.path is not, so there would be no "
                          "disk tier; add --disk-path DIR (store.disk.path, KVSTORE_DISK_PATH), or drop the capacity")
    return config


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError("config file", f"cannot read {path}: {exc}") from exc
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError("config file", f"cannot parse {path}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config file", f"{path} must hold a table at the top level")
    return data


def _merge(tree: dict[str, Any], data: Mapping[str, Any], prefix: str) -> None:
    for key, value in data.items():
        if isinstance(value, Mapping):
            _merge(tree.setdefault(key, {}), value, f"{prefix}{key}.")
        else:
            tree[key] = value


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(dotted, "is a section, not a value")
        node = child
    node[leaf] = value


_T = typing.TypeVar("_T")


def build(cls: type[_T], data: Mapping[str, Any], prefix: str) -> _T:
    """Build the config dataclass ``cls`` from a nested mapping, coercing strings to field types.

    Raises:
        ConfigError: naming the dotted field on any error.
    """
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in known:
            raise ConfigError(f"{prefix}{key}", f"unknown field; known: {sorted(known)}")
    kwargs: dict[str, Any] = {}
    for name in known:
        if name not in data:
            continue
        hint, dotted = hints[name], f"{prefix}{name}"
        value = data[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, Mapping):
                raise ConfigError(dotted, "must be a table")
            kwargs[name] = build(hint, value, f"{dotted}.")
        else:
            kwargs[name] = _coerce(dotted, name, hint, value)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{prefix}{exc.field}", str(exc).split(": ", 1)[1]) from None


def _coerce(dotted: str, name: str, hint: Any, value: Any) -> Any:
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
    if optional:
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "auto")):
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    try:
        if hint is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {value!r}")
        if hint is int:
            if name.endswith("_bytes"):
                return parse_size(value)
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(f"not an integer: {value!r}")
            return int(value)
        if hint is float:
            if isinstance(value, bool):
                raise ValueError(f"not a number: {value!r}")
            return float(value)
        if hint is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError(f"not a string: {value!r}")
            return str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(dotted, str(exc)) from None
    raise ConfigError(dotted, f"unsupported field type {hint}")
