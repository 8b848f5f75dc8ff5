"""Argument checks shared by the store and the clients: a put's hashes, priority and retention, durations, counts."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Sequence

from kvstore.api import Block
from kvstore.errors import InvalidArgumentError
from kvstore.keys import BlockHash, Namespace
from kvstore.policy import MAX_PRIORITY, MIN_PRIORITY


_PLAIN_HASH_TYPES = frozenset((bytes, bytearray))
"""Hash types whose ``len`` is their byte length (a ``memoryview``'s need not be)."""


def _check_put(
    namespace: Namespace,
    block_hashes: Sequence[BlockHash],
    blocks: Sequence[Block],
    priority: int | None,
    retention_s: float | None,
) -> tuple[int | None, float | None]:
    """Check the arguments of a put before any call starts, as the node would (``TieredStore._meta``).

    A bad argument must raise here: the Put messages are built lazily on
    gRPC's side of the call, where an error is lost (sync: UNKNOWN; asyncio: a
    cancellation).

    Args:
        namespace: namespace of the blocks.
        block_hashes: one hash per block, each bytes-like of ``namespace.hash_bytes`` bytes.
        blocks: the blocks, as many as hashes.
        priority: an integer in ``[0, 100]`` (numpy integers too, not ``bool``), or ``None``.
        retention_s: a real number of seconds ``>= 0`` (``inf`` too, not NaN), or ``None``.

    Returns:
        ``(priority, retention_s)`` as ``int`` and ``float`` (``None`` stays ``None``).

    Raises:
        InvalidArgumentError: on a namespace that is not a :class:`Namespace`, a count
            mismatch, a hash that is not bytes-like or of the wrong length, or a bad
            priority or retention_s.
    """
    if not isinstance(namespace, Namespace):
        raise InvalidArgumentError(f"namespace must be a kvstore Namespace, got {type(namespace).__name__}")
    if len(block_hashes) != len(blocks):
        raise InvalidArgumentError(f"{len(block_hashes)} hashes but {len(blocks)} blocks")
    width = namespace.hash_bytes
    plain = set(map(type, block_hashes)) <= _PLAIN_HASH_TYPES and set(map(len, block_hashes)) <= {width}
    for index, block_hash in enumerate(() if plain else block_hashes):  # C loops above: 1,024 hashes in ~0.1 ms
        try:
            nbytes = memoryview(block_hash).nbytes
        except TypeError:
            raise InvalidArgumentError(
                f"block hash {index}: expected bytes, bytearray or memoryview, got {type(block_hash).__name__}"
            ) from None
        if nbytes != width:
            raise InvalidArgumentError(f"block hash {index}: must be {width} bytes for "
                                       f"{namespace.hash_algorithm.value}, got {nbytes}")
    if priority is not None:
        try:
            value = None if isinstance(priority, bool) else operator.index(priority)
        except TypeError:
            value = None
        if value is None or not MIN_PRIORITY <= value <= MAX_PRIORITY:
            raise InvalidArgumentError(
                f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority!r}"
            )
        priority = value
    if retention_s is not None:
        try:
            seconds = float(retention_s) if not isinstance(retention_s, (str, bytes, bytearray)) else math.nan
        except (TypeError, ValueError, OverflowError):
            seconds = math.nan
        if not seconds >= 0:  # also NaN; inf is kept for good
            raise InvalidArgumentError(f"retention_s must be a number of seconds >= 0, got {retention_s!r}")
        retention_s = seconds
    return priority, retention_s


def _seconds(name: str, value: float, *, minimum_s: float = 0.0, open_minimum: bool = False,
             maximum_s: float = math.inf) -> float:
    """``value`` as a float if it is a finite number of seconds in ``[minimum_s, maximum_s]``.

    Args:
        name: the argument's name, for the error message.
        value: the argument.
        minimum_s: least value, seconds.
        open_minimum: ``minimum_s`` itself is out of range (``> minimum_s``).
        maximum_s: greatest value, seconds.

    Raises:
        InvalidArgumentError: otherwise (also on a ``bool`` or a string), naming the argument.
    """
    try:
        seconds = math.nan if isinstance(value, (bool, str, bytes)) else float(value)
    except (TypeError, ValueError, OverflowError):
        seconds = math.nan
    above = seconds > minimum_s if open_minimum else seconds >= minimum_s
    if not (math.isfinite(seconds) and above and seconds <= maximum_s):
        bound = f"{'>' if open_minimum else '>='} {minimum_s:g}" + (
            f" and <= {maximum_s:g}" if math.isfinite(maximum_s) else "")
        raise InvalidArgumentError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    return seconds


def _count(name: str, value: int, minimum: int) -> int:
    """``value`` if it is an integer (not ``bool``) ``>= minimum``.

    Raises:
        InvalidArgumentError: otherwise, naming the argument ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)
