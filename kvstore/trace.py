"""Request traces of prefix-block ids: reading Mooncake's JSONL and kvstore's own generic JSONL.

A trace is a sequence of requests, each naming the chained prefix-block ids of
its prompt (equal ids at the same position mean an equal prefix up to and
including that block, as with ``kvstore.keys`` block hashes). The offline
simulator (``kvstore.sim``) and the load tester replay them.

Two formats, one JSON object per line; blank lines are skipped.

**Mooncake** (``format="mooncake"``), the traces released with Mooncake
(FAST '25, ``kvcache-ai/Mooncake`` ``FAST25-release/traces/``, Apache-2.0)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 1397, 1398]}

``timestamp`` is milliseconds since the start of the trace, ``input_length`` and
``output_length`` are tokens, and ``hash_ids`` are the ids of 512-token blocks
(``MOONCAKE_BLOCK_TOKENS``), so ``len(hash_ids) == ceil(input_length / 512)`` and
the last block may be partial. Both are checked.

**Generic** (``format="generic"``), for traces of any block size::

    {"t_s": 27.482, "tokens": 6955, "output_tokens": 52, "blocks": ["9f3ac0...", 47, "0x1a"]}

``t_s`` is seconds since the start of the trace (a float >= 0), ``tokens`` the
prompt length in tokens, ``output_tokens`` (optional, default 0) the generated
length in tokens, and ``blocks`` the chained prefix-block ids: non-negative
integers, or strings of hexadecimal digits (an optional ``0x`` prefix), e.g. the
hex of a ``kvstore.keys.BlockHash``; a hex string and the integer of the same
value are the same block. The block size is the reader's business (the
simulator's ``block_tokens``); ``tokens`` is not checked against it. Other keys
are ignored, so a line can carry more fields. :func:`write_trace` writes this
format with integer ids.

``format="auto"`` picks by the keys of the first non-blank line: ``hash_ids``
means Mooncake, ``blocks`` means generic.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from kvstore.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per block of Mooncake's ``hash_ids`` (the FAST '25 traces' README)."""

FORMATS = ("auto", "mooncake", "generic")
"""The values ``format`` accepts."""


class TraceFormatError(InvalidArgumentError):
    """A trace line is not valid in its format.

    The message reads ``<path>:<line>: <what is wrong>``.

    Attributes:
        path: the trace file.
        line_number: 1-based line number of the offending line (0 when the
            problem is with the file as a whole, e.g. an unknown format).
    """

    def __init__(self, path: str | os.PathLike[str], line_number: int, message: str) -> None:
        where = f"{os.fspath(path)}:{line_number}" if line_number else os.fspath(path)
        super().__init__(f"{where}: {message}")
        self.path = os.fspath(path)
        self.line_number = line_number


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        timestamp_s: arrival time, seconds since the start of the trace.
        input_tokens: prompt length, tokens.
        output_tokens: generated length, tokens.
        block_ids: chained prefix-block ids of the prompt, head first; shape ``(num_blocks,)``.
    """

    timestamp_s: float
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(obj: dict[str, Any], name: str, fail: Any, *, default: int | None = None) -> int:
    value = obj.get(name, default)
    if value is None:
        fail(f"missing field {name!r}")
    if not _is_int(value) or value < 0:
        fail(f"{name!r} must be an integer >= 0, got {value!r}")
    return value


def _time(obj: dict[str, Any], name: str, fail: Any) -> float:
    value = obj.get(name)
    if value is None:
        fail(f"missing field {name!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        fail(f"{name!r} must be a finite number >= 0, got {value!r}")
    return float(value)


def _ids(obj: dict[str, Any], name: str, fail: Any, *, allow_hex: bool) -> tuple[int, ...]:
    value = obj.get(name)
    if value is None:
        fail(f"missing field {name!r}")
    if not isinstance(value, list):
        fail(f"{name!r} must be a list of block ids, got {type(value).__name__}")
    out: list[int] = []
    for index, item in enumerate(value):
        if _is_int(item) and item >= 0:
            out.append(item)
            continue
        if allow_hex and isinstance(item, str):
            digits = item[2:] if item[:2].lower() == "0x" else item
            try:
                out.append(int(digits, 16))
                continue
            except ValueError:
                pass
        kind = "a non-negative integer or a hex string" if allow_hex else "a non-negative integer"
        fail(f"{name}[{index}] must be {kind}, got {item!r}")
    return tuple(out)


def _parse_mooncake(obj: dict[str, Any], fail: Any) -> TraceRequest:
    timestamp_ms = _time(obj, "timestamp", fail)
    input_tokens = _count(obj, "input_length", fail)
    output_tokens = _count(obj, "output_length", fail, default=0)
    block_ids = _ids(obj, "hash_ids", fail, allow_hex=False)
    expected = -(-input_tokens // MOONCAKE_BLOCK_TOKENS)
    if len(block_ids) != expected:
        fail(f"'hash_ids' has {len(block_ids)} ids but input_length {input_tokens} needs "
             f"ceil({input_tokens} / {MOONCAKE_BLOCK_TOKENS}) = {expected}")
    return TraceRequest(timestamp_ms / 1000.0, input_tokens, output_tokens, block_ids)


def _parse_generic(obj: dict[str, Any], fail: Any) -> TraceRequest:
    return TraceRequest(
        _time(obj, "t_s", fail),
        _count(obj, "tokens", fail),
        _count(obj, "output_tokens", fail, default=0),
        _ids(obj, "blocks", fail, allow_hex=True),
    )


_PARSERS = {"mooncake": _parse_mooncake, "generic": _parse_generic}


def iter_trace(path: str | os.PathLike[str], format: str = "auto") -> Iterator[TraceRequest]:
    """Yield the requests of a trace file in file order.

    Args:
        path: a JSONL trace (format in the module docstring).
        format: ``auto``, ``mooncake`` or ``generic``.

    Yields:
        One :class:`TraceRequest` per non-blank line.

    Raises:
        InvalidArgumentError: for an unknown ``format``.
        TraceFormatError: naming the file and line, for a line that is not a
            JSON object, misses a field, has a field of the wrong type or range,
            or (auto) a first line of neither format.
        OSError: if the file cannot be read.
    """
    if format not in FORMATS:
        raise InvalidArgumentError(f"trace format must be one of {', '.join(FORMATS)}, got {format!r}")
    parser = _PARSERS.get(format)
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue

            def fail(message: str, _line: int = line_number) -> None:
                raise TraceFormatError(path, _line, message)

            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(path, line_number, f"not valid JSON: {exc.msg} (column {exc.colno})") from None
            if not isinstance(obj, dict):
                fail(f"expected a JSON object, got {type(obj).__name__}")
            if parser is None:
                if "hash_ids" in obj:
                    parser = _parse_mooncake
                elif "blocks" in obj:
                    parser = _parse_generic
                else:
                    fail("cannot tell the format: expected a 'hash_ids' (mooncake) or 'blocks' (generic) field")
                logger.debug("trace %s: format %s", path, "mooncake" if parser is _parse_mooncake else "generic")
            yield parser(obj, fail)


def read_trace(path: str | os.PathLike[str], format: str = "auto") -> list[TraceRequest]:
    """Read a whole trace file into a list; see :func:`iter_trace` for arguments and errors."""
    return list(iter_trace(path, format))


def write_trace(path: str | os.PathLike[str], requests: Iterable[TraceRequest]) -> int:
    """Write ``requests`` to ``path`` in the generic format, one line each, with integer block ids.

    Returns:
        The number of requests written.

    Raises:
        OSError: if the file cannot be written.
    """
    count = 0
    with open(Path(path), "w", encoding="utf-8") as handle:
        for request in requests:
            line = {
                "t_s": request.timestamp_s,
                "tokens": request.input_tokens,
                "output_tokens": request.output_tokens,
                "blocks": list(request.block_ids),
            }
            handle.write(json.dumps(line, separators=(",", ":")) + "\n")
            count += 1
    return count
