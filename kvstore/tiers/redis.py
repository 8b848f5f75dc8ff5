"""The shared Redis (or Redis Cluster) tier: one key per block, batched, bounded, never failing its caller.

Keys, generations, batches: :mod:`kvstore.tiers.redis_values`. Commands: :mod:`kvstore.tiers.redis_connection`.

Failures. Redis is a cache here, so nothing it does reaches the caller as an error: a server that is down,
restarting, slow, full ("OOM command not allowed") or a black hole makes a get miss, a contains answer ``False``,
a put return ``False`` and a delete do nothing. Every call is bounded twice: by redis-py's connect and socket
timeouts, and by an ``asyncio.wait_for`` around each round trip, so a server that accepts TCP and never answers
cannot hang a call. Consecutive failures open a :class:`~kvstore.tiers.breaker.CircuitBreaker`; while it is open
calls return at once, and after ``breaker_reset_s`` one trial call probes the server. redis-py reconnects on the
next command (the pool replaces dead connections on checkout), and a cluster client is rebuilt after a failure so
that a stale slot map cannot outlive a restart.

Capacity. Redis manages its own memory (``maxmemory`` with ``allkeys-lru``), so the tier is unbounded to the store
(``capacity_bytes = None``), is not indexed by it, and :meth:`RedisTier.resident` lists nothing: the store asks
Redis instead. See ``docs/redis.md`` for the server settings.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Mapping, Sequence, TypeVar

import redis.exceptions as rexc
from redis.utils import HIREDIS_AVAILABLE

from kvstore.tiers.compression import Codec, Compressor, pack_all, unpack_or_keep
from kvstore.config import RedisTierConfig
from kvstore.errors import UnavailableError
from kvstore.keys import NAMESPACE_TAG_BYTES, BlockKey
from kvstore.tiers.logical import block_logical_nbytes
from kvstore.tiers.base import BlockMeta, ResidentEntry
from kvstore.tiers.breaker import BreakerState, CircuitBreaker
from kvstore.tiers.redis_connection import (
    RoundTripFailed,
    await_both,
    check_url,
    config_get_max_bulk_len,
    make_client,
    mget,
    pipelined,
    read_password,
    redacted_url,
    scan,
    set_many,
)
# CHUNK_BYTES and the other sizes are re-exported from their old home
from kvstore.tiers.redis_link import RedisLink
from kvstore.tiers.redis_values import (
    CHUNK_BYTES,
    CORRUPT,
    DEFAULT_PROTO_MAX_BULK_LEN,
    DEFAULT_VALUE_BYTES_HINT,
    FOREIGN,
    SCAN_COUNT,
    VERIFY_OFFLOAD_BYTES,
    chunks_by_bytes,
    generation_of,
    positions_by_namespace,
    verify_all,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class RedisTier:
    """Blocks in a shared Redis or Redis Cluster, one key each; implements :class:`~kvstore.tiers.base.Tier`.

    Every method must be called from one asyncio loop (the store's). No method
    raises for a Redis failure; see the module docstring and :meth:`counters`.

    Args:
        cfg: the ``store.redis`` config section; ``cfg.url`` must be set.
        name: tier name in stats and metrics.
        breaker_clock: monotonic time of the circuit breaker, seconds (``breaker_reset_s`` runs on it);
            ``time.monotonic`` unless a test injects one.

    Attributes:
        name: tier name.
        capacity_bytes: always ``None``: Redis bounds itself with ``maxmemory``.
        persistent: ``False``: :meth:`resident` always lists nothing, because the
            store does not index a tier that other nodes write to; blocks do
            outlive this process, and the store finds them by asking.
        mode: ``write_back`` or ``write_through``, from the config; the store acts on it.

    Raises:
        ConfigError: if the URL is empty or not ``redis://``, ``rediss://`` or
            ``unix://``, if TLS files are given without ``rediss://``, if both
            ``password`` and ``password_file`` are set, or if the password file
            cannot be read.
    """

    capacity_bytes: int | None = None
    persistent = False

    def __init__(self, cfg: RedisTierConfig, *, name: str = "redis",
                 breaker_clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.cfg = cfg
        self.mode = cfg.mode
        self._compressor = Compressor(Codec(cfg.compression))  # blocks stored compressed (kvstore.tiers.compression)
        self._scheme = check_url(cfg)
        self._password = read_password(cfg)
        self._prefix = cfg.prefix
        self._px_ms = max(1, round(cfg.ttl_s * 1000)) if cfg.ttl_s > 0 else None
        self._op_bound_s = 2 * (cfg.connect_timeout_s + 2 * cfg.socket_timeout_s)
        self._breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_reset_s, clock=breaker_clock)
        self._server_max_value_bytes: int | None = None
        self._value_bytes_hint = DEFAULT_VALUE_BYTES_HINT
        self._closed = False
        self._generations: dict[bytes, int] = {}  # namespace tag -> newest generation seen
        self._counts = dict.fromkeys(
            ("written", "written_logical_bytes", "written_stored_bytes", "skipped_writes", "oversized", "oom_rejected", "errors",
             "timeouts", "breaker_open", "corrupt_records", "foreign_records", "stale_generation"),
            0,
        )
        self._link = RedisLink(cfg, name, self._breaker, self._counts,
                               lambda: make_client(cfg, self._scheme, self._password), self._op_bound_s)
        if not HIREDIS_AVAILABLE:
            logger.warning("redis tier %s: hiredis is not installed; replies are parsed in Python (slower)", name)
        logger.info(
            "redis tier %s: %s%s, prefix %r, mode %s, ttl %ss, hiredis %s",
            name, self._redacted_url(), " (cluster)" if cfg.cluster else "", cfg.prefix, cfg.mode,
            cfg.ttl_s, HIREDIS_AVAILABLE,
        )

    @classmethod
    def from_config(cls, cfg: RedisTierConfig, *, name: str = "redis") -> RedisTier:
        """Build the tier from its config section (``store.redis``); see :class:`RedisTier`."""
        return cls(cfg, name=name)

    def _redacted_url(self) -> str:
        return redacted_url(self.cfg.url)

    @property
    def state(self) -> str:
        """``up``, or ``down`` from a failed round trip until one succeeds (:class:`~kvstore.tiers.base.ReachableTier`)."""
        return self._link.state

    @property
    def last_error(self) -> str:
        """The last failure and when it happened (UTC), e.g. ``ConnectionError: ... (at 2026-01-02T03:04:05Z)``."""
        return self._link.last_error

    # -- key encoding ---------------------------------------------------------------

    def redis_key(self, key: BlockKey, generation: int | None = None) -> str:
        """The Redis key of a block: ``<prefix>:<namespace tag hex>:<generation>:<block hash hex>``.

        Args:
            key: the block key.
            generation: the namespace's generation; the newest this tier has seen when ``None``.
        """
        text = key.hex()
        tag = text[: 2 * NAMESPACE_TAG_BYTES]
        if generation is None:
            generation = self.generation(key[:NAMESPACE_TAG_BYTES])
        return f"{self._prefix}:{tag}:{generation}:{text[2 * NAMESPACE_TAG_BYTES :]}"

    def generation_key(self, tag: bytes) -> str:
        """The Redis key that holds a namespace's generation: ``<prefix>:<namespace tag hex>:generation``."""
        return f"{self._prefix}:{tag.hex()}:generation"

    def namespace_pattern(self, tag: bytes) -> str:
        """The ``SCAN MATCH`` pattern of every key of one namespace: ``<prefix>:<tag hex>:*``."""
        return f"{self._prefix}:{tag.hex()}:*"

    # -- accounting -------------------------------------------------------------------

    def footprint(self, nbytes: int) -> int:
        """Bytes a value of ``nbytes`` counts for: ``nbytes`` (Redis accounts its own overhead)."""
        return nbytes

    @property
    def breaker_state(self) -> BreakerState:
        """State of the circuit breaker: ``closed``, ``open`` or ``half_open``."""
        return self._breaker.state

    def counters(self) -> dict[str, int]:
        """Event counts since start.

        Hits and misses are the store's (``TierStats``), counted as for every
        tier. Keys: ``written`` and
        ``skipped_writes`` (keys put or not put, for any reason), ``written_logical_bytes`` and
        ``written_stored_bytes`` (of the keys written: their tensors' bytes, decoded and uncompressed, and the
        bytes Redis stores for them; the node does not index Redis, so these count writes, not what is resident), ``oversized``
        (keys refused before sending: over ``max_value_bytes`` or the server's
        ``proto-max-bulk-len``), ``oom_rejected`` (keys refused by a full
        server), ``errors`` (round trips that failed: unreachable, timed out or
        an error reply other than OOM), ``timeouts`` (those of ``errors`` that
        timed out), ``breaker_open`` (calls short-circuited by the open
        breaker), ``breaker_trips`` (times it opened), ``corrupt_records``
        (values that failed their checks, deleted), ``foreign_records`` (blocks
        of another format version, from nodes of another release: misses, kept)
        and ``stale_generation``
        (calls that found their namespace moved to a newer generation: a get
        or lookup is made again under it, a write is unlinked and skipped).
        """
        return {**self._counts, "breaker_trips": self._breaker.num_trips}

    # -- the Tier protocol ------------------------------------------------------------

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is in Redis under its namespace's current generation (pipelined ``EXISTS``);
        ``False`` for all while Redis fails.

        Raises:
            UnavailableError: if the tier is closed.
        """
        self._check_open()
        found = [False] * len(keys)
        if not keys:
            return found
        if not self._link.admit():
            return found
        try:
            for tag, positions in positions_by_namespace(keys).items():
                for _ in range(2):  # once more if the namespace turns out to have moved on (cleared elsewhere)
                    generation = self.generation(tag)
                    names = [self.redis_key(keys[i], generation) for i in positions]
                    replies, seen = await self._link.round_trip(
                        await_both(pipelined(self._link.client, "exists", names), self._read_generation(tag)),
                        self._op_bound_s)
                    if not self._stale(tag, generation, seen):
                        break
                self._count_reply_errors(replies)
                for i, reply in zip(positions, replies):
                    found[i] = isinstance(reply, int) and reply > 0
        except RoundTripFailed as exc:
            self._link.on_failure(exc)
            return [False] * len(keys)
        self._link.on_success()
        return found

    async def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """Each key's verified value under its namespace's current generation, or ``None`` for a miss, a corrupt
        value or a Redis failure.

        Values are fetched with ``MGET`` in chunks of about :data:`CHUNK_BYTES`; a
        value failing its checksum is deleted and counted as ``corrupt_records``.
        If Redis fails part-way, the chunks fetched before the failure still hit.

        Raises:
            UnavailableError: if the tier is closed.
        """
        self._check_open()
        results: list[bytes | None] = [None] * len(keys)
        if not keys or not self._link.admit():
            return results
        failure: RoundTripFailed | None = None
        corrupt: list[str] = []
        for tag, positions in positions_by_namespace(keys).items():
            for _ in range(2):  # once more if the namespace turns out to have moved on (cleared elsewhere)
                generation = self.generation(tag)
                names = [self.redis_key(keys[i], generation) for i in positions]
                values, bad, seen, failure = await self._mget_chunks(names, tag)
                if failure is not None or not self._stale(tag, generation, seen):
                    break
            for j in bad:
                values[j] = None
            corrupt += [names[j] for j in bad]
            for i, value in zip(positions, values):
                results[i] = value
            if failure is not None:
                break
        self._link.on_outcome(failure)
        if corrupt:
            await self._drop_corrupt(corrupt)
        return results

    async def _mget_chunks(self, names: list[str], tag: bytes
                           ) -> tuple[list[bytes | None], list[int], int | None, RoundTripFailed | None]:
        """``MGET`` of ``names`` in chunks, the namespace's generation read beside the first.

        A chunk of at least :data:`VERIFY_OFFLOAD_BYTES` is checksummed in a
        worker thread while the next one is fetched, the others on the loop.

        Returns:
            The values (``None`` past a failure), the positions of those that
            failed their checksum, the generation seen, and the failure, if any.
        """
        values: list[bytes | None] = [None] * len(names)
        per_chunk = max(1, CHUNK_BYTES // self._value_bytes_hint)
        seen: int | None = None
        failure: RoundTripFailed | None = None
        verdicts: list[tuple[int, Awaitable[list[int]] | list[int]]] = []
        for start in range(0, len(names), per_chunk):
            chunk = names[start:start + per_chunk]
            try:
                if start == 0:
                    fetched, seen = await self._link.round_trip(
                        await_both(mget(self._link.client, self.cfg.cluster, chunk), self._read_generation(tag)),
                        self._op_bound_s)
                else:
                    fetched = await self._link.round_trip(mget(self._link.client, self.cfg.cluster, chunk), self._op_bound_s)
            except RoundTripFailed as exc:
                failure = exc
                break
            sizes = [len(v) for v in fetched if v is not None]
            if sizes:
                self._value_bytes_hint = max(self._value_bytes_hint, max(sizes))
            fetched = [None if v is None else unpack_or_keep(v) for v in fetched]  # frames: their blocks
            values[start:start + len(chunk)] = fetched
            if sum(sizes) >= VERIFY_OFFLOAD_BYTES:  # checksum in a thread while the next chunk arrives
                verdicts.append((start, asyncio.ensure_future(asyncio.to_thread(verify_all, fetched))))
            else:
                verdicts.append((start, verify_all(fetched)))
        corrupt: list[int] = []
        for start, verdict in verdicts:
            found = verdict if isinstance(verdict, list) else await verdict
            for j, outcome in enumerate(found):
                if outcome == CORRUPT:
                    corrupt.append(start + j)
                elif outcome == FOREIGN:  # a miss, left for the node of the release that wrote it
                    values[start + j] = None
                    self._counts["foreign_records"] += 1
        return values, corrupt, seen, failure

    async def put(self, keys: Sequence[BlockKey], values: Sequence[bytes], metas: Sequence[BlockMeta], *,
                  generations: Mapping[bytes, int] | None = None) -> list[bool]:
        """``SET`` each value (with ``PX`` when ``ttl_s`` is set); ``False`` where it was not written.

        Each key is written under its namespace's generation as of the call
        (or as ``generations`` names it: the store passes the one it knew when
        the copy was prepared), so a copy that began before a clear lands
        under the old generation, where nothing reads it. A write that finds
        the namespace moved on meanwhile is unlinked again and counted as
        skipped. A value over ``max_value_bytes`` or the server's
        ``proto-max-bulk-len`` is refused before it is sent (``oversized``;
        nothing is written under its key); a full server's "OOM command not
        allowed" refuses that key (``oom_rejected``); while Redis fails, the
        rest of the batch is skipped. Priorities in ``metas`` are not stored:
        Redis evicts by its own ``maxmemory-policy``; a TTL in ``metas`` longer than
        ``ttl_s`` sets its key's expiry (``PX``) to the TTL's end. Never raises
        :class:`~kvstore.tiers.base.TierFullError`.

        Args:
            keys: block keys.
            values: encoded blocks, one per key.
            metas: one per key (unused).
            generations: namespace tag -> the generation to write under; this tier's newest known when absent.

        Raises:
            UnavailableError: if the tier is closed.
            ValueError: if ``keys`` and ``values`` differ in length.
        """
        self._check_open()
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        stored = [False] * len(keys)
        if not keys:
            return stored
        logical = [block_logical_nbytes(value) for value in values]  # for the counters, before compression
        values = await pack_all(self._compressor, values)  # compressed where that saves (kvstore.tiers.compression)
        groups = positions_by_namespace(keys)
        written_under = {tag: (generations or {}).get(tag, self.generation(tag)) for tag in groups}  # before any await
        if not self._link.admit():
            self._counts["skipped_writes"] += len(keys)
            return stored
        failure: RoundTripFailed | None = None
        try:
            limit_bytes = await self._max_value_bytes()
        except RoundTripFailed as exc:
            self._link.on_failure(exc)
            self._counts["skipped_writes"] += len(keys)
            return stored
        num_oversized = sum(len(value) > limit_bytes for value in values)
        if num_oversized:
            self._counts["oversized"] += num_oversized
            logger.warning("redis tier %s: refused %s values over %s bytes", self.name, num_oversized, limit_bytes)
        sizes = [len(value) for value in values if len(value) <= limit_bytes]
        if sizes:
            self._value_bytes_hint = max(self._value_bytes_hint, max(sizes))
        expiries = self._expiries(metas)
        for tag, positions in groups.items():
            items = [i for i in positions if len(values[i]) <= limit_bytes]
            generation = written_under[tag]
            failure, seen = await self._set_chunks(items, keys, values, generation, tag, stored, expiries)
            if failure is not None:
                break
            if self._stale(tag, generation, seen):  # cleared meanwhile (or before, on another node): not readable
                await self._unlink_quietly([self.redis_key(keys[i], generation) for i in items if stored[i]])
                for i in items:
                    stored[i] = False
        self._link.on_outcome(failure)
        num_written = sum(stored)
        self._counts["written"] += num_written
        self._counts["written_logical_bytes"] += sum(n for n, ok in zip(logical, stored) if ok)
        self._counts["written_stored_bytes"] += sum(len(v) for v, ok in zip(values, stored) if ok)
        self._counts["skipped_writes"] += len(keys) - num_written
        return stored

    def _expiries(self, metas: Sequence[BlockMeta]) -> list[int | None] | None:
        """Per block, its key's ``PX``, where a TTL outlasts ``ttl_s``: a key lives at least as long as its block's
        TTL (``docs/agentic.md``: Redis has no pins, but its expiry must not end a TTL early). ``None`` when every
        key takes ``ttl_s``'s (or none, without one: a key without expiry outlives any TTL)."""
        if self._px_ms is None or not any(meta.pinned_until for meta in metas):
            return None
        now = time.time()
        return [max(self._px_ms, round((meta.pinned_until - now) * 1000)) for meta in metas]

    async def _set_chunks(self, items: list[int], keys: Sequence[BlockKey], values: Sequence[bytes],
                          generation: int, tag: bytes, stored: list[bool], expiries: list[int | None] | None = None
                          ) -> tuple[RoundTripFailed | None, int | None]:
        """``SET`` ``values[i]`` for each of ``items`` under ``generation``, in chunks, the namespace's generation
        read beside the last; marks ``stored``. Returns the failure, if any, and the generation seen. ``expiries``:
        each block's ``PX`` (:meth:`_expiries`), else ``ttl_s``'s."""
        chunks = chunks_by_bytes([len(values[i]) for i in items], CHUNK_BYTES)
        seen: int | None = None
        for n, chunk in enumerate(chunks):
            batch = [items[j] for j in chunk]
            work = set_many(self._link.client, [self.redis_key(keys[i], generation) for i in batch],
                            [values[i] for i in batch],
                            self._px_ms if expiries is None else [expiries[i] for i in batch])
            try:
                if n == len(chunks) - 1:
                    replies, seen = await self._link.round_trip(await_both(work, self._read_generation(tag)), self._op_bound_s)
                else:
                    replies = await self._link.round_trip(work, self._op_bound_s)
            except RoundTripFailed as exc:
                return exc, seen
            for i, reply in zip(batch, replies):
                stored[i] = reply is True
            self._count_reply_errors(replies)
        return None, seen

    async def delete(self, keys: Sequence[BlockKey]) -> None:
        """``UNLINK`` each key under its namespace's current generation (pipelined); best effort: nothing happens
        while Redis fails, and a write of the key already on its way may land after it.

        Raises:
            UnavailableError: if the tier is closed.
        """
        self._check_open()
        if not keys or not self._link.admit():
            return
        try:
            await self._unlink([self.redis_key(k) for k in keys])
        except RoundTripFailed as exc:
            self._link.on_failure(exc)
        else:
            self._link.on_success()

    async def resident(self) -> list[ResidentEntry]:
        """Always ``[]``: the store does not index the shared tier, it asks Redis (see the class docstring).

        Raises:
            UnavailableError: if the tier is closed.
        """
        self._check_open()
        return []

    async def close(self) -> None:
        """Close the connection pool(s); idempotent. Every method raises :class:`UnavailableError` afterwards."""
        if self._closed:
            return
        self._closed = True
        await self._link.close()
        logger.info("redis tier %s closed", self.name)

    # -- extras used by the store -----------------------------------------------------

    async def ping(self) -> bool:
        """Whether Redis answers ``PING`` within the call bound; the outcome feeds the breaker.

        A ping is sent even while the breaker is open, so a health check can
        close the breaker as soon as Redis is back.

        Raises:
            UnavailableError: if the tier is closed.
        """
        self._check_open()
        self._link.refresh_client()
        try:
            ok = await self._link.round_trip(self._link.client.ping(), self._op_bound_s)
        except RoundTripFailed as exc:
            self._link.on_failure(exc)
            return False
        self._link.on_success()
        return bool(ok)

    async def check_at_start(self) -> bool:
        """One ``PING`` as the store opens; on a failure, a WARNING naming the URL and the error.

        The node serves all the same, from its local tiers: Redis reads are misses and writes
        are skipped until Redis answers (``state`` and ``last_error`` in the stats say so).

        Returns:
            Whether Redis answered.
        """
        if await self.ping():
            return True
        logger.warning(
            "redis tier %s: Redis at %s does not answer at start (%s); serving from the local tiers, with Redis "
            "reads as misses and writes skipped until it answers; check store.redis.url (--redis-url, "
            "KVSTORE_REDIS_URL) and that Redis is up", self.name, self._redacted_url(), self.last_error,
            extra={"fields": {"tier": self.name, "url": self._redacted_url(), "error": self.last_error}},
        )
        return False

    async def clear_namespace(self, tag: bytes) -> int:
        """Move a namespace to a new generation (``INCR`` of its generation key): no node reads its old keys again.

        Every node reads the generation beside each call, so a lookup or get
        that starts after this returns, on any node, finds none of the old
        blocks, and a write that began before it lands where nothing reads. The
        old keys are left for :meth:`sweep_namespace`.

        Args:
            tag: the 8-byte namespace tag (:attr:`kvstore.keys.Namespace.tag`).

        Returns:
            The namespace's new generation.

        Raises:
            UnavailableError: if the tier is closed, the breaker is open, or Redis cannot be reached.
        """
        self._check_open()
        if not self._link.admit():
            raise UnavailableError(
                f"redis tier {self.name}: Redis at {self._redacted_url()} is down (circuit breaker open; last error: "
                f"{self.last_error or 'none'}); its blocks of the namespace were not cleared: retry once it answers")
        try:
            generation = int(await self._link.round_trip(self._link.client.incr(self.generation_key(tag)), self._op_bound_s))
        except RoundTripFailed as exc:
            self._link.on_failure(exc)
            raise UnavailableError(f"redis tier {self.name}: clearing namespace {tag.hex()} in Redis at "
                                   f"{self._redacted_url()} failed: {exc}") from exc
        self._link.on_success()
        self._generations[tag] = max(self.generation(tag), generation)
        logger.info("redis tier %s: namespace %s is at generation %d", self.name, tag.hex(), generation)
        return generation

    async def sweep_namespace(self, tag: bytes, generation: int) -> int:
        """Unlink a namespace's keys of generations before ``generation``: ``SCAN MATCH <prefix>:<tag hex>:*``.

        In a cluster every primary is scanned. Best effort: what a failure
        leaves ages out under Redis's own eviction (or ``ttl_s``), and nothing
        reads it meanwhile.

        Returns:
            Number of keys unlinked.

        Raises:
            UnavailableError: if the tier is closed.
        """
        self._check_open()
        if not self._link.admit():
            return 0
        pattern = self.namespace_pattern(tag)
        num_removed = 0
        try:
            if self.cfg.cluster:
                await self._link.round_trip(self._link.client.initialize(), self._op_bound_s)
                targets: list[Any] = list(self._link.client.get_primaries())
            else:
                targets = [None]
            for node in targets:
                cursor = 0
                while True:
                    cursor, names = await self._link.round_trip(scan(self._link.client, node, cursor, pattern, SCAN_COUNT),
                                                           self._op_bound_s)
                    old = [name for name in names if generation_of(name) < generation]
                    if old:
                        num_removed += sum(r for r in await self._unlink(old) if isinstance(r, int))
                    if cursor == 0:
                        break
        except RoundTripFailed as exc:
            self._link.on_failure(exc)
            logger.warning("redis tier %s: sweeping %s stopped after %d keys: %s", self.name, pattern, num_removed,
                           exc)
            return num_removed
        self._link.on_success()
        logger.info("redis tier %s: swept %d keys of %s before generation %d", self.name, num_removed, pattern,
                    generation)
        return num_removed

    def generation(self, tag: bytes) -> int:
        """The newest generation of a namespace this tier has seen (0 before any clear)."""
        return self._generations.get(tag, 0)

    async def _read_generation(self, tag: bytes) -> int:
        """The namespace's generation in Redis (its key missing reads 0)."""
        raw = await self._link.client.get(self.generation_key(tag))
        return int(raw) if raw is not None else 0

    def _stale(self, tag: bytes, used: int, seen: int | None) -> bool:
        """Whether a call made under generation ``used`` is stale: Redis has a newer one (which it now knows)."""
        if seen is None or seen <= used:
            return False
        self._generations[tag] = seen
        self._counts["stale_generation"] += 1
        return True

    async def _unlink_quietly(self, names: list[str]) -> None:
        if names:
            try:
                await self._unlink(names)
            except RoundTripFailed as exc:
                self._link.on_failure(exc)

    # -- internals ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError(f"redis tier {self.name} is closed")

    async def _unlink(self, names: Sequence[str | bytes]) -> list[Any]:
        """Pipelined ``UNLINK`` of ``names``; error replies are counted, a failed round trip raises.

        Raises:
            RoundTripFailed: if the round trip failed.
        """
        replies = await self._link.round_trip(pipelined(self._link.client, "unlink", names), self._op_bound_s)
        self._count_reply_errors(replies)
        return replies

    def _count_reply_errors(self, replies: Sequence[Any]) -> None:
        for reply in replies:
            if not isinstance(reply, Exception):
                continue
            if isinstance(reply, rexc.OutOfMemoryError) or str(reply).startswith("OOM"):
                self._counts["oom_rejected"] += 1
            else:
                self._counts["errors"] += 1
                logger.warning("redis tier %s: error reply: %s", self.name, reply)

    async def _drop_corrupt(self, names: list[str]) -> None:
        self._counts["corrupt_records"] += len(names)
        logger.warning("redis tier %s: %s values failed their checksum; deleting %s", self.name, len(names),
                       ", ".join(names[:4]) + (" ..." if len(names) > 4 else ""))
        try:
            await self._unlink(names)
        except RoundTripFailed as exc:
            self._link.on_failure(exc)

    async def _max_value_bytes(self) -> int:
        """``min(max_value_bytes, proto-max-bulk-len)``; the server's limit is read once, when allowed."""
        if self._server_max_value_bytes is None:
            self._server_max_value_bytes = await self._read_proto_max_bulk_len()
        return min(self.cfg.max_value_bytes, self._server_max_value_bytes)

    async def _read_proto_max_bulk_len(self) -> int:
        value = await self._link.round_trip(config_get_max_bulk_len(self._link.client, self.cfg.cluster, self.name),
                                       self._op_bound_s)
        return DEFAULT_PROTO_MAX_BULK_LEN if value is None else value
