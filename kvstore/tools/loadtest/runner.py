"""Replay a trace against running kvstore nodes: lookup, get and verify the hit prefix, put the rest.

Per request, in the namespace of :func:`kvstore.tools.loadtest.blocks.loadtest_namespace`:

1. map the trace block ids to chained block hashes (:func:`trace_block_hashes`);
2. Lookup the longest cached prefix (``LookupResult.num_blocks`` and its tiers);
3. Get that prefix and compare every block byte for byte with the block the
   :class:`PayloadFactory` makes for its hash; a differing block is a mismatch.
   A get that returns fewer blocks than the lookup found (the tail was evicted
   in between, possible with concurrent requests) ends the hit there;
4. Put every block after the hit prefix. The store skips the resident ones and
   counts them as accessed, so all blocks of the request count as accessed,
   which is the replay model of ``kvstore.tools.sim``.

A request's agentic session and TTL (``TraceRequest.session``, ``ttl_s``;
``docs/agentic.md``) go with its lookup, get and put, the TTL times
``ttl_scale``; a request of another namespace label (``TraceRequest.namespace``)
is replayed under the namespace whose revision is the label. The node's missed
blocks by cause over the run (its stats before and after) come with the result:
with one worker they sum to the blocks the run missed, and ``kvstore simulate``
names the same causes on the same trace.

Hit ratio = hit blocks / requested blocks over the requests that completed, as
in ``kvstore.tools.sim``; token hit ratio likewise (``min(hits * block_tokens,
input_tokens)`` per request). A failed call ends its request, which then counts
only as an error.

Pacing. Closed loop (``speedup=None``): ``concurrency`` workers take requests
in file order, each starting the next when its last one finishes; with one
worker the replay is in file order, as the simulator's. Open loop: request
``i`` starts at ``(t_i - t_0) / speedup`` seconds after the start, with at most
``max_inflight`` requests in flight; a request that has to wait for a slot starts
late, and the lag is reported. Either way the test stops at the end of the
trace, after ``max_requests`` requests, or once ``duration_s`` has passed (no new
request starts then; those in flight finish).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Sequence

from kvstore.client import DEFAULT_TIMEOUT_S, AsyncKVStoreClient
from kvstore.errors import InvalidArgumentError, KVStoreError
from kvstore.keys import Namespace
from kvstore.tools.loadtest.blocks import (
    DEFAULT_MODEL,
    DEFAULT_PAYLOAD_BYTES,
    PayloadFactory,
    check_payload_bytes,
    loadtest_namespace,
    trace_block_hashes,
)
from kvstore.tools.loadtest.metrics import Recorder, RequestOutcome, latency_summary
from kvstore.tools.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

logger = logging.getLogger(__name__)

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_MAX_INFLIGHT = 64
DEFAULT_WINDOW_S = 5.0
_PROGRESS_EVERY_S = 0.5
_MAX_LOGGED_MISMATCHES = 5


@dataclass(frozen=True, slots=True)
class LoadTestConfig:
    """Settings of one load test.

    Attributes:
        targets: ``host:port`` of each node; see :func:`open_client` for how several are used.
        concurrency: closed-loop workers (ignored in open loop).
        speedup: open loop when set: trace time runs this many times faster than
            wall time; ``None`` for closed loop.
        max_inflight: open loop: requests in flight at most.
        max_requests: stop after this many requests of the trace; ``None`` for all.
        duration_s: start no request after this many seconds; ``None`` for no limit.
        payload_bytes: tensor bytes of one block (a multiple of ``2 * block_tokens``);
            an encoded block is 128 bytes more.
        block_tokens: tokens per trace block (512 for Mooncake).
        model: ``Namespace.model`` of the blocks.
        cache_salt: ``Namespace.cache_salt`` of the blocks: the tenant, which a node with tokens
            checks against the token's tenants.
        hash_algorithm: ``Namespace.hash_algorithm`` of the blocks (``sha256`` for a node with tokens).
        seed: payload seed (see :class:`PayloadFactory`).
        window_s: length of the time windows of the hit ratio over time, seconds.
        timeout_s: deadline of each call, seconds.
        verify: compare every got block with its expected bytes.
        ttl_scale: what a request's TTL is multiplied by before it is sent (trace seconds to wall seconds:
            ``1 / speedup`` keeps an open loop's TTLs as the trace has them).

    Raises:
        InvalidArgumentError: on a value out of range, ``block_tokens`` below 3, or a
            ``payload_bytes`` that is not a positive multiple of ``2 * block_tokens``.
    """

    targets: tuple[str, ...] = (DEFAULT_TARGET,)
    concurrency: int = 1
    speedup: float | None = None
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    max_requests: int | None = None
    duration_s: float | None = None
    payload_bytes: int = DEFAULT_PAYLOAD_BYTES
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    model: str = DEFAULT_MODEL
    cache_salt: str = ""
    hash_algorithm: str = "xxh3_128"
    seed: int = 0
    window_s: float = DEFAULT_WINDOW_S
    timeout_s: float = DEFAULT_TIMEOUT_S
    verify: bool = True
    ttl_scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        checks = (
            (bool(self.targets), "give at least one target"),
            (self.concurrency >= 1, f"concurrency must be >= 1, got {self.concurrency}"),
            (self.speedup is None or self.speedup > 0, f"speedup must be > 0, got {self.speedup}"),
            (self.max_inflight >= 1, f"max_inflight must be >= 1, got {self.max_inflight}"),
            (self.max_requests is None or self.max_requests >= 0,
             f"max_requests must be >= 0, got {self.max_requests}"),
            (self.duration_s is None or self.duration_s > 0, f"duration_s must be > 0, got {self.duration_s}"),
            (self.window_s > 0, f"window_s must be > 0, got {self.window_s}"),
            (self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}"),
            (0 < self.ttl_scale < float("inf"), f"ttl_scale must be a number > 0, got {self.ttl_scale}"),
        )
        for ok, message in checks:
            if not ok:
                raise InvalidArgumentError(message)
        self.namespace()
        check_payload_bytes(self.block_tokens, self.payload_bytes)

    def namespace(self) -> Namespace:
        """The namespace of the replayed blocks (:func:`loadtest_namespace` of these settings).

        Raises:
            InvalidArgumentError: on a block size below 3 or an invalid namespace field.
        """
        try:
            return loadtest_namespace(self.block_tokens, model=self.model, cache_salt=self.cache_salt,
                                      hash_algorithm=self.hash_algorithm)
        except ValueError as exc:  # an unknown hash algorithm
            raise InvalidArgumentError(f"hash_algorithm: {exc}") from None

    @property
    def mode(self) -> str:
        """``open`` (timestamps, ``speedup``) or ``closed`` (``concurrency`` workers)."""
        return "closed" if self.speedup is None else "open"


@dataclass(frozen=True, slots=True)
class LoadTestResult:
    """What one load test measured; :meth:`to_dict` is the JSON result file.

    Attributes:
        config: the settings.
        namespace: the namespace of the blocks.
        client_targets: the targets the client was given (only the first when the
            client takes one target; see :func:`open_client`).
        encoded_block_bytes: bytes of one encoded block (header plus payload).
        num_issued: requests started (the first ``num_issued`` of the trace).
        num_requests: requests completed without error.
        num_failed: requests ended by a failed call.
        num_blocks: blocks the completed requests asked for.
        hit_blocks: prefix blocks they got from the store.
        hit_blocks_per_tier: hit blocks by tier name (``LookupResult.tiers``).
        input_tokens: prompt tokens of the completed requests.
        hit_tokens: prompt tokens covered by hit blocks.
        put_blocks: blocks sent by puts.
        stored_blocks: blocks the store newly stored.
        bytes_read: encoded bytes received by gets.
        bytes_written: encoded bytes sent by puts.
        byte_mismatches: got blocks whose bytes differed from the expected ones.
        short_gets: gets that returned fewer blocks than their lookup found.
        errors: failed calls by ``"<op>: <ErrorClass>"``.
        error_samples: the first message of each kind of error.
        latency_ms: per operation (``lookup``, ``get``, ``put``, ``request``) the
            count, mean, p50, p90, p99 and max, milliseconds.
        schedule_lag_ms: open loop: how late requests started (same fields); empty for closed loop.
        windows: per window of ``window_s``: requests, blocks, hit ratios, bytes.
        elapsed_s: wall time from the first request to the last completion, seconds.
        stop_reason: ``trace_end``, ``max_requests`` or ``duration``.
        server_stats: the nodes' tier stats at the end (``kvstore stats``), or ``None``
            if they could not be read.
        missed_blocks: the nodes' missed blocks by cause over the run (their stats' ``missed_blocks``, after less
            before; ``kvstore.store.misses``); empty if the stats could not be read.
        latency_samples_s: raw latencies per operation, seconds (for the CDF plots; not in :meth:`to_dict`).
    """

    config: LoadTestConfig
    namespace: Namespace
    client_targets: tuple[str, ...]
    encoded_block_bytes: int
    num_issued: int
    num_requests: int
    num_failed: int
    num_blocks: int
    hit_blocks: int
    hit_blocks_per_tier: dict[str, int]
    input_tokens: int
    hit_tokens: int
    put_blocks: int
    stored_blocks: int
    bytes_read: int
    bytes_written: int
    byte_mismatches: int
    short_gets: int
    errors: dict[str, int]
    error_samples: dict[str, str]
    latency_ms: dict[str, dict[str, float | int]]
    schedule_lag_ms: dict[str, float | int]
    windows: list[dict[str, float | int]]
    elapsed_s: float
    stop_reason: str
    server_stats: dict[str, Any] | None = None
    latency_samples_s: dict[str, list[float]] = field(default_factory=dict, repr=False, compare=False)
    missed_blocks: dict[str, int] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        """Hit blocks / requested blocks (0.0 when nothing was requested)."""
        return self.hit_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        """Hit tokens / prompt tokens (0.0 when there were none)."""
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def num_errors(self) -> int:
        """Failed calls, over every kind."""
        return sum(self.errors.values())

    @property
    def ok(self) -> bool:
        """No failed call and no byte mismatch."""
        return not self.num_errors and not self.byte_mismatches

    @property
    def requests_per_s(self) -> float:
        """Completed requests per second of wall time."""
        return self.num_requests / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def gb_per_s(self) -> float:
        """Encoded block bytes moved (read plus written) per second, in 10^9 bytes."""
        return (self.bytes_read + self.bytes_written) / 1e9 / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the settings, counts, ratios, latencies and windows."""
        config = dataclasses.asdict(self.config)
        config["targets"] = list(self.config.targets)
        elapsed = self.elapsed_s if self.elapsed_s > 0 else float("inf")
        return {
            "config": {**config, "mode": self.config.mode},
            "namespace": {"model": self.namespace.model, "dtype": self.namespace.dtype,
                          "layout": self.namespace.layout, "block_size": self.namespace.block_size},
            "client_targets": list(self.client_targets),
            "encoded_block_bytes": self.encoded_block_bytes,
            "num_issued": self.num_issued,
            "num_requests": self.num_requests,
            "num_failed": self.num_failed,
            "num_blocks": self.num_blocks,
            "hit_blocks": self.hit_blocks,
            "hit_ratio": self.hit_ratio,
            "input_tokens": self.input_tokens,
            "hit_tokens": self.hit_tokens,
            "token_hit_ratio": self.token_hit_ratio,
            "hit_blocks_per_tier": dict(self.hit_blocks_per_tier),
            "tier_hit_ratios": {t: n / self.num_blocks if self.num_blocks else 0.0
                                for t, n in self.hit_blocks_per_tier.items()},
            "put_blocks": self.put_blocks,
            "stored_blocks": self.stored_blocks,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "elapsed_s": self.elapsed_s,
            "requests_per_s": self.requests_per_s,
            "read_gb_per_s": self.bytes_read / 1e9 / elapsed,
            "write_gb_per_s": self.bytes_written / 1e9 / elapsed,
            "gb_per_s": self.gb_per_s,
            "latency_ms": self.latency_ms,
            "schedule_lag_ms": self.schedule_lag_ms,
            "byte_mismatches": self.byte_mismatches,
            "short_gets": self.short_gets,
            "num_errors": self.num_errors,
            "errors": dict(self.errors),
            "error_samples": dict(self.error_samples),
            "stop_reason": self.stop_reason,
            "windows": self.windows,
            "server_stats": self.server_stats,
            "missed_blocks": dict(self.missed_blocks),
            "num_missed_blocks": self.num_blocks - self.hit_blocks,
        }


def client_target_keyword() -> str | None:
    """How :class:`AsyncKVStoreClient` takes several targets: the keyword to pass a list by, or ``None``.

    A ``targets`` parameter, or a ``target`` parameter annotated with a sequence
    type, takes a list; a ``target: str`` takes one address.
    """
    parameters = inspect.signature(AsyncKVStoreClient).parameters
    if "targets" in parameters:
        return "targets"
    target = parameters.get("target")
    if target is not None and any(word in str(target.annotation) for word in ("Sequence", "list", "tuple", "Iterable")):
        return "target"
    return None


def open_client(
    targets: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S, max_inflight: int = DEFAULT_MAX_INFLIGHT
) -> tuple[AsyncKVStoreClient, tuple[str, ...]]:
    """An :class:`AsyncKVStoreClient` of ``targets``: all of them if it takes a list, else the first.

    When the client takes one target and several are given, the rest are left
    out with a warning (logged, and visible in the result's ``client_targets``).

    Args:
        targets: ``host:port`` of each node, at least one.
        timeout_s: deadline of each call, seconds.
        max_inflight: calls in flight at once.

    Returns:
        The client and the targets it was given.

    Raises:
        InvalidArgumentError: if ``targets`` is empty.
    """
    targets = tuple(targets)
    if not targets:
        raise InvalidArgumentError("give at least one target")
    keyword = client_target_keyword()
    if keyword is not None:
        client = AsyncKVStoreClient(**{keyword: list(targets)}, timeout_s=timeout_s, max_inflight=max_inflight)
        return client, targets
    if len(targets) > 1:
        logger.warning("the kvstore client takes one target: using %s and leaving out %s",
                       targets[0], ", ".join(targets[1:]))
    return AsyncKVStoreClient(targets[0], timeout_s=timeout_s, max_inflight=max_inflight), targets[:1]


class _Progress:
    """A tqdm bar over requests with hit ratio, rates and errors in its postfix; silent when disabled."""

    def __init__(self, total: int, enabled: bool | None, file: IO[str] | None) -> None:
        self._bar: Any = None
        if enabled is False:
            return
        from tqdm import tqdm

        self._bar = tqdm(total=total, unit="req", desc="loadtest", file=file or sys.stderr,
                         disable=None if enabled is None else False, dynamic_ncols=True)
        self._last_s = 0.0

    def update(self, recorder: Recorder, elapsed_s: float) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        if elapsed_s - self._last_s >= _PROGRESS_EVERY_S:
            self._last_s = elapsed_s
            moved = (recorder.bytes_read + recorder.bytes_written) / 1e6 / max(elapsed_s, 1e-9)
            self._bar.set_postfix_str(
                f"hit={recorder.hit_ratio:.4f} MB/s={moved:.0f} err={recorder.num_errors} "
                f"mismatch={recorder.mismatches}", refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class _Replayer:
    """Runs the requests of one load test on one event loop (internal to :func:`run_loadtest`)."""

    def __init__(self, client: Any, config: LoadTestConfig, namespace: Namespace, payloads: PayloadFactory,
                 recorder: Recorder, progress: _Progress) -> None:
        self.client = client
        self.config = config
        self.namespace = namespace
        self.payloads = payloads
        self.recorder = recorder
        self.progress = progress
        self.started = time.perf_counter()
        self.deadline = self.started + config.duration_s if config.duration_s is not None else float("inf")
        self.num_issued = 0
        self.stopped_by_duration = False
        self.lags_s: list[float] = []
        self._mismatches_logged = 0
        self._namespaces: dict[str, Namespace] = {}
        self._payload_factories: dict[str, PayloadFactory] = {}

    def past_deadline(self) -> bool:
        if time.perf_counter() >= self.deadline:
            self.stopped_by_duration = True
            return True
        return False

    def _namespace_of(self, label: str) -> Namespace:
        """The namespace of a request's namespace label: the replay's own, or one whose revision is the label."""
        if not label:
            return self.namespace
        found = self._namespaces.get(label)
        if found is None:
            found = self._namespaces[label] = dataclasses.replace(self.namespace, revision=label[:128])
        return found

    async def replay_one(self, index: int, request: TraceRequest) -> None:
        """Lookup, get and verify, put; record the outcome."""
        outcome = RequestOutcome(index, len(request.block_ids), request.input_tokens)
        client, namespace = self.client, self._namespace_of(request.namespace)
        agentic: dict[str, Any] = {}
        if request.session:
            agentic["session_id"] = request.session
        if request.ttl_s:
            agentic["ttl_s"] = request.ttl_s * self.config.ttl_scale
        hashes = trace_block_hashes(namespace, request.block_ids)
        begin = time.perf_counter()
        op = "lookup"
        try:
            if hashes:
                found = await client.lookup(namespace, hashes, **agentic)
                outcome.lookup_s = time.perf_counter() - begin
                hit = min(found.num_blocks, len(hashes))
                if hit:
                    op = "get"
                    t = time.perf_counter()
                    blocks = await client.get(namespace, hashes[:hit], **agentic)
                    outcome.get_s = time.perf_counter() - t
                    outcome.bytes_read = sum(len(b) for b in blocks)
                    if len(blocks) < hit:
                        outcome.short_get = True
                        hit = len(blocks)
                    if self.config.verify:
                        outcome.mismatches = self._count_mismatches(index, hashes, blocks[:hit], namespace)
                outcome.hit_blocks = hit
                outcome.hit_tiers = tuple(found.tiers[:hit])
                missing = hashes[hit:]
                if missing:
                    op = "put"
                    payloads = self._payloads_of(namespace)
                    encoded = [payloads.encoded(h) for h in missing]
                    t = time.perf_counter()
                    outcome.stored_blocks = await client.put(namespace, missing, encoded, **agentic)
                    outcome.put_s = time.perf_counter() - t
                    outcome.put_blocks = len(missing)
                    outcome.bytes_written = sum(len(b) for b in encoded)
                outcome.hit_tokens = min(hit * namespace.block_size, request.input_tokens)
        except KVStoreError as exc:
            outcome.error = f"{op}: {type(exc).__name__}"
            outcome.error_message = str(exc)
            logger.debug("request %d: %s failed: %s", index, op, exc)
        now = time.perf_counter()
        outcome.request_s = now - begin
        outcome.finished_at_s = now - self.started
        self.recorder.add(outcome)
        self.progress.update(self.recorder, outcome.finished_at_s)

    def _payloads_of(self, namespace: Namespace) -> PayloadFactory:
        if namespace is self.namespace:
            return self.payloads
        found = self._payload_factories.get(namespace.revision)
        if found is None:
            found = self._payload_factories[namespace.revision] = PayloadFactory(
                namespace, self.config.payload_bytes, seed=self.config.seed)
        return found

    def _count_mismatches(self, index: int, hashes: Sequence[bytes], blocks: Sequence[bytes],
                          namespace: Namespace | None = None) -> int:
        mismatches = 0
        payloads = self._payloads_of(namespace or self.namespace)
        for position, (block_hash, block) in enumerate(zip(hashes, blocks)):
            if block != payloads.encoded(block_hash):
                mismatches += 1
                if self._mismatches_logged < _MAX_LOGGED_MISMATCHES:
                    self._mismatches_logged += 1
                    logger.warning("request %d block %d (%s): got %d bytes that differ from the expected %d",
                                   index, position, block_hash.hex(), len(block), payloads.encoded_bytes)
        return mismatches

    async def closed_loop(self, requests: Sequence[TraceRequest]) -> None:
        """``concurrency`` workers taking requests in file order."""
        position = 0

        async def worker() -> None:
            nonlocal position
            while position < len(requests) and not self.past_deadline():
                index = position
                position += 1
                self.num_issued += 1
                await self.replay_one(index, requests[index])

        await asyncio.gather(*(worker() for _ in range(self.config.concurrency)))

    async def open_loop(self, requests: Sequence[TraceRequest]) -> None:
        """Start request ``i`` at ``(t_i - t_0) / speedup`` seconds, at most ``max_inflight`` at once."""
        if not requests:
            return
        assert self.config.speedup is not None
        slots = asyncio.Semaphore(self.config.max_inflight)
        tasks: set[asyncio.Task[None]] = set()
        first_s = requests[0].timestamp_s

        async def run(index: int, request: TraceRequest) -> None:
            try:
                await self.replay_one(index, request)
            finally:
                slots.release()

        for index, request in enumerate(requests):
            due = self.started + (request.timestamp_s - first_s) / self.config.speedup
            wait_s = min(due, self.deadline) - time.perf_counter()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            if self.past_deadline():
                break
            await slots.acquire()
            self.lags_s.append(max(0.0, time.perf_counter() - due))
            self.num_issued += 1
            task = asyncio.create_task(run(index, request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)


async def run_loadtest(
    requests: Sequence[TraceRequest],
    config: LoadTestConfig,
    *,
    client: Any = None,
    progress: bool | None = False,
    progress_file: IO[str] | None = None,
) -> LoadTestResult:
    """Replay ``requests`` against the nodes of ``config.targets`` (or ``client``) and measure.

    Args:
        requests: the trace in file order (``kvstore.tools.trace.read_trace``).
        config: the settings.
        client: an object with the coroutines ``lookup``, ``get``, ``put`` and
            ``stats`` of :class:`AsyncKVStoreClient`, used instead of opening one
            to ``config.targets`` (and not closed).
        progress: show a tqdm bar: ``True``, ``False``, or ``None`` for only on a terminal.
        progress_file: where the bar goes (stderr by default).

    Returns:
        The counts, ratios, latencies and windows of the run.

    Raises:
        InvalidArgumentError: on a payload size that does not fit the block size
            or a block id that cannot be encoded.
    """
    namespace = config.namespace()
    payloads = PayloadFactory(namespace, config.payload_bytes, seed=config.seed)
    if config.max_requests is not None:
        requests = requests[: config.max_requests]
    own_client = client is None
    if own_client:
        client, client_targets = open_client(config.targets, timeout_s=config.timeout_s,
                                             max_inflight=max(config.concurrency, config.max_inflight))
    else:
        client_targets = tuple(config.targets)
    recorder = Recorder(config.window_s)
    bar = _Progress(len(requests), progress, progress_file)
    replayer = _Replayer(client, config, namespace, payloads, recorder, bar)
    logger.info("replaying %d requests against %s (%s loop)", len(requests), ", ".join(client_targets), config.mode)
    before: dict[str, Any] | None = None
    try:
        before = await _server_stats(client)
        if config.mode == "open":
            await replayer.open_loop(requests)
        else:
            await replayer.closed_loop(requests)
        elapsed_s = time.perf_counter() - replayer.started
        server_stats = await _server_stats(client)
    finally:
        bar.close()
        if own_client:
            await client.close()
    if replayer.stopped_by_duration and replayer.num_issued < len(requests):
        stop_reason = "duration"
    elif config.max_requests is not None and replayer.num_issued >= config.max_requests:
        stop_reason = "max_requests"
    else:
        stop_reason = "trace_end"
    return LoadTestResult(
        config=config,
        namespace=namespace,
        client_targets=client_targets,
        encoded_block_bytes=payloads.encoded_bytes,
        num_issued=replayer.num_issued,
        num_requests=recorder.num_requests,
        num_failed=recorder.num_failed,
        num_blocks=recorder.num_blocks,
        hit_blocks=recorder.hit_blocks,
        hit_blocks_per_tier=dict(recorder.hit_blocks_per_tier),
        input_tokens=recorder.input_tokens,
        hit_tokens=recorder.hit_tokens,
        put_blocks=recorder.put_blocks,
        stored_blocks=recorder.stored_blocks,
        bytes_read=recorder.bytes_read,
        bytes_written=recorder.bytes_written,
        byte_mismatches=recorder.mismatches,
        short_gets=recorder.short_gets,
        errors=dict(recorder.errors),
        error_samples=dict(recorder.error_samples),
        latency_ms={name: latency_summary(values) for name, values in recorder.latencies_s.items()},
        schedule_lag_ms=latency_summary(replayer.lags_s) if config.mode == "open" else {},
        windows=recorder.window_list(),
        elapsed_s=elapsed_s,
        stop_reason=stop_reason,
        server_stats=server_stats,
        latency_samples_s={name: list(values) for name, values in recorder.latencies_s.items()},
        missed_blocks=_missed_over_run(before, server_stats),
    )


def _missed_over_run(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, int]:
    """The nodes' missed blocks by cause from ``before`` to ``after`` (their stats); empty without both."""
    if before is None or after is None:
        return {}
    start = before.get("missed_blocks") or {}
    return {cause: int(count) - int(start.get(cause, 0)) for cause, count in (after.get("missed_blocks") or {}).items()}


async def _server_stats(client: Any) -> dict[str, Any] | None:
    stats: Callable[[], Any] | None = getattr(client, "stats", None)
    if stats is None:
        return None
    try:
        return dataclasses.asdict(await stats())
    except KVStoreError as exc:
        logger.warning("could not read the node's stats: %s", exc)
        return None


def replay_loadtest(requests: Sequence[TraceRequest], config: LoadTestConfig, **kwargs: Any) -> LoadTestResult:
    """:func:`run_loadtest` from synchronous code, on a new event loop (``asyncio.run``)."""
    return asyncio.run(run_loadtest(requests, config, **kwargs))
