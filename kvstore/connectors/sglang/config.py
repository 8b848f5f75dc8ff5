"""The SGLang backend's settings: ``--hicache-storage-backend-extra-config``, typed and checked in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

from kvstore.config import build
from kvstore.connectors.kit.settings import check_store_settings, require, split_targets
from kvstore.errors import ConfigError
from kvstore.security import read_bearer_token

EXTRA_CONFIG = "hicache_storage_backend_extra_config"
"""Where the settings live (SGLang's ``--hicache-storage-backend-extra-config``); error messages name keys under it."""

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"})
"""Keys of the same JSON that SGLang itself reads (the dynamic loader's three, the controller's ``interface_v1``
switch to the zero-copy pair, ``tp_lcm_size``): accepted and left to SGLang."""


@dataclass(frozen=True, slots=True)
class SGLangStorageConfig:
    """Settings of :class:`~kvstore.connectors.sglang.KVStoreHiCacheStorage`, one per key of the extra-config JSON.

    Attributes:
        target: ``host:port`` of a ``kvstore serve`` node, or a comma-separated
            list (blocks spread over them by rendezvous hashing, ``kvstore.client``).
            Empty: the rank opens an embedded store in its own process.
        config: a kvstore config file whose ``store`` section configures the
            embedded store (only without ``target``; ``KVSTORE_*`` variables apply on top).
        timeout_s: the longest one store call may take, seconds (a whole batch of
            pages, all retries included). Past it the batch is a miss (reads) or
            not stored (writes); SGLang recomputes or keeps the pages in its host tier.
        priority: retention priority of stored pages, 0..100 (TensorRT-LLM's semantics);
            the node's default when unset.
        retention_s: seconds the priority holds before it reverts to the default; for ever when unset.
        ttl_s: a TTL of every page stored, seconds (``docs/agentic.md``): evicted only after every page without
            one until it runs out, counted from the last hit or put; none when unset. A call's
            ``extra_info`` (``{"kvstore": {"session_id": ..., "ttl_s": ...}}``) sets its own.
        tenant: the namespace's ``cache_salt``: engines of different tenants never
            share pages, and a node with tokens refuses a tenant the token does not cover.
        model_id: the model's name in the namespace; SGLang's ``model_name`` (``--model-path``)
            when unset. Set it when engines load the same weights from different paths.
        down_backoff_s: after a failed call, seconds during which the backend does not
            call the store (misses, nothing stored); it doubles per consecutive failure,
            up to 16 times this value (the vLLM connector's rule).
        tls_ca_file: CA certificate(s) of the nodes, to connect over TLS.
        tls_cert_file: client certificate, for mutual TLS (with ``tls_key_file``).
        tls_key_file: the client certificate's private key.
        token_file: a file holding the bearer token to send (``docs/security.md``).
        token_env: environment variable holding the bearer token, read when no
            ``token_file`` is given and the variable is set.

    Raises:
        ConfigError: naming the key, on a value out of range or settings that contradict each other.
    """

    target: str = ""
    config: str | None = None
    timeout_s: float = 2.0
    priority: int | None = None
    retention_s: float | None = None
    ttl_s: float | None = None
    tenant: str = ""
    model_id: str | None = None
    down_backoff_s: float = 5.0
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    token_file: str | None = None
    token_env: str = "KVSTORE_TOKEN"

    def __post_init__(self) -> None:
        check_store_settings(self)
        require(self.ttl_s is None or 0 <= self.ttl_s < math.inf, "ttl_s", "must be a finite number >= 0")

    @property
    def targets(self) -> tuple[str, ...]:
        """The nodes' ``host:port``, in order; empty for the embedded store."""
        return split_targets(self.target)

    def bearer_token(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The bearer token to send: ``token_file``'s content, else ``token_env``'s value, else ``None``.

        Raises:
            ConfigError: if ``token_file`` cannot be read or is empty.
        """
        return read_bearer_token(EXTRA_CONFIG, self.token_file, self.token_env, environ)


def parse_config(extra: Mapping[str, Any] | None) -> SGLangStorageConfig:
    """Check and type the extra-config JSON: every key known, every value of its type and range.

    SGLang's own keys (:data:`SGLANG_KEYS`) are skipped; ``target`` may also be a JSON list.

    Raises:
        ConfigError: naming ``hicache_storage_backend_extra_config.<key>``, for an unknown key
            (the message lists the known ones) or a bad value.
    """
    data = {k: v for k, v in dict(extra or {}).items() if k not in SGLANG_KEYS}
    if isinstance(data.get("target"), (list, tuple)):
        data["target"] = ",".join(str(t) for t in data["target"])
    if data.get("target") is None:
        data.pop("target", None)
    known = sorted(f.name for f in fields(SGLangStorageConfig))
    for key in data:
        if key not in known:
            raise ConfigError(f"{EXTRA_CONFIG}.{key}",
                              f"unknown key; the kvstore backend knows {known} (and SGLang's {sorted(SGLANG_KEYS)})")
    return build(SGLangStorageConfig, data, f"{EXTRA_CONFIG}.")
