"""The scheduler's half of the connector: one lookup per request, and the load and save jobs of every step.

Per request (vLLM's ``Request``):

* ``get_num_new_matched_tokens``: hash the full kvstore blocks of the tokens
  that vLLM's local prefix cache lacks, never counting the last token (vLLM
  needs its logits), and ask the store for the longest cached run of them (one
  Lookup per worker namespace, normally one). The hit is whole blocks.
* ``update_state_after_alloc``: remember which vLLM blocks vLLM allocated for
  those tokens; ``build_connector_meta`` sends them to the workers as a
  :class:`~kvstore.connectors.vllm.jobs.LoadJob`.
* Each step, ``build_connector_meta`` also sends a
  :class:`~kvstore.connectors.vllm.jobs.SaveJob` for every kvstore block of
  prompt tokens that the step completes and the store lacked at the lookup: the
  worker copies it out of vLLM's cache right after the forward pass and puts it
  in the background, so other engines can hit a prompt while it still decodes.
* ``request_finished``: the blocks that hold generated tokens
  (``save_decode_blocks``) are saved once, when the request ends. vLLM keeps
  them until the worker has copied them out, in the next step, and reports the
  request in ``finished_sending``; the scheduler never waits for a put.

Roles: a ``kv_producer`` never looks up (it only saves), a ``kv_consumer``
never saves, ``kv_both`` does both. One request can opt out of either with
``kv_transfer_params={"kvstore": {"load": false, "save": false}}`` (vLLM passes
``SamplingParams.extra_args["kv_transfer_params"]`` to the connector): a prompt
that must not be cached, or a reference run that must not read the cache. It can
name its agentic session and a TTL, ``{"kvstore": {"session_id": "...", "ttl_s": 300}}``
(or ``"5m"``; vLLM's own ``Request.session_id`` when the option is absent): its
lookup, loads and saves carry them (``docs/agentic.md``). Every lookup names the
vLLM request id, so ``kvstore explain --request-id`` can say why it missed. A lookup that fails or times out is a miss
(vLLM computes the prompt), and the store is then left alone for a backoff.
Requests given as prompt embeddings are neither looked up nor saved (their
token ids are placeholders).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

from kvstore.api import BlockClient, LookupResult
from kvstore.client import KVStoreClient
from kvstore.connectors.kit.stores import StoreHealth, agentic, open_client
from kvstore.connectors.vllm.config import VLLMConnectorConfig
from kvstore.connectors.vllm.events import ConnectorEvents
from kvstore.connectors.vllm.jobs import KVStoreConnectorMetadata, LoadJob, RankKey, SaveJob, TenantKey
from kvstore.connectors.vllm.metrics import KVStoreConnectorStats
from kvstore.connectors.vllm.namespaces import (
    ModelIdentity,
    RankInfo,
    RequestKeys,
    request_adapter,
    request_spans,
    storage_namespace,
)
from kvstore.errors import KVStoreError
from kvstore.keys import BlockHash, HashAlgorithm, Namespace

logger = logging.getLogger(__name__)

TIER_SOURCES = {"memory": "host", "disk": "disk"}
"""vLLM's ``CacheHitSource`` value of a hit in each kvstore tier; any other tier is ``external_unspecified``."""


REQUEST_PARAMS_KEY = "kvstore"
"""The key of the connector's per-request options in ``kv_transfer_params``: ``{"load": bool, "save": bool,
"session_id": str, "ttl_s": seconds or "5m"/"1h"}`` (``docs/agentic.md``)."""

REQUEST_OPTIONS = ("load", "save", "session_id", "ttl_s")
"""The options a request may set under :data:`REQUEST_PARAMS_KEY`."""


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """A request's own options (``kv_transfer_params["kvstore"]``).

    Attributes:
        load: whether the request may load from kvstore.
        save: whether it may save.
        session_id: its agentic session: the option's, else vLLM's own ``Request.session_id`` where the version
            passes one; ``""`` for none.
        ttl_s: its cache-control TTL, seconds (0.0: none): its blocks are pinned when saved and renewed when loaded.
    """

    load: bool = True
    save: bool = True
    session_id: str = ""
    ttl_s: float = 0.0


def parse_ttl(value: Any) -> float:
    """A TTL option as seconds: a number, or a string of a number and a unit (``"300"``, ``"300s"``, ``"5m"``,
    ``"1h"``, as Anthropic's and Dynamo's ``cache_control`` write it).

    Raises:
        ValueError: on anything else, or a TTL that is not a finite number >= 0.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a TTL: {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and value.strip():
        text = value.strip().lower()
        scale = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(text[-1])
        seconds = float(text[:-1] if scale else text) * (scale or 1.0)
    else:
        raise ValueError(f"not a TTL: {value!r}")
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"a TTL must be a finite number of seconds >= 0, got {value!r}")
    return seconds


def request_options(request: Any) -> RequestOptions:
    """A request's :class:`RequestOptions`: everything on unless its ``kv_transfer_params["kvstore"]`` says otherwise.

    Unknown options and bad values are logged and ignored (a request cannot be refused from here).
    """
    params = getattr(request, "kv_transfer_params", None) or {}
    options = params.get(REQUEST_PARAMS_KEY) if isinstance(params, dict) else None
    own_session = getattr(request, "session_id", None)  # vLLM's own, where the version has one
    session = own_session if isinstance(own_session, str) else ""
    if not isinstance(options, dict):
        return RequestOptions(session_id=session)
    where = getattr(request, "request_id", "?")
    unknown = set(options) - set(REQUEST_OPTIONS)
    if unknown:
        logger.warning("request %s: unknown kv_transfer_params.%s options %s ignored (known: %s)",
                       where, REQUEST_PARAMS_KEY, sorted(unknown), ", ".join(REQUEST_OPTIONS))
    given = options.get("session_id")
    if given is not None:
        if isinstance(given, str) and len(given.encode("utf-8")) <= 256:
            session = given
        else:
            logger.warning("request %s: kv_transfer_params.%s.session_id must be a string of at most 256 bytes; "
                           "ignored", where, REQUEST_PARAMS_KEY)
    ttl_s = 0.0
    if options.get("ttl_s") is not None:
        try:
            ttl_s = parse_ttl(options["ttl_s"])
        except ValueError as exc:
            logger.warning("request %s: kv_transfer_params.%s.ttl_s ignored: %s", where, REQUEST_PARAMS_KEY, exc)
    return RequestOptions(bool(options.get("load", True)), bool(options.get("save", True)), session, ttl_s)


@dataclass(slots=True)
class _RequestState:
    """What the scheduler keeps about one request while vLLM holds it."""

    request: Any
    keys: RequestKeys
    tenant: TenantKey
    load: bool = True
    """Whether this request may load (the engine's role and the request's own option)."""
    save: bool = True
    """Whether this request may save."""
    saved_blocks: int = 0
    """kvstore blocks ``[0, saved_blocks)`` need no save: the store had them at the lookup, or a save is planned."""
    lookup: tuple[int, int, tuple[str, ...]] | None = None
    """``(local tokens, external tokens, tiers of the hit blocks)`` of the last lookup."""
    load_job: LoadJob | None = None
    session_id: str = ""
    """The request's agentic session (``RequestOptions``)."""
    ttl_s: float = 0.0
    """Its TTL, seconds."""


class SchedulerSide:
    """The scheduler's connector logic, independent of vLLM's class hierarchy (see the module docstring).

    Args:
        config: the connector's settings.
        identity: the engine's model identity.
        vllm_block_size: tokens per vLLM block.
        load: whether this engine loads (``kv_consumer`` or ``kv_both``).
        save: whether it saves (``kv_producer`` or ``kv_both``).
    """

    def __init__(self, config: VLLMConnectorConfig, identity: ModelIdentity, vllm_block_size: int, *, load: bool,
                 save: bool) -> None:
        self.config = config
        self.identity = identity
        self.vllm_block_size = vllm_block_size
        self.block_size = config.block_size or vllm_block_size
        self.load = load
        self.save = save
        self.stats = KVStoreConnectorStats()
        self.health = StoreHealth(config.down_backoff_s)
        self.ranks: list[RankInfo] = []
        self._clients: dict[RankKey, BlockClient] = {}
        self._lookups: concurrent.futures.ThreadPoolExecutor | None = None  # one thread per rank, with several
        self._requests: dict[str, _RequestState] = {}
        self._finish_saves: list[SaveJob] = []
        self._hash_algorithm = HashAlgorithm(config.hash_algorithm)
        self._warned_no_ranks = False
        self.events: ConnectorEvents | None = None  # vLLM KV events of the saved blocks (``events.py``)

    # ------------------------------------------------------------------ set-up

    def set_ranks(self, ranks: list[RankInfo]) -> None:
        """Learn every worker's page format (and embedded lookup endpoint) from their handshakes.

        Until this is called (vLLM does so once, when the engine starts), the
        connector neither looks up nor saves.
        """
        self.ranks = sorted(ranks, key=lambda r: (r.pp_rank, r.tp_rank))
        remote: KVStoreClient | None = None
        for rank in self.ranks:
            key = (rank.pp_rank, rank.tp_rank)
            if rank.lookup_target is None:
                remote = remote or open_client(self.config)
                self._clients[key] = remote
            else:
                self._clients[key] = open_client(self.config, target=rank.lookup_target, token=rank.lookup_token)
        if len(self.ranks) > 1:
            self._lookups = concurrent.futures.ThreadPoolExecutor(len(self.ranks), thread_name_prefix="kvstore-lookup")
        logger.info("kvstore connector: %d worker(s), block size %d tokens (vLLM's %d), %s", len(self.ranks),
                    self.block_size, self.vllm_block_size,
                    "embedded stores" if self.config.embedded else f"nodes {','.join(self.config.targets)}")

    def close(self) -> None:
        """Close the lookup clients."""
        if self.events is not None:
            self.events.close()
        for client in {id(c): c for c in self._clients.values()}.values():
            try:
                client.close()
            except Exception:  # noqa: BLE001 - shutting down
                logger.debug("closing a kvstore client failed", exc_info=True)
        self._clients.clear()
        if self._lookups is not None:
            self._lookups.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ per request

    def _state(self, request: Any) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            tenant = TenantKey(cache_salt=getattr(request, "cache_salt", None) or "", adapter=request_adapter(request))
            namespaces = [storage_namespace(self.identity, rank, block_size=self.block_size,
                                            hash_algorithm=self._hash_algorithm, cache_salt=tenant.cache_salt,
                                            adapter=tenant.adapter, kv_encoding=self.config.kv_encoding)
                          for rank in self.ranks]
            options = request_options(request)
            state = _RequestState(request, RequestKeys(namespaces, request_spans(request)), tenant,
                                  load=options.load and self.load, save=options.save and self.save,
                                  session_id=options.session_id, ttl_s=options.ttl_s)
            self._requests[request.request_id] = state
        return state

    def _cacheable(self, request: Any) -> bool:
        """Whether the request's token ids name its prompt (not given as embeddings), and the ranks are known."""
        if not self.ranks:
            if not self._warned_no_ranks:
                self._warned_no_ranks = True
                logger.error("kvstore connector: no worker sent its page format (vLLM's connector handshake); "
                             "the connector neither loads nor saves")
            return False
        return getattr(request, "prompt_embeds", None) is None and getattr(request, "prompt_token_ids", None) is not None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` (vLLM's local hit) that kvstore holds, whole blocks, and whether the
        load is asynchronous (``load_async``).

        Never the request's last token. One Lookup per worker namespace; a
        failure or timeout is a miss. With several ranks their lookups go out together; each pins the hit for the
        worker's load (``hit_pin_s``, or the request's ``ttl_s``).
        """
        if not self._cacheable(request):
            return 0, False
        state = self._state(request)
        state.lookup = None
        max_blocks = (request.num_tokens - 1) // self.block_size
        first = num_computed_tokens // self.block_size
        state.saved_blocks = max(state.saved_blocks, first)  # vLLM's local hit: saved when it was computed
        if not state.load or first >= max_blocks:
            return 0, False
        num_asked = max_blocks - first
        self.stats.add("lookups")
        self.stats.add("lookup_blocks", num_asked)
        self.stats.add("lookup_tokens", num_asked * self.block_size)
        if not self.health.up():
            self.stats.add("lookup_errors")
            return 0, False
        started = time.monotonic()
        hashes = state.keys.hashes(request.all_token_ids, max_blocks)
        try:
            results = self._lookup_ranks([(self._clients[(r.pp_rank, r.tp_rank)], namespace, chain[first:])
                                          for r, namespace, chain in zip(self.ranks, state.keys.namespaces, hashes)],
                                         state)
        except (KVStoreError, TimeoutError, OSError) as exc:
            self.health.failed("lookup", exc)
            self.stats.add("lookup_errors")
            return 0, False
        self.stats.observe("lookup_seconds", time.monotonic() - started)
        self.health.succeeded()
        hit: LookupResult = min(results, key=lambda r: r.num_blocks)
        state.saved_blocks = max(state.saved_blocks, first + hit.num_blocks)
        num_tokens = (first + hit.num_blocks) * self.block_size - num_computed_tokens
        if hit.num_blocks == 0 or num_tokens <= 0:
            return 0, False
        self.stats.add("hit_blocks", hit.num_blocks)
        self.stats.add("hit_tokens", hit.num_blocks * self.block_size)
        state.lookup = (num_computed_tokens, num_tokens, hit.tiers)
        return num_tokens, self.config.load_async

    def _lookup_ranks(self, calls: Sequence[tuple[BlockClient, Namespace, Sequence[BlockHash]]],
                      state: _RequestState) -> list[LookupResult]:
        """Every rank's Lookup, sent together (one thread each) when there are several; the first failure raises."""
        if self._lookups is None or len(calls) == 1:
            return [self._lookup(client, namespace, hashes, state) for client, namespace, hashes in calls]
        futures = [self._lookups.submit(self._lookup, client, namespace, hashes, state)
                   for client, namespace, hashes in calls]
        return [future.result() for future in futures]

    def _lookup(self, client: BlockClient, namespace: Namespace, hashes: Sequence[BlockHash],
                state: _RequestState) -> LookupResult:
        """One Lookup, naming the request (``kvstore explain --request-id``) and its session, and pinning the hit
        for the load: for the request's TTL, else for ``hit_pin_s`` (``docs/agentic.md``)."""
        extra = {"request_id": str(state.request.request_id)[:256],
                 **agentic(state.session_id, state.ttl_s or self.config.hit_pin_s)}
        return client.lookup(namespace, hashes, **extra)

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """The external tokens of the request's last lookup by vLLM's ``CacheHitSource`` value (``host``, ``disk``, ...)."""
        state = self._requests.get(request.request_id)
        if not num_external_tokens or state is None or state.lookup is None:
            return {"external_unspecified": num_external_tokens} if num_external_tokens else {}
        local, _, tiers = state.lookup
        first = local // self.block_size
        sources: dict[str, int] = {}
        remaining = num_external_tokens
        for i, tier in enumerate(tiers):
            start = max((first + i) * self.block_size, local)
            take = min((first + i + 1) * self.block_size - start, remaining)
            if take <= 0:
                break
            source = TIER_SOURCES.get(tier, "external_unspecified")
            sources[source] = sources.get(source, 0) + take
            remaining -= take
        if remaining > 0:
            sources["external_unspecified"] = sources.get("external_unspecified", 0) + remaining
        return sources

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """Plan the load of the request's external tokens into the vLLM blocks just allocated.

        Args:
            request: the request.
            block_ids: every vLLM block of the request, in token order (group 0).
            num_external_tokens: what vLLM accepted of :meth:`get_num_new_matched_tokens`; 0 for no load.
        """
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0 or state.lookup is None:
            if state is not None:
                state.load_job = None
            return
        local, planned, _ = state.lookup
        if num_external_tokens != planned:
            logger.warning("request %s: vLLM accepted %d external tokens of the %d looked up; loading %d",
                           request.request_id, num_external_tokens, planned, num_external_tokens)
        end = local + num_external_tokens
        first_block, end_block = local // self.block_size, end // self.block_size
        if local % self.vllm_block_size or end % self.block_size:
            # vLLM counts these tokens as computed whatever happens: a job with no blocks to fetch makes the
            # worker report all of them as failed, so vLLM recomputes them rather than read unwritten KV.
            logger.warning("request %s: external tokens [%d, %d) are not whole kvstore blocks; recomputing them",
                           request.request_id, local, end)
            state.load_job = LoadJob(req_id=request.request_id, tenant=state.tenant, first_block=first_block,
                                     hashes={}, skip_tokens=0,
                                     block_ids=list(block_ids[local // self.vllm_block_size:
                                                              -(-end // self.vllm_block_size)]),
                                     session_id=state.session_id, ttl_s=state.ttl_s)
            return
        hashes = state.keys.hashes(request.all_token_ids, end_block)
        state.load_job = LoadJob(
            req_id=request.request_id, tenant=state.tenant, first_block=first_block,
            hashes={(r.pp_rank, r.tp_rank): [BlockHash(bytes(h)) for h in chain[first_block:end_block]]
                    for r, chain in zip(self.ranks, hashes)},
            skip_tokens=local - first_block * self.block_size,
            block_ids=list(block_ids[local // self.vllm_block_size: end // self.vllm_block_size]),
            session_id=state.session_id, ttl_s=state.ttl_s,
        )
        state.saved_blocks = max(state.saved_blocks, end_block)

    def build_meta(self, scheduler_output: Any, block_ids_of: Any) -> KVStoreConnectorMetadata:
        """This step's jobs: the planned loads, the saves of prompt blocks the step completes, the finish saves.

        Args:
            scheduler_output: vLLM's ``SchedulerOutput`` of the step.
            block_ids_of: ``req_id -> list of vLLM block ids`` (group 0), from the KV-cache manager.
        """
        meta = KVStoreConnectorMetadata()
        for state in self._requests.values():
            if state.load_job is not None:
                meta.loads.append(state.load_job)
                state.load_job = None
        if self.save and self.ranks:
            for req_id, num_computed in _scheduled(scheduler_output):
                saving = self._requests.get(req_id)
                if saving is None or not saving.save or not self._cacheable(saving.request):
                    continue
                computed = min(num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0),
                               saving.request.num_prompt_tokens)
                job = self._save_job(saving, computed // self.block_size, block_ids_of(req_id), at_finish=False)
                if job is not None:
                    meta.saves.append(job)
        meta.saves.extend(self._finish_saves)
        self._finish_saves = []
        return meta

    def _save_job(self, state: _RequestState, end_block: int, block_ids: list[int], *,
                  at_finish: bool) -> SaveJob | None:
        """The save of kvstore blocks ``[state.saved_blocks, end_block)``, or ``None`` when there are none."""
        first = state.saved_blocks
        ratio = self.block_size // self.vllm_block_size
        end_block = min(end_block, len(block_ids) // ratio)
        if end_block <= first:
            return None
        hashes = state.keys.hashes(state.request.all_token_ids, end_block)
        state.saved_blocks = end_block
        if self.events is not None:
            self.events.saved(state.request, [ns.tag for ns in state.keys.namespaces], first,  # every rank's shard
                              [chain[first:end_block] for chain in hashes])
        return SaveJob(
            req_id=state.request.request_id, tenant=state.tenant,
            hashes={(r.pp_rank, r.tp_rank): [BlockHash(bytes(h)) for h in chain[first:end_block]]
                    for r, chain in zip(self.ranks, hashes)},
            block_ids=list(block_ids[first * ratio: end_block * ratio]), at_finish=at_finish,
            session_id=state.session_id, ttl_s=state.ttl_s,
        )

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        """Forget the request; plan the save of its generated-token blocks. Returns whether vLLM must keep the blocks.

        Args:
            request: the finished (or aborted) request.
            block_ids: its vLLM blocks that hold computed tokens, in token order.

        Returns:
            ``True`` when a save was planned: vLLM frees the blocks once a worker
            reports the request in ``finished_sending`` (the next step).
        """
        state = self._requests.pop(request.request_id, None)
        if state is None or not state.save or not self.config.save_decode_blocks or not self._cacheable(request):
            return False
        computed = min(request.num_computed_tokens, request.num_tokens)
        job = self._save_job(state, computed // self.block_size, block_ids, at_finish=True)
        if job is None:
            return False
        self._finish_saves.append(job)
        return True

    def load_failed(self, failed: dict[str, int]) -> None:
        """Workers could not load these requests' blocks from kvstore block ``failed[req_id]`` on.

        vLLM recomputes them; lowering the request's saved mark makes the steps
        that recompute them save them again (the worker deleted any corrupt
        block it found, so the new one replaces it).
        """
        for req_id, first_failed in failed.items():
            state = self._requests.get(req_id)
            if state is not None:
                state.saved_blocks = min(state.saved_blocks, first_failed)

    def take_stats(self) -> KVStoreConnectorStats | None:
        """The scheduler's counts since the last call (vLLM reports them each step)."""
        return self.stats.take()


def _scheduled(scheduler_output: Any) -> list[tuple[str, int]]:
    """``(req_id, num_computed_tokens before the step)`` of every request the step runs."""
    scheduled = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
    cached = scheduler_output.scheduled_cached_reqs
    scheduled.extend(zip(cached.req_ids, cached.num_computed_tokens))
    return scheduled
