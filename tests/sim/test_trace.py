"""Trace reading: both formats, auto-detection, round-trip, and errors that name the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.trace import TraceFormatError, TraceRequest, iter_trace, read_trace, write_trace

TRACES = Path(__file__).resolve().parents[2] / "benchmarks" / "traces"


@pytest.mark.slow
def test_reads_the_mooncake_conversation_trace() -> None:
    requests = read_trace(TRACES / "mooncake_conversation_trace.jsonl")
    assert len(requests) == 12031
    first = requests[0]
    assert first == TraceRequest(0.0, 6758, 500, tuple(range(14)))
    assert len({b for r in requests for b in r.block_ids}) == 182790
    assert requests[-1].timestamp_s == pytest.approx(3536.999)


def test_generic_round_trip_with_hex_ids(tmp_path: Path) -> None:
    original = [
        TraceRequest(0.0, 1000, 10, (1, 2)),
        TraceRequest(1.5, 2048, 0, (1, 2, 2**127 + 5, 7)),
    ]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, original) == 2
    assert read_trace(path) == original
    assert read_trace(path, "generic") == original
    hexed = tmp_path / "h.jsonl"
    hexed.write_text('{"t_s": 2, "tokens": 5, "blocks": ["ff", "0x10", 3]}\n\n')
    assert read_trace(hexed) == [TraceRequest(2.0, 5, 0, (255, 16, 3))]


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1}', "missing field 'hash_ids'"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, "x"]}', "hash_ids[1]"),
        ('{"timestamp": -1, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}', "'timestamp'"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "ceil(600 / 512) = 2"),
        ('{"timestamp": 0, "input_length": 1.5, "output_length": 1, "hash_ids": [1]}', "'input_length'"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, line: str, fragment: str) -> None:
    path = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}'
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(TraceFormatError) as info:
        read_trace(path, "mooncake")
    assert info.value.line_number == 3
    assert str(info.value).startswith(f"{path}:3: ")
    assert fragment in str(info.value)
    assert isinstance(info.value, InvalidArgumentError)


def test_auto_detect_rejects_unknown_lines_and_bad_hex(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"foo": 1}\n')
    with pytest.raises(TraceFormatError, match=r"x.jsonl:1: cannot tell the format"):
        read_trace(path)
    path.write_text('{"t_s": 0, "tokens": 5, "blocks": ["zz"]}\n')
    with pytest.raises(TraceFormatError, match=r"blocks\[0\]"):
        read_trace(path)
    with pytest.raises(InvalidArgumentError, match="trace format"):
        list(iter_trace(path, "csv"))
