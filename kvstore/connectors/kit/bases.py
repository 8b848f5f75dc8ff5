"""What mypy sees of an engine's base classes (vLLM's connector bases, SGLang's ``HiCacheStorage``).

The engines are untyped where mypy runs (not installed, or without type
information), so a class derived from theirs would derive from ``Any``. Each
connector module imports the real base at run time and, for the type checker
only (``if TYPE_CHECKING``), :class:`EngineBase` under the base's name.
"""

from __future__ import annotations

from typing import Any


class EngineBase:
    """An engine's base class as far as the type checker knows it: any constructor, any inherited attribute."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Whatever the engine's constructor takes."""

    def __getattr__(self, name: str) -> Any:
        """Whatever the engine's class provides."""
        raise AttributeError(name)
