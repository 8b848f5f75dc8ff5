"""Trace reading: both formats, auto-detection, round-trip, and errors that name the line."""

from __future__ import annotations

import dataclasses

from pathlib import Path

import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.tools.trace import TraceFormatError, TraceRequest, iter_trace, read_trace, write_trace

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
        ('{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1]}',
         "needs 3 (ceil) or 2 (full blocks only)"),
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


# ---------------------------------------------------------------- block sizes, agentic sessions

import json  # noqa: E402

from kvstore.tools.sim.agentic import AgenticConfig, generate_agentic  # noqa: E402
from kvstore.tools.sim.belady import check_chains  # noqa: E402
from kvstore.tools.sim.cli import main as simulate_main  # noqa: E402
from kvstore.tools.sim.trace_cli import main as trace_main  # noqa: E402
from kvstore.tools.trace import merge_sessions, read_session  # noqa: E402


def test_mooncake_reader_honours_block_tokens(tmp_path: Path) -> None:
    path = tmp_path / "64.jsonl"
    ids = list(range(1112))  # 71,175 tokens in full 64-token blocks (the kv-cache-tester shape)
    path.write_text(json.dumps({"timestamp": 0, "input_length": 71175, "output_length": 3, "hash_ids": ids}) + "\n")
    assert read_trace(path, block_tokens=64)[0].block_ids == tuple(ids)
    with pytest.raises(TraceFormatError, match=r"needs 140 \(ceil\) or 139 \(full blocks only\)"):
        read_trace(path)  # 512-token blocks: ceil(71175 / 512) = 140
    ceil = tmp_path / "ceil.jsonl"
    ceil.write_text(json.dumps({"timestamp": 0, "input_length": 130, "hash_ids": [1, 2, 3]}) + "\n")
    assert read_trace(ceil, block_tokens=64)[0].block_ids == (1, 2, 3)  # a partial last block is named too


# A session in kv-cache-tester's format, written by hand: 64-token blocks, one subagent with its own clock.
SESSION = {
    "id": "hand-0001", "block_size": 64, "hash_id_scope": "local", "tool_tokens": 100, "system_tokens": 60,
    "requests": [
        {"t": 0.0, "type": "n", "in": 200, "out": 10, "hash_ids": [1, 2, 3]},
        {"t": 5.0, "type": "subagent", "agent_id": "a1", "requests": [
            {"t": 0.0, "type": "n", "in": 130, "out": 4, "hash_ids": [1, 2, 7]},
            {"t": 9.0, "type": "n", "in": 200, "out": 4, "hash_ids": [1, 2, 7, 8]},
        ]},
        {"t": 12.0, "type": "s", "in": 300, "out": 20, "hash_ids": [1, 2, 3, 4]},
    ],
}


def _write_session(path: Path, session: dict[str, object], pretty: bool = True) -> Path:
    path.write_text(json.dumps(session, indent=2 if pretty else None))
    return path


def test_reads_an_agentic_session_with_a_subagent(tmp_path: Path) -> None:
    path = _write_session(tmp_path / "s.json", SESSION)
    session = read_session(path)
    assert session.block_tokens == 64 and session.local_ids and session.prefix_tokens == 160
    assert [(r.timestamp_s, r.input_tokens, r.output_tokens, r.block_ids) for r in session.requests] == [
        (0.0, 200, 10, (1, 2, 3)), (5.0, 130, 4, (1, 2, 7)), (12.0, 300, 20, (1, 2, 3, 4)),
        (14.0, 200, 4, (1, 2, 7, 8))]  # the subagent's second request: 5 + 9 s
    assert [r.session for r in session.requests] == ["s", "s.1", "s", "s.1"]  # the file's stem, its subagent's
    assert read_trace(path) == list(session.requests)  # auto-detected, pretty-printed or not
    one = read_trace(_write_session(tmp_path / "one.json", SESSION, pretty=False))
    assert [dataclasses.replace(r, session="") for r in one] == [dataclasses.replace(r, session="")
                                                                 for r in session.requests]
    assert read_trace(path, "weka") == list(session.requests)


def test_bad_sessions_name_the_request(tmp_path: Path) -> None:
    bad = json.loads(json.dumps(SESSION))
    bad["requests"][1]["requests"][1]["hash_ids"] = [1, 2, 7, 8, 9, 10]
    with pytest.raises(TraceFormatError, match=r"requests\[1\]\.requests\[1\]: 'hash_ids' has 6 ids"):
        read_session(_write_session(tmp_path / "bad.json", bad))
    no_size = {k: v for k, v in SESSION.items() if k != "block_size"}
    with pytest.raises(TraceFormatError, match="block_size"):
        read_session(_write_session(tmp_path / "nosize.json", no_size))


def test_sessions_merge_into_one_workload(tmp_path: Path) -> None:
    a = _write_session(tmp_path / "a.json", SESSION)
    b = _write_session(tmp_path / "b.json", SESSION)
    merged = merge_sessions([a, b], stagger_s=1.0)
    assert len(merged) == 8 and [r.timestamp_s for r in merged][:3] == [0.0, 1.0, 5.0]
    assert not set(merged[0].block_ids) & set(merged[1].block_ids)  # local ids: the sessions share nothing
    assert check_chains([r.block_ids for r in merged])
    shared = merge_sessions([a, b], shared_prefix_fraction=1.0)  # 160 prefix tokens: the first 2 blocks
    assert shared[0].block_ids[:2] == shared[1].block_ids[:2] and shared[0].block_ids[2] != shared[1].block_ids[2]
    assert read_trace(tmp_path) == merge_sessions([a, b])  # a directory of sessions


def test_trace_convert_and_simulate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _write_session(tmp_path / "a.json", SESSION)
    out = tmp_path / "merged.jsonl"
    assert trace_main(["convert", str(a), str(a), "-o", str(out), "--stagger", "2"]) == 0
    assert len(read_trace(out)) == 8
    assert simulate_main(["--trace", str(a), "--capacity", "2,inf", "--policy", "lru,default,belady",
                          "--json", str(tmp_path / "r.json")]) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["results"]
    infinite = next(r for r in rows if r["policy"] == "infinite")
    assert infinite["hit_blocks"] == 2 + 3 + 3  # then 1,2 | 1,2,3 | 1,2,7
    assert infinite["hit_tokens"] == (2 + 3 + 3) * 64  # the session's block size weighs tokens
    assert trace_main(["convert", str(tmp_path / "missing.json"), "-o", str(out)]) == 2


def test_agentic_generator_is_seeded_and_chained(tmp_path: Path) -> None:
    config = AgenticConfig(num_sessions=5, duration_s=30.0, turns=(2, 6), subagent_prob=0.3, seed=11)
    first, again = generate_agentic(config), generate_agentic(config)
    assert first == again and len(first) > 10
    assert first != generate_agentic(AgenticConfig(num_sessions=5, duration_s=30.0, turns=(2, 6), seed=12))
    chains = [r.block_ids for r in first]
    assert check_chains(chains)
    assert all(len(r.block_ids) == r.input_tokens // 64 for r in first)  # full 64-token blocks only
    assert len({c[0] for c in chains if c}) <= config.num_agent_types  # shared system and tool prefixes
    assert [r.timestamp_s for r in first] == sorted(r.timestamp_s for r in first)
    out = tmp_path / "g.jsonl"
    assert trace_main(["generate", "-o", str(out), "--sessions", "3", "--duration", "20", "--seed", "1"]) == 0
    assert read_trace(out)
