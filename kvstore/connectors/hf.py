"""Prefix-KV reuse for HF transformers causal LMs: load cached blocks into a ``DynamicCache``, save new ones.

The connector sits between a ``transformers`` causal LM that uses the standard
``DynamicCache`` (Llama, Qwen2, Mistral, ...) and any
:class:`kvstore.api.BlockClient` (the embedded store or a gRPC
``KVStoreClient``). It uses only the block-client and key APIs, never store
internals.

Per request (:meth:`HFConnector.generate`)::

    load:    hash the prompt's full blocks, fetch the longest cached prefix,
             build a DynamicCache of those tokens on the model's device/dtype
    prefill: run the model on the uncached suffix only (>= 1 token, so the
             logits of the last prompt token are always computed)
    decode:  greedy, one token at a time, through the same cache
    save:    in a background thread, after the first token: slice the prompt's
             KV into full blocks and put those the store lacks

Block layout is ``kv`` (``kvstore.blocks.tensors``): ``[num_layers, 2, num_kv_heads,
block_size, head_dim]``, K at index 0 and V at 1 of dim 1, i.e. the per-layer
``DynamicLayer.keys``/``values`` (``[batch=1, num_kv_heads, seq, head_dim]``,
heads before ``repeat_kv``, so GQA/MQA store only the KV heads) cut along the
sequence and stacked.

transformers compatibility: ``transformers>=5.0,<6``. Since 5.x (5.24 checked)
the forward keyword of the cache is ``cache=`` and ``past_key_values=`` is a
deprecated alias (removal announced for 5.40); earlier 5.x releases take
``past_key_values=``. The connector inspects ``model.forward``'s signature and
uses whichever the installed version declares, and never reads the output's
cache field: the ``DynamicCache`` it passes in is updated in place.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kvstore.api import BlockClient
from kvstore.blocks.tensors import Layout, dtype_name
from kvstore.connectors.kit.fetch import fetch_handler
from kvstore.connectors.kit.saves import SaveQueue
from kvstore.connectors.kit.spec import BlockSpec
from kvstore.connectors.kit.stores import agentic
from kvstore.connectors.hf_model import (  # the public names are re-exported: kvstore.connectors.hf is their old home
    DEFAULT_BLOCK_SIZE,
    ModelShape,
    TokenIds,
    adapter_id,
    cache_keyword,
    model_namespace,
    model_shape,
    token_list,
)
from kvstore.connectors.hf_results import ConnectorStats, GenerationResult, LoadResult
from kvstore.errors import InvalidArgumentError
from kvstore.keys import BlockHash, HashAlgorithm, hash_blocks

try:  # transformers is the optional ``hf`` extra
    from transformers import DynamicCache
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("kvstore.connectors.hf needs transformers: pip install transformers "
                      "(or, in a checkout, pip install -e '.[hf]'; docs/install.md)") from exc

logger = logging.getLogger(__name__)

DEFAULT_LOAD_TIMEOUT_S = 5.0
"""Seconds a load may take before the connector gives up and prefills everything."""


@dataclass(slots=True)
class _Snapshot:
    """KV references taken after prefill, for a background save."""

    token_ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    agentic: dict[str, Any] = field(default_factory=dict)  # the save's session_id and ttl_s, where set


class HFConnector:
    """Reuses prefix KV blocks from kvstore for one HF transformers causal LM.

    Not safe for concurrent :meth:`generate` calls on one connector (the model
    is shared); saves run on one background thread and may overlap requests.

    Store failures never reach the caller: a load that raises or exceeds
    ``load_timeout_s`` is logged, counted (:attr:`ConnectorStats.num_load_failures`)
    and replaced by a full prefill; a save that raises is logged and counted.

    Loads go through ``client.get_into`` (:class:`~kvstore.api.BlockClient`, by ``kvstore.connectors.kit.fetch``):
    the blocks are copied once, each into its slice of one new tensor of the
    model's dtype and device, from shared memory when the node is on this host
    (``docs/shared-memory.md``), else from the gRPC messages or the embedded
    store's memory. The cache is built from that fresh memory, so a cache changed
    in place by decoding or ``model.generate`` never writes into fetched or stored blocks.
    Saves (on one background thread, ``kvstore.connectors.kit.saves.SaveQueue``)
    keep references to the per-layer K/V tensors taken right after prefill;
    ``DynamicLayer.update`` replaces (``torch.cat``) rather than writes those
    tensors, so later decoding does not change what is saved.

    Args:
        model: a transformers causal LM using ``DynamicCache`` (batch size 1).
        client: any :class:`~kvstore.api.BlockClient`; the connector does not close it.
        block_size: tokens per block.
        model_id: name of the weights when ``config._name_or_path`` is empty or
            ambiguous (see :func:`model_namespace`).
        revision: weights revision (see :func:`model_namespace`).
        cache_salt: per-tenant salt.
        hash_algorithm: ``H`` of the block-hash chain.
        adapter: the LoRA adapter applied to the model, a name or ``(name, version)``; ``""`` for
            the base model (see :func:`model_namespace`).
        load_timeout_s: seconds a load may take before falling back to a full prefill.
        priority: priority of saved blocks (0..100), ``None`` for the store's default.
        retention_s: seconds saved blocks keep ``priority``, ``None`` for no limit.
        kv_encoding: lossy KV encoding of the saved blocks (see :func:`model_namespace`); loads hand
            back the model's dtype.
        ttl_s: a TTL of every block saved and loaded, seconds (``docs/agentic.md``); ``None`` for none. Each
            call may name its own, and its ``session_id``.

    Raises:
        InvalidArgumentError: on a model without a cache keyword or model id,
            or a non-positive block size or timeout.
    """

    def __init__(
        self,
        model: Any,
        client: BlockClient,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        model_id: str | None = None,
        revision: str | None = None,
        cache_salt: str = "",
        hash_algorithm: HashAlgorithm | str = HashAlgorithm.XXH3_128,
        adapter: str | tuple[str, str] | None = None,
        load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
        priority: int | None = None,
        retention_s: float | None = None,
        kv_encoding: str = "",
        ttl_s: float | None = None,
    ) -> None:
        if load_timeout_s <= 0:
            raise InvalidArgumentError(f"load_timeout_s must be > 0, got {load_timeout_s}")
        self._model = model
        self._client = client
        self._cache_kw = cache_keyword(model)
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.shape = model_shape(model.config)
        self.namespace = model_namespace(
            model, block_size=block_size, model_id=model_id, revision=revision,
            cache_salt=cache_salt, hash_algorithm=hash_algorithm, adapter=adapter, kv_encoding=kv_encoding,
        )
        if self.namespace.kv_encoding:  # numba's first compile of the kernels, here rather than in a load's timeout
            from kvstore.blocks.encoding import warm_up

            warm_up(self.namespace.kv_encoding, model.dtype)
        self.load_timeout_s = load_timeout_s
        self._priority = priority
        self._retention_s = retention_s
        self._ttl_s = ttl_s
        self._dtype: torch.dtype = model.dtype
        self._device: torch.device = next(model.parameters()).device
        self._stats = ConnectorStats()
        self._lock = threading.Lock()
        self._block_spec = BlockSpec(dtype_name(self._dtype), Layout.KV, (self.shape.num_layers, 2,
                                     self.shape.num_kv_heads, block_size, self.shape.head_dim))
        self._fetch_blocks = fetch_handler(client, self._block_spec)
        # Loads run on their own pool so a hung store costs at most load_timeout_s per request.
        self._load_pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvstore-hf-load")
        self._saves = SaveQueue(name="kvstore-hf-save")
        self._closed = False

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.namespace.block_size

    @property
    def model(self) -> Any:
        """The wrapped model."""
        return self._model

    def stats(self) -> ConnectorStats:
        """A copy of the connector's counts."""
        with self._lock:
            s = self._stats
            return ConnectorStats(
                s.num_requests, s.num_prompt_tokens, s.num_cached_tokens, s.num_load_failures,
                s.num_rejected_blocks, s.num_saves, s.num_blocks_saved, s.num_save_failures, s.num_saves_skipped,
            )

    def new_cache(self) -> Any:
        """An empty ``DynamicCache`` for the model (its layer types follow the config)."""
        return DynamicCache(config=self._model.config)

    def block_hashes(self, token_ids: TokenIds) -> list[BlockHash]:
        """Chained hashes of the prompt's full blocks in this connector's namespace.

        Raises:
            InvalidArgumentError: on a batch > 1 or malformed ids.
        """
        return hash_blocks(self.namespace, token_list(token_ids))

    def _max_cached_blocks(self, num_tokens: int) -> int:
        # Leave at least one prompt token to compute: its logits give the first new token.
        limit = (num_tokens - 1) // self.block_size
        if self.shape.sliding_window is not None:
            # A sliding layer keeps sliding_window - 1 tokens; preload no more than it retains.
            limit = min(limit, (self.shape.sliding_window - 1) // self.block_size)
        return max(limit, 0)

    def _agentic(self, session_id: str | None, ttl_s: float | None) -> dict[str, Any]:
        """The ``session_id`` and ``ttl_s`` keywords of a store call: the call's, else the connector's TTL."""
        return agentic(session_id, self._ttl_s if ttl_s is None else ttl_s)

    def load(self, token_ids: TokenIds, *, session_id: str | None = None, ttl_s: float | None = None) -> LoadResult:
        """Fetch the longest cached prefix of a prompt and build a cache from it.

        At most ``(len(prompt) - 1) // block_size`` blocks are used, so at least one
        prompt token is left to compute even when the whole prompt is cached.

        Args:
            token_ids: the prompt, ``[num_tokens]`` or ``[1, num_tokens]``.
            session_id: the request's agentic session (``docs/agentic.md``).
            ttl_s: a TTL renewing the blocks loaded, seconds (the connector's when ``None``).

        Returns:
            The cache and how many tokens it covers; an empty cache with
            ``fell_back=True`` if the store raised or timed out.

        Raises:
            InvalidArgumentError: on a batch > 1 or malformed ids (never for store failures).
        """
        ids = token_list(token_ids)
        started = time.perf_counter()
        cache = self.new_cache()
        num_blocks = self._max_cached_blocks(len(ids))
        kv: torch.Tensor | None = None
        num_loaded = 0
        fell_back = False
        if num_blocks:
            hashes = hash_blocks(self.namespace, ids[: num_blocks * self.block_size])
            try:
                future = self._load_pool.submit(self._fetch, hashes, self._agentic(session_id, ttl_s))
                kv, num_loaded = future.result(timeout=self.load_timeout_s)
            except concurrent.futures.TimeoutError:
                future.cancel()
                fell_back = True
                logger.warning("kvstore load timed out after %.3f s; prefilling all %s tokens", self.load_timeout_s, len(ids))
            except Exception as exc:  # noqa: BLE001 - any store failure means "recompute"
                fell_back = True
                logger.warning("kvstore load failed (%s: %s); prefilling all %s tokens", type(exc).__name__, exc, len(ids))
        if kv is not None and num_loaded:
            with torch.no_grad():
                if num_loaded < num_blocks:  # the prefix ended early: the cache gets exactly its tokens
                    kv = kv[:, :, :, : num_loaded * self.block_size].contiguous()
                for layer in range(self.shape.num_layers):
                    cache.update(kv[layer, 0].unsqueeze(0), kv[layer, 1].unsqueeze(0), layer)
        else:
            num_loaded = 0
        num_cached = num_loaded * self.block_size
        with self._lock:
            self._stats.num_requests += 1
            self._stats.num_prompt_tokens += len(ids)
            self._stats.num_cached_tokens += num_cached
            self._stats.num_load_failures += int(fell_back)
        return LoadResult(cache, num_cached, time.perf_counter() - started, fell_back)

    def _fetch(self, hashes: Sequence[BlockHash], extra: dict[str, Any] | None = None) -> tuple[torch.Tensor, int]:
        """The cached prefix of ``hashes`` copied into one new ``[num_layers, 2, num_kv_heads, tokens, head_dim]``
        tensor of the model's dtype and device, and how many blocks it holds.

        Through ``kvstore.connectors.kit.fetch`` (``get_into`` for every kvstore client), so each block is copied
        once, straight into its slice (from shared memory when the node is on this host): the cache never
        aliases fetched or stored bytes. A block of another shape or dtype, or a corrupt one, ends the prefix
        and is counted, with those after it, as rejected.
        """
        bs = self.block_size
        kv = torch.empty((self.shape.num_layers, 2, self.shape.num_kv_heads, len(hashes) * bs, self.shape.head_dim),
                         dtype=self._dtype, device=self._device)
        views = [kv[:, :, :, i * bs:(i + 1) * bs] for i in range(len(hashes))]
        fetched = self._fetch_blocks.fetch(self.namespace, hashes, views, extra or {})
        if fetched.bad is not None:
            logger.warning("dropping fetched block %s onward: %s", fetched.num_good, fetched.bad)
            with self._lock:
                self._stats.num_rejected_blocks += fetched.num_found - fetched.num_good
        return kv, fetched.num_good

    def snapshot(self, token_ids: TokenIds, cache: Any, *, session_id: str | None = None,
                 ttl_s: float | None = None) -> _Snapshot:
        """References to the KV of ``token_ids`` in ``cache``, cheap enough for the critical path (and the
        session and TTL its save carries).

        Raises:
            InvalidArgumentError: on a batch > 1 or malformed ids.
        """
        ids = token_list(token_ids)
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        return _Snapshot(ids, layers, self._agentic(session_id, ttl_s))

    def save(self, token_ids: TokenIds, cache: Any, *, background: bool = True, session_id: str | None = None,
             ttl_s: float | None = None) -> concurrent.futures.Future[int]:
        """Store the full blocks of ``token_ids`` whose KV ``cache`` holds; a partial last block is not stored.

        The cache must hold exactly the KV of ``token_ids`` (``cache.get_seq_length()
        == len(token_ids)``) or of a longer sequence starting with them. Blocks the
        store already has (by lookup) are neither built nor sent.

        Args:
            token_ids: the tokens whose KV ``cache`` holds, ``[num_tokens]``.
            cache: a ``DynamicCache`` after prefill (or decoding).
            background: save on the connector's save thread (returns at once);
                ``False`` saves before returning.
            session_id: the request's agentic session (``docs/agentic.md``).
            ttl_s: a TTL of the blocks saved, seconds (the connector's when ``None``).

        Returns:
            A future of the number of blocks newly stored (0 after a logged failure).

        Raises:
            InvalidArgumentError: on a batch > 1 or malformed ids.
        """
        snap = self.snapshot(token_ids, cache, session_id=session_id, ttl_s=ttl_s)
        return self._submit_save(snap, background)

    def _submit_save(self, snap: _Snapshot, background: bool) -> concurrent.futures.Future[int]:
        if not background:
            done: concurrent.futures.Future[int] = concurrent.futures.Future()
            done.set_result(self._save_now(snap))
            return done
        future = self._saves.submit(lambda: self._save_now(snap))
        assert future is not None  # an unbounded queue refuses nothing
        return future

    def _save_now(self, snap: _Snapshot) -> int:
        try:
            stored = self._save_blocks(snap)
        except Exception as exc:  # noqa: BLE001 - a failed save must not fail the request
            logger.warning("kvstore save failed (%s: %s); blocks not stored", type(exc).__name__, exc)
            with self._lock:
                self._stats.num_save_failures += 1
            return 0
        with self._lock:
            self._stats.num_saves += 1
            self._stats.num_blocks_saved += stored
        return stored

    def _save_blocks(self, snap: _Snapshot) -> int:
        bs = self.block_size
        num_blocks = len(snap.token_ids) // bs
        if num_blocks == 0:
            return 0
        num_tokens = num_blocks * bs
        for keys, values in snap.layers:
            if keys is None or keys.dim() != 4 or keys.shape[0] != 1 or keys.shape[-2] < num_tokens:
                with self._lock:
                    self._stats.num_saves_skipped += 1
                logger.debug("not saving: a cache layer holds %s, not the first %s tokens",
                             None if keys is None else list(keys.shape), num_tokens)
                return 0
        hashes = hash_blocks(self.namespace, snap.token_ids[:num_tokens])
        first = self._client.lookup(self.namespace, hashes, **snap.agentic).num_blocks
        if first >= num_blocks:
            return 0
        with torch.no_grad():
            # [L, 2, H, T, D] for the missing tokens, then cut into [L, 2, H, bs, D] blocks.
            kv = torch.stack(
                [torch.stack((k[0, :, first * bs : num_tokens], v[0, :, first * bs : num_tokens])) for k, v in snap.layers]
            ).to("cpu")
            blocks = [kv[:, :, :, i * bs : (i + 1) * bs].contiguous() for i in range(num_blocks - first)]
        return self._client.put(
            self.namespace, hashes[first:], blocks, priority=self._priority, retention_s=self._retention_s,
            **snap.agentic,
        )

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for every background save submitted so far.

        Raises:
            TimeoutError: if ``timeout_s`` seconds pass first.
        """
        if not self._saves.drain(timeout_s):
            raise TimeoutError(f"kvstore saves still running after {timeout_s} s")

    def prefill(self, token_ids: TokenIds, cache: Any | None = None) -> tuple[int, Any]:
        """Run the model on the tokens the cache lacks and return the greedy first token.

        Args:
            token_ids: the whole prompt, ``[num_tokens]``.
            cache: a cache holding the KV of the prompt's first ``cache.get_seq_length()``
                tokens (< ``num_tokens``), extended in place; a new one when ``None``.

        Returns:
            ``(first generated token id, cache)``.

        Raises:
            InvalidArgumentError: on a batch > 1, or a cache covering the whole prompt.
        """
        logits, cache = self._prefill_logits(token_ids, cache)
        return int(logits.argmax()), cache

    def _prefill_logits(self, token_ids: TokenIds, cache: Any | None) -> tuple[torch.Tensor, Any]:
        """:meth:`prefill`, returning the ``[vocab_size]`` logits of the last prompt position instead."""
        ids = token_list(token_ids)
        cache = self.new_cache() if cache is None else cache
        num_cached = cache.get_seq_length()
        if num_cached >= len(ids):
            raise InvalidArgumentError(f"the cache holds {num_cached} of {len(ids)} prompt tokens; leave one to compute")
        suffix = torch.tensor([ids[num_cached:]], dtype=torch.long, device=self._device)
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        with torch.no_grad():
            logits = self._model(input_ids=suffix, **kwargs).logits
            return logits[0, -1], cache

    def decode(self, first_token: int, cache: Any, max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
        """Greedy decoding after prefill: ``first_token`` then up to ``max_new_tokens - 1`` more.

        Args:
            first_token: the token prefill produced.
            cache: the cache after prefill, extended in place by one token a step.
            max_new_tokens: total generated tokens including ``first_token``.
            eos_token_id: stop after this token, ``None`` to never stop early.

        Returns:
            Generated token ids, ``first_token`` first.
        """
        tokens = [first_token]
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        with torch.no_grad():
            while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
                step = torch.tensor([[tokens[-1]]], dtype=torch.long, device=self._device)
                logits = self._model(input_ids=step, **kwargs).logits
                tokens.append(int(logits[0, -1].argmax()))
        return tokens

    def generate(
        self,
        token_ids: TokenIds,
        max_new_tokens: int = 16,
        *,
        use_store: bool = True,
        save: bool = True,
        save_generated: bool = False,
        eos_token_id: int | None = None,
        session_id: str | None = None,
        ttl_s: float | None = None,
    ) -> GenerationResult:
        """Greedy generation with prefix reuse: load → prefill the suffix → decode → save in the background.

        With ``use_store=False`` the same code path runs with no load and no save
        (the no-cache baseline). Greedy output with a cache hit equals the output
        without one (``tests/connectors/test_hf.py`` checks float32 and bf16).

        Args:
            token_ids: the prompt, ``[num_tokens]`` or ``[1, num_tokens]``.
            max_new_tokens: tokens to generate, >= 1.
            use_store: load from and save to the store.
            save: save the prompt's new full blocks after the first token.
            save_generated: after decoding, also save the blocks of prompt plus
                generated tokens (all but the last, whose KV is never computed).
            eos_token_id: stop after this token.
            session_id: the request's agentic session (``docs/agentic.md``): its load and saves name it.
            ttl_s: a TTL of the blocks it loads and saves, seconds (the connector's when ``None``).

        Returns:
            The tokens, TTFT and hit counts.

        Raises:
            InvalidArgumentError: on a batch > 1, an empty prompt or ``max_new_tokens < 1``
                (store failures never raise: they fall back to a full prefill).
        """
        if max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        ids = token_list(token_ids)
        started = time.perf_counter()
        if use_store:
            loaded = self.load(ids, session_id=session_id, ttl_s=ttl_s)
        else:
            loaded = LoadResult(self.new_cache(), 0, 0.0)
        prefill_started = time.perf_counter()
        logits, cache = self._prefill_logits(ids, loaded.cache)
        first = int(logits.argmax())
        first_at = time.perf_counter()
        if use_store and save:
            self._submit_save(self.snapshot(ids, cache, session_id=session_id, ttl_s=ttl_s), background=True)
        tokens = self.decode(first, cache, max_new_tokens, eos_token_id)
        finished = time.perf_counter()
        if use_store and save_generated and len(tokens) > 1:
            self._submit_save(self.snapshot(ids + tokens[:-1], cache, session_id=session_id, ttl_s=ttl_s),
                              background=True)
        return GenerationResult(
            token_ids=tuple(tokens),
            num_prompt_tokens=len(ids),
            num_cached_tokens=loaded.num_cached_tokens,
            ttft_s=first_at - started,
            load_s=loaded.load_s,
            prefill_s=first_at - prefill_started,
            total_s=finished - started,
            fell_back=loaded.fell_back,
            first_logits=logits.detach().float().cpu(),
        )

    def close(self) -> None:
        """Wait for pending saves and stop the connector's threads (the client stays open); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._saves.close()
        self._load_pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> HFConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
