"""The settings every connector has (its nodes, deadline, backoff, TLS, token, priority), checked in one place."""

from __future__ import annotations

import math
from typing import Protocol

from kvstore.errors import ConfigError


class StoreSettings(Protocol):
    """The fields of a connector's settings that say how it reaches and uses the store (``docs/vllm.md``,
    ``docs/sglang.md``)."""

    @property
    def target(self) -> str: ...

    @property
    def config(self) -> str | None: ...

    @property
    def timeout_s(self) -> float: ...

    @property
    def priority(self) -> int | None: ...

    @property
    def retention_s(self) -> float | None: ...

    @property
    def model_id(self) -> str | None: ...

    @property
    def down_backoff_s(self) -> float: ...

    @property
    def tls_ca_file(self) -> str | None: ...

    @property
    def tls_cert_file(self) -> str | None: ...

    @property
    def tls_key_file(self) -> str | None: ...

    @property
    def token_file(self) -> str | None: ...


def require(condition: bool, name: str, message: str) -> None:
    """Raise :class:`ConfigError` naming the setting ``name`` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(name, message)


def split_targets(target: str) -> tuple[str, ...]:
    """The nodes' ``host:port`` of a comma-separated ``target``, in order; empty for none."""
    return tuple(t.strip() for t in target.split(",")) if target else ()


def check_store_settings(settings: StoreSettings, target_source: str = "'target'") -> None:
    """Check the settings every connector shares.

    Args:
        settings: the connector's settings.
        target_source: where the nodes are named, for the message of TLS settings without nodes.

    Raises:
        ConfigError: naming the setting, on a value out of range or settings that contradict each other.
    """
    require(all(t.strip() for t in settings.target.split(",")) or not settings.target, "target",
            f"must be host:port or a comma-separated list of them, got {settings.target!r}")
    require(not (settings.target and settings.config), "config",
            "configures the embedded store, which is not used when 'target' names kvstore nodes")
    require(math.isfinite(settings.timeout_s) and settings.timeout_s > 0, "timeout_s", "must be a number > 0")
    require(settings.model_id is None or bool(settings.model_id), "model_id", "must not be empty")
    require(settings.priority is None or 0 <= settings.priority <= 100, "priority", "must be in [0, 100]")
    require(settings.retention_s is None or settings.retention_s >= 0, "retention_s", "must be >= 0")
    require(math.isfinite(settings.down_backoff_s) and settings.down_backoff_s >= 0, "down_backoff_s",
            "must be a number >= 0")
    require(bool(settings.tls_cert_file) == bool(settings.tls_key_file), "tls_cert_file",
            "a client certificate and its key (tls_key_file) must be given together")
    require(not (settings.target == "" and (settings.tls_ca_file or settings.tls_cert_file or settings.token_file)),
            "target", f"TLS and token settings apply to kvstore nodes; name them in {target_source}")
