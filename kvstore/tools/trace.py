"""Request traces of prefix-block ids: reading Mooncake's JSONL and kvstore's own generic JSONL.

A trace is a sequence of requests, each naming the chained prefix-block ids of
its prompt (equal ids at the same position mean an equal prefix up to and
including that block, as with ``kvstore.keys`` block hashes). The offline
simulator (``kvstore.tools.sim``) and the load tester replay them.

Two formats, one JSON object per line; blank lines are skipped.

**Mooncake** (``format="mooncake"``), the traces released with Mooncake
(FAST '25, ``kvcache-ai/Mooncake`` ``FAST25-release/traces/``, Apache-2.0)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 1397, 1398]}

``timestamp`` is milliseconds since the start of the trace, ``input_length`` and
``output_length`` are tokens, and ``hash_ids`` are the ids of blocks of
``block_tokens`` tokens (512 in Mooncake's traces, ``MOONCAKE_BLOCK_TOKENS``; a
reader's argument, ``--block-tokens``), so ``len(hash_ids)`` is
``ceil(input_length / block_tokens)`` (the last block may be partial) or
``floor(input_length / block_tokens)`` (only full blocks hashed, as vLLM
does). Both are accepted and checked.

**Generic** (``format="generic"``), for traces of any block size::

    {"t_s": 27.482, "tokens": 6955, "output_tokens": 52, "blocks": ["9f3ac0...", 47, "0x1a"]}

``t_s`` is seconds since the start of the trace (a float >= 0), ``tokens`` the
prompt length in tokens, ``output_tokens`` (optional, default 0) the generated
length in tokens, and ``blocks`` the chained prefix-block ids: non-negative
integers, or strings of hexadecimal digits (an optional ``0x`` prefix), e.g. the
hex of a ``kvstore.keys.BlockHash``; a hex string and the integer of the same
value are the same block. The block size is the reader's business (the
simulator's ``block_tokens``); ``tokens`` is not checked against it. Optional:
``session`` (the agentic session, a string), ``ttl_s`` (its cache-control TTL,
seconds) and ``namespace`` (a label: requests of another label are in another
namespace; ``docs/agentic.md``). Other keys are ignored, so a line can carry
more fields. :func:`write_trace` writes this format with integer ids.

**Agentic sessions** (``format="weka"``): the kv-cache-tester format of agentic
coding sessions (``callanjfox/kv-cache-tester``, ``trace_replay_tester.py``):
one JSON document per file, one session::

    {"block_size": 64, "hash_id_scope": "local", "tool_tokens": 12974, "system_tokens": 4243,
     "requests": [{"t": 0.0, "in": 71175, "out": 169, "hash_ids": [1, 2, ...]},
                  {"t": 134.2, "type": "subagent", "requests": [{"t": 0.0, "in": 9526, ...}]}, ...]}

``t`` is seconds since the session's start (a subagent's requests count from
the subagent's own ``t``), ``in`` and ``out`` are tokens, and ``hash_ids`` name
the request's blocks of ``block_size`` tokens, as for Mooncake. Requests come
out sorted by time, a subagent's interleaved with its parent's. Several session
files make one workload with :func:`merge_sessions` (``kvstore trace
convert``), which keeps sessions' ids apart when their ``hash_id_scope`` is
``local``; a directory given as a trace path is read that way.

``format="auto"`` picks by the first non-blank line: ``hash_ids`` means
Mooncake, ``blocks`` means generic, and a document with ``requests`` (on one
line or not) means an agentic session.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from kvstore.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per block of Mooncake's ``hash_ids`` (the FAST '25 traces' README)."""

FORMATS = ("auto", "mooncake", "generic", "weka")
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
        session: the agentic session the request belongs to (``""``: none), as a client passes ``session_id``.
        ttl_s: the cache-control TTL the request's blocks carry, seconds (0.0: none; ``docs/agentic.md``).
        namespace: a label of the namespace the request is in (``""``: the replay's own); requests in another
            label's namespace share no block with it (``kvstore loadtest`` changes the namespace's revision to the
            label, the simulator keeps their ids apart).
    """

    timestamp_s: float
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]
    session: str = ""
    ttl_s: float = 0.0
    namespace: str = ""


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


def _check_block_count(num_ids: int, input_tokens: int, block_tokens: int, fields: tuple[str, str],
                       fail: Any) -> None:
    full, ceil = input_tokens // block_tokens, -(-input_tokens // block_tokens)
    if num_ids not in (full, ceil):
        ids, length = fields
        fail(f"{ids!r} has {num_ids} ids but {length} {input_tokens} with {block_tokens}-token blocks needs "
             f"{ceil} (ceil) or {full} (full blocks only); is --block-tokens right?")


def _parse_mooncake(obj: dict[str, Any], fail: Any, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> TraceRequest:
    timestamp_ms = _time(obj, "timestamp", fail)
    input_tokens = _count(obj, "input_length", fail)
    output_tokens = _count(obj, "output_length", fail, default=0)
    block_ids = _ids(obj, "hash_ids", fail, allow_hex=False)
    _check_block_count(len(block_ids), input_tokens, block_tokens, ("hash_ids", "input_length"), fail)
    return TraceRequest(timestamp_ms / 1000.0, input_tokens, output_tokens, block_ids)


def _label(obj: dict[str, Any], name: str, fail: Any) -> str:
    value = obj.get(name, "")
    if not isinstance(value, str) or len(value) > 256:
        fail(f"{name!r} must be a string of at most 256 characters, got {value!r}")
    return value


def _ttl(obj: dict[str, Any], fail: Any) -> float:
    if "ttl_s" not in obj:
        return 0.0
    return _time(obj, "ttl_s", fail)


def _parse_generic(obj: dict[str, Any], fail: Any, block_tokens: int = 0) -> TraceRequest:
    return TraceRequest(
        _time(obj, "t_s", fail),
        _count(obj, "tokens", fail),
        _count(obj, "output_tokens", fail, default=0),
        _ids(obj, "blocks", fail, allow_hex=True),
        _label(obj, "session", fail),
        _ttl(obj, fail),
        _label(obj, "namespace", fail),
    )


_PARSERS = {"mooncake": _parse_mooncake, "generic": _parse_generic}


def _check_block_tokens(block_tokens: int) -> None:
    if not isinstance(block_tokens, int) or isinstance(block_tokens, bool) or block_tokens <= 0:
        raise InvalidArgumentError(f"block_tokens must be an integer > 0, got {block_tokens!r}")


def _first_line(path: str | os.PathLike[str]) -> str:
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                return line
    return ""


def is_session_file(path: str | os.PathLike[str]) -> bool:
    """Whether a file holds an agentic session: its first line is, or starts, a JSON document with ``requests``."""
    line = _first_line(path).strip()
    if not line.startswith("{"):
        return False
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:  # a document over several lines: only a session is written so
        return True
    return isinstance(obj, dict) and "requests" in obj and "hash_ids" not in obj and "blocks" not in obj


def iter_trace(path: str | os.PathLike[str], format: str = "auto",
               block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Iterator[TraceRequest]:
    """Yield the requests of a trace file in file order (an agentic session: in time order).

    Args:
        path: a trace file (formats in the module docstring), or a directory of
            agentic session files (merged with :func:`merge_sessions`'s defaults).
        format: ``auto``, ``mooncake``, ``generic`` or ``weka``.
        block_tokens: tokens per block of a Mooncake trace, to check its
            ``hash_ids`` against ``input_length``; sessions carry their own.

    Yields:
        One :class:`TraceRequest` per request.

    Raises:
        InvalidArgumentError: for an unknown ``format`` or a bad ``block_tokens``.
        TraceFormatError: naming the file and line, for a line that is not a
            JSON object, misses a field, has a field of the wrong type or range,
            or (auto) a first line of neither format.
        OSError: if the file cannot be read.
    """
    if format not in FORMATS:
        raise InvalidArgumentError(f"trace format must be one of {', '.join(FORMATS)}, got {format!r}")
    _check_block_tokens(block_tokens)
    if os.path.isdir(path):
        if format not in ("auto", "weka"):
            raise InvalidArgumentError(f"{os.fspath(path)} is a directory: only agentic session files (weka) "
                                       f"are read from a directory")
        yield from merge_sessions(sorted(Path(path).glob("*.json")))
        return
    if format == "weka" or (format == "auto" and is_session_file(path)):
        yield from read_session(path).requests
        return
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
                    fail("cannot tell the format: expected a 'hash_ids' (mooncake) or 'blocks' (generic) field, "
                         "or an agentic session's 'requests'")
                logger.debug("trace %s: format %s", path, "mooncake" if parser is _parse_mooncake else "generic")
            yield parser(obj, fail, block_tokens)


def read_trace(path: str | os.PathLike[str], format: str = "auto",
               block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRequest]:
    """Read a whole trace file into a list; see :func:`iter_trace` for arguments and errors."""
    return list(iter_trace(path, format, block_tokens))


@dataclass(frozen=True, slots=True)
class Session:
    """One agentic session file (kv-cache-tester format): its requests in time order, and how to read its ids.

    Attributes:
        requests: the session's requests and its subagents', sorted by time (ties in file order).
        block_tokens: tokens per block (``block_size``).
        local_ids: whether the ids are the session's own (``hash_id_scope`` ``local``,
            the default) rather than shared with other sessions (``global``).
        prefix_tokens: ``tool_tokens + system_tokens``, the session's system and tool prefix (0 if absent).
    """

    requests: tuple[TraceRequest, ...]
    block_tokens: int
    local_ids: bool
    prefix_tokens: int


def read_session(path: str | os.PathLike[str], ttl_s: float = 0.0) -> Session:
    """Read one agentic session file (module docstring); nested subagents' requests are merged in by time.

    Each request names its session (:attr:`TraceRequest.session`): the file's ``session_id`` if it has one, else
    the file's stem, and ``<session>.<n>`` for its ``n``-th subagent; ``ttl_s`` is given to every request.

    Raises:
        TraceFormatError: naming the file and the request (``requests[3].requests[0]``) at fault.
        OSError: if the file cannot be read.
    """
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TraceFormatError(path, exc.lineno, f"not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        raise TraceFormatError(path, 0, "an agentic session must be a JSON object with a 'requests' list")

    def fail_at(where: str) -> Any:
        def fail(message: str) -> None:
            raise TraceFormatError(path, 0, f"{where}: {message}")
        return fail

    block_tokens = _count(doc, "block_size", fail_at("block_size"))
    if block_tokens <= 0:
        raise TraceFormatError(path, 0, f"'block_size' must be > 0, got {block_tokens}")
    scope = doc.get("hash_id_scope", "local")
    if scope not in ("local", "global"):
        raise TraceFormatError(path, 0, f"'hash_id_scope' must be 'local' or 'global', got {scope!r}")
    found: list[tuple[float, int, TraceRequest]] = []
    subagents = [0]

    def walk(requests: list[Any], start_s: float, where: str, session: str) -> None:
        for index, obj in enumerate(requests):
            here = f"{where}[{index}]"
            fail = fail_at(here)
            if not isinstance(obj, dict):
                fail(f"expected a JSON object, got {type(obj).__name__}")
            t_s = start_s + _time(obj, "t", fail)
            if obj.get("type") == "subagent":
                if not isinstance(obj.get("requests"), list):
                    fail("a subagent needs a 'requests' list")
                subagents[0] += 1
                walk(obj["requests"], t_s, f"{here}.requests", f"{session}.{subagents[0]}")
                continue
            input_tokens = _count(obj, "in", fail)
            block_ids = _ids(obj, "hash_ids", fail, allow_hex=False)
            _check_block_count(len(block_ids), input_tokens, block_tokens, ("hash_ids", "in"), fail)
            request = TraceRequest(t_s, input_tokens, _count(obj, "out", fail, default=0), block_ids, session,
                                   ttl_s)
            found.append((t_s, len(found), request))

    name = doc.get("session_id") if isinstance(doc.get("session_id"), str) else Path(path).stem
    walk(doc["requests"], 0.0, "requests", name[:200])
    found.sort(key=lambda item: (item[0], item[1]))
    prefix = sum(v for v in (doc.get("tool_tokens"), doc.get("system_tokens")) if _is_int(v) and v > 0)
    return Session(tuple(r for _, _, r in found), block_tokens, scope == "local", prefix)


def merge_sessions(paths: Sequence[str | os.PathLike[str]], *, stagger_s: float = 0.0,
                   shared_prefix_fraction: float = 0.0, ttl_s: float = 0.0) -> list[TraceRequest]:
    """One workload from several agentic session files: their requests interleaved by time.

    Session ``i`` (in the order given) starts ``i * stagger_s`` seconds in. Ids
    of sessions with local ids are renumbered so that no two sessions share a
    block; ids of global-scope sessions are kept (renumbered into the same space).
    New ids are assigned in order of first use, so the result is the same in
    every run.

    Args:
        paths: session files.
        stagger_s: seconds between the starts of consecutive sessions (>= 0).
        shared_prefix_fraction: the fraction (``[0, 1]``) of each session's system
            and tool prefix (``tool_tokens + system_tokens``, in whole blocks) that
            all sessions share, as kv-cache-tester's ``--warm-prefix-pct`` assumes
            of one agent's tool definitions: those first blocks get common ids.
        ttl_s: a TTL every request carries (0.0: none).

    Raises:
        InvalidArgumentError: on a bad ``stagger_s`` or fraction, no file, or
            sessions of different block sizes.
        TraceFormatError: for a bad session file.
        OSError: if a file cannot be read.
    """
    if not stagger_s >= 0 or not 0.0 <= shared_prefix_fraction <= 1.0 or not 0 <= ttl_s < math.inf:
        raise InvalidArgumentError("stagger_s must be >= 0, shared_prefix_fraction in [0, 1] and ttl_s >= 0")
    if not paths:
        raise InvalidArgumentError("give at least one session file")
    ids: dict[tuple[int, int], int] = {}
    merged: list[tuple[float, int, int, TraceRequest]] = []
    block_tokens = None
    for index, path in enumerate(paths):
        session = read_session(path, ttl_s)
        if block_tokens is None:
            block_tokens = session.block_tokens
        elif session.block_tokens != block_tokens:
            raise InvalidArgumentError(f"{os.fspath(path)}: block_size {session.block_tokens}, but earlier "
                                       f"sessions have {block_tokens}")
        space = index if session.local_ids else -1
        shared = int(shared_prefix_fraction * session.prefix_tokens) // session.block_tokens
        offset_s = index * stagger_s
        for order, request in enumerate(session.requests):
            renamed = tuple(
                ids.setdefault((-2, position) if position < shared else (space, key), len(ids))
                for position, key in enumerate(request.block_ids)
            )
            merged.append((request.timestamp_s + offset_s, index, order,
                           TraceRequest(request.timestamp_s + offset_s, request.input_tokens,
                                        request.output_tokens, renamed, f"{index}:{request.session}", ttl_s)))
    merged.sort(key=lambda item: item[:3])
    return [request for *_, request in merged]


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
            line: dict[str, Any] = {
                "t_s": request.timestamp_s,
                "tokens": request.input_tokens,
                "output_tokens": request.output_tokens,
                "blocks": list(request.block_ids),
            }
            for name, value in (("session", request.session), ("ttl_s", request.ttl_s),
                                ("namespace", request.namespace)):
                if value:
                    line[name] = value
            handle.write(json.dumps(line, separators=(",", ":")) + "\n")
            count += 1
    return count
