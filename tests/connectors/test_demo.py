"""``kvstore demo`` end to end with the tiny preset: identical outputs, hits, a summary and a plot."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from kvstore.tools.demo import main
from kvstore.tools.demo.tokenizer import ByteTokenizer
from kvstore.tools.demo.workload import conversation, load_corpus, passage_questions
from tests.support.demo import DEMO_LINE  # the README's sample output has this shape

pytestmark = pytest.mark.slow  # starts processes or servers: outside `make test-fast`


def test_workload_prompts_share_their_prefixes():
    corpus = load_corpus()
    questions = passage_questions(corpus, 1800, 4)
    turns = conversation(corpus, 4, 500)
    passage_len = questions[0].text.index("Question:")
    assert 1500 <= len(ByteTokenizer().encode(questions[0].text[:passage_len])) <= 3000
    assert len({q.text[:passage_len] for q in questions}) == 1
    assert all(later.text.startswith(earlier.text) for earlier, later in zip(turns, turns[1:]))
    assert ByteTokenizer().decode(ByteTokenizer().encode("To be, or not")) == "To be, or not"


def test_demo_runs_end_to_end_with_the_embedded_store(tmp_path, capsys):
    code = main([
        "--model", "tiny", "--device", "cpu", "--passage-tokens", "400", "--questions", "2",
        "--turns", "3", "--turn-tokens", "200", "--block-size", "32", "--max-new-tokens", "4",
        "--out", str(tmp_path),
    ])
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = summary["requests"]
    assert [r["name"] for r in rows] == ["question 1", "question 2", "turn 1", "turn 2", "turn 3"]
    assert all(r["identical"] for r in rows)
    assert rows[0]["cached_tokens"] == 0  # a cold store
    assert rows[1]["cached_tokens"] >= 320  # the passage, in 32-token blocks
    assert rows[3]["cached_tokens"] > 0 and rows[4]["cached_tokens"] > rows[3]["cached_tokens"]
    assert summary["connector"]["num_load_failures"] == 0
    assert (tmp_path / "ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "outputs identical: 5/5" in out
    request_lines = [line for line in out.splitlines() if "TTFT" in line and "cached" in line]
    assert len(request_lines) == 5 and all(DEMO_LINE.match(line) for line in request_lines), request_lines
