"""docs/comparison.md stays true: each claim kvstore's column makes names a test file or a doc that exists.

In the "Feature by feature" table, the kvstore cell of every row that says
"yes", and of the rows that list what kvstore supports (engines, transport),
must name at least one path: a link (``[vllm.md](vllm.md)``) or a code span
(``tests/connectors/vllm/test_vllm_exact.py``), each of which exists. A claim
added without its evidence, or evidence that is moved or deleted, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "comparison.md"
LISTING_ROWS = {"engines", "transport"}
"""Rows whose kvstore cell lists what it supports rather than answering yes or no."""


def _rows() -> dict[str, list[str]]:
    table = PAGE.read_text().split("## Feature by feature", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        if line.startswith("|") and not line.startswith("|---") and not line.startswith("| |"):
            cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
            rows[cells[0]] = cells[1:]
    return rows


def _evidence(cell: str) -> list[str]:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", cell)
    spans = [s for s in re.findall(r"`([^`]+)`", cell) if re.fullmatch(r"(tests|docs|benchmarks)/[\w/.-]+", s)]
    return [str((PAGE.parent / link).resolve().relative_to(ROOT)) for link in links] + spans


def test_the_table_has_its_rows_and_columns() -> None:
    rows = _rows()
    assert {"engines", "transport", "prefill/decode disaggregation", "TLS", "compression"} <= rows.keys()
    assert all(len(cells) == 4 for cells in rows.values()), {k: len(v) for k, v in rows.items() if len(v) != 4}


def test_every_claim_names_evidence_that_exists() -> None:
    claims = {name: cells[0] for name, cells in _rows().items()
              if name in LISTING_ROWS or cells[0].lower().startswith("yes")}
    assert {"engines", "transport", "prefill/decode disaggregation", "TLS"} <= claims.keys()
    for name, cell in claims.items():
        evidence = _evidence(cell)
        assert evidence, f"comparison.md, row {name!r}: kvstore's claim names no test or doc: {cell}"
        for path in evidence:
            assert (ROOT / path).exists(), f"comparison.md, row {name!r}: {path} does not exist"


def test_the_page_says_nothing_the_vllm_docs_contradict() -> None:
    text = PAGE.read_text()
    assert "being added" not in text and "until the vLLM connector lands" not in text
    (disaggregation,) = [cells[0] for name, cells in _rows().items() if name == "prefill/decode disaggregation"]
    assert disaggregation.startswith("yes") and "kv_producer" in (ROOT / "docs" / "vllm.md").read_text()
