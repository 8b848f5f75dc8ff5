"""Data that ships inside the package: the demo's text corpus and the default request trace (see README.md here)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

DEFAULT_TRACE_NAME = "mooncake_conversation_trace.jsonl"
"""File name of the default trace of ``kvstore simulate`` and ``kvstore loadtest``."""


def bundled_trace(name: str = DEFAULT_TRACE_NAME) -> Path:
    """Path of a request trace shipped with the package, in a source checkout or an installed wheel alike.

    The Mooncake conversation trace (FAST '25, Apache-2.0; attribution in
    ``kvstore/data/traces/README.md``) is the one bundled: 12,031 requests of
    512-token blocks.

    Raises:
        FileNotFoundError: if no trace of that name is bundled.
    """
    path = Path(str(resources.files(__name__) / "traces" / name))
    if not path.is_file():
        raise FileNotFoundError(f"no bundled trace {name!r} in {path.parent}; pass --trace PATH")
    return path
