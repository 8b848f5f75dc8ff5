"""The vLLM connector's settings: ``kv_connector_extra_config``, typed and checked in one place."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from kvstore.config import GiB, build
from kvstore.connectors.kit.settings import check_store_settings, require, split_targets
from kvstore.blocks.encoding.spec import Encoding
from kvstore.errors import ConfigError
from kvstore.security import read_bearer_token
from kvstore.keys import HashAlgorithm

EXTRA_CONFIG = "kv_connector_extra_config"
"""Where the settings live in vLLM's ``KVTransferConfig``; error messages name keys under it."""

TARGET_ENV = "KVSTORE_TARGET"
"""The environment variable that gives ``target`` when ``kv_connector_extra_config`` has none."""


@dataclass(frozen=True, slots=True)
class VLLMConnectorConfig:
    """Settings of :class:`~kvstore.connectors.vllm.KVStoreConnector`, one per key of ``kv_connector_extra_config``.

    Attributes:
        target: ``host:port`` of a ``kvstore serve`` node, or a comma-separated
            list of several (blocks are spread over them by rendezvous hashing,
            ``kvstore.client``); :data:`TARGET_ENV` when not given. Empty: every
            worker opens an embedded store in its own process (an in-process offload tier).
        config: a kvstore config file (TOML or YAML, ``docs/service.md``) whose
            ``store`` section configures the embedded store (memory capacity, an
            LMDB disk tier, Redis). Only without ``target``; ``KVSTORE_*``
            environment variables apply on top, as for ``kvstore.open_store``.
        timeout_s: the longest any store call may take, seconds: a lookup in the
            scheduler, a load or a save in a worker. Past it the request is served
            as a miss and its KV is recomputed.
        block_size: tokens per kvstore block, a multiple of vLLM's block size
            (``--block-size``); vLLM's block size when unset. A kvstore block of
            ``k`` times vLLM's size holds ``k`` consecutive vLLM blocks, so fewer,
            larger blocks move per request.
        hash_algorithm: ``xxh3_128`` (default) or ``sha256`` (required by nodes
            that serve untrusted clients, ``docs/security.md``).
        model_id: the model's name in the namespace; vLLM's ``--model`` when unset.
            Set it when engines load the same weights from different paths and should share blocks.
        priority: retention priority of saved blocks, 0..100 (TensorRT-LLM's
            semantics); the store's default when unset.
        retention_s: seconds the priority holds before it reverts to the default; for ever when unset.
        save_decode_blocks: also save, when a request ends, the full blocks that
            hold generated tokens (useful for multi-turn chat); prompt blocks are
            saved as soon as prefill computes them either way.
        load_failure_policy: ``recompute`` (default): a block that fails to load
            is recomputed by vLLM, as a cache miss would be. ``fail``: keep vLLM's
            ``kv_load_failure_policy`` as configured, which fails the request.
        load_async: load off the engine's step (vLLM's asynchronous loads): the
            scheduler returns ``load_async=True``, vLLM parks the request in
            ``WAITING_FOR_REMOTE_KVS`` and keeps running the others, a worker
            thread fetches and scatters, and ``get_finished`` reports the finished
            receives (``docs/vllm.md``). Off: the step that needs a load waits for it.
        hit_pin_s: seconds the scheduler's lookup pins the blocks it found, for the worker's load (the
            lookup's ``ttl_s``, ``docs/agentic.md``), so an eviction between the lookup and the load takes
            other blocks; a request's own ``ttl_s`` pins them instead where it sets one. 0: no pin. A block
            gone by the load all the same is counted (``lost_blocks``) and recomputed.
        down_backoff_s: after a store call fails, seconds during which the
            connector does not call the store at all (misses, no saves), so an
            unreachable node does not cost every request a timeout. It doubles
            per consecutive failure, up to 16 times this value.
        max_pending_save_bytes: KV bytes waiting to be saved at most; saves past it
            are dropped (and counted) rather than using up the worker's memory.
        tls_ca_file: CA certificate(s) of the nodes, to connect over TLS.
        tls_cert_file: client certificate, for nodes that require mutual TLS (with ``tls_key_file``).
        tls_key_file: the client certificate's private key.
        token_file: a file holding the bearer token to send (``docs/security.md``).
        token_env: environment variable holding the bearer token, read when no
            ``token_file`` is given and the variable is set.
        kv_encoding: lossy KV encoding of the stored blocks: ``int8``, ``fp8_e4m3``, ``int4`` or
            ``int2`` (``docs/encodings.md``); ``""`` (default) stores vLLM's KV exactly. Needs a
            float16, bfloat16 or float32 KV cache; engines share blocks only with the same encoding.
        events_target: the node's event stream (its ``events.endpoint``, e.g.
            ``tcp://kv-0:5557``). With vLLM's ``--kv-events-config`` on, the
            connector announces a saved block once the node stored it, and
            its removal when the node evicts, deletes or clears it
            (``docs/events.md``). Empty (the default): the streams the nodes
            in ``target`` offer (``Capabilities``); ``off``, or an embedded
            store: at save time, and never removed. With a bearer token set, the
            connector subscribes with it (a node with tokens requires it).
        events_replay: the node's replay endpoint; empty: derived as the node
            derives it (the next tcp port), ``off``: none.

    Raises:
        ConfigError: naming the key, on a value out of range or settings that contradict each other.
    """

    target: str = ""
    config: str | None = None
    timeout_s: float = 2.0
    block_size: int | None = None
    hash_algorithm: str = HashAlgorithm.XXH3_128.value
    model_id: str | None = None
    priority: int | None = None
    retention_s: float | None = None
    save_decode_blocks: bool = True
    load_failure_policy: str = "recompute"
    load_async: bool = False
    hit_pin_s: float = 5.0
    down_backoff_s: float = 5.0
    max_pending_save_bytes: int = 1 * GiB
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    token_file: str | None = None
    token_env: str = "KVSTORE_TOKEN"
    kv_encoding: str = ""
    events_target: str = ""
    events_replay: str = ""

    def __post_init__(self) -> None:
        check_store_settings(self, "'target' (or KVSTORE_TARGET)")
        require(self.block_size is None or self.block_size > 0, "block_size", "must be > 0")
        require(self.hash_algorithm in {a.value for a in HashAlgorithm}, "hash_algorithm",
                f"must be one of {[a.value for a in HashAlgorithm]}, got {self.hash_algorithm!r}")
        require(self.load_failure_policy in ("recompute", "fail"), "load_failure_policy",
                f"must be 'recompute' or 'fail', got {self.load_failure_policy!r}")
        require(math.isfinite(self.hit_pin_s) and self.hit_pin_s >= 0, "hit_pin_s", "must be a number >= 0")
        require(self.max_pending_save_bytes > 0, "max_pending_save_bytes", "must be > 0")
        require(self.kv_encoding in ("", *(e.value for e in Encoding)), "kv_encoding",
                f"must be one of {[e.value for e in Encoding]} or '' (exact), got {self.kv_encoding!r}")

    @property
    def targets(self) -> tuple[str, ...]:
        """The nodes' ``host:port``, in order; empty for the embedded store."""
        return split_targets(self.target)

    @property
    def embedded(self) -> bool:
        """Whether each worker uses an embedded store (no ``target``)."""
        return not self.target

    def bearer_token(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The bearer token to send: ``token_file``'s content, else ``token_env``'s value, else ``None``.

        Raises:
            ConfigError: if ``token_file`` cannot be read or is empty.
        """
        return read_bearer_token(EXTRA_CONFIG, self.token_file, self.token_env, environ)


def parse_config(extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> VLLMConnectorConfig:
    """Check and type ``kv_connector_extra_config``: every key known, every value of its type and range.

    ``target`` may also be a JSON list of ``host:port`` strings. Without ``target``
    the nodes come from the environment variable :data:`TARGET_ENV` when it is set
    and not empty (so ``{"kv_connector": "KVStoreConnector", "kv_role": "kv_both"}``
    is a whole setting), else each worker keeps an embedded store.

    Args:
        extra: ``kv_connector_extra_config``; ``None`` for none.
        environ: where :data:`TARGET_ENV` is read; ``os.environ`` when ``None``.

    Raises:
        ConfigError: naming ``kv_connector_extra_config.<key>`` (or :data:`TARGET_ENV`), for an unknown
            key (the message lists the known ones) or a bad value.
    """
    data = dict(extra or {})
    if isinstance(data.get("target"), (list, tuple)):
        data["target"] = ",".join(str(t) for t in data["target"])
    if data.get("target") is None:
        data.pop("target", None)
    known = sorted(f.name for f in fields(VLLMConnectorConfig))
    for key in data:
        if key not in known:
            raise ConfigError(f"{EXTRA_CONFIG}.{key}", f"unknown key; the kvstore connector knows {known}")
    from_env = (os.environ if environ is None else environ).get(TARGET_ENV, "").strip()
    if "target" in data or not from_env:
        return build(VLLMConnectorConfig, data, f"{EXTRA_CONFIG}.")
    try:
        return build(VLLMConnectorConfig, {**data, "target": from_env}, f"{EXTRA_CONFIG}.")
    except ConfigError as exc:
        if exc.field == f"{EXTRA_CONFIG}.target":
            raise ConfigError(TARGET_ENV, str(exc).split(": ", 1)[1]) from None
        if exc.field == f"{EXTRA_CONFIG}.config":
            raise ConfigError(exc.field, f"configures the embedded store, which is not used when {TARGET_ENV} "
                                         f"({from_env!r}) names kvstore nodes; unset it, or drop 'config'") from None
        raise
