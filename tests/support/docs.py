"""The fenced code blocks of the README and ``docs/*.md``, with the mark that says who runs each one.

A block a user is meant to run (``bash``, ``sh``, ``shell`` or ``python``) is run
by ``tests/test_docs.py`` unless the HTML comment on the line right before its
fence marks it otherwise:

* ``<!-- not-run: REASON -->``: needs what this CPU machine lacks (a GPU, Docker,
  a network, a Kubernetes cluster, a service of yours); the reason is required.
* ``<!-- tested-by: PATH [note] -->``: the test file ``PATH`` runs it (heavier
  set-ups: a fresh venv, real vLLM engines); that file must exist and name the page.
* ``<!-- continues -->``: a Python block that runs after the page's earlier runnable
  Python blocks, in one process (it uses their names).
* ``<!-- background: HOST:PORT -->``: a shell block that starts a server and leaves
  it running; the page's later shell blocks run while it serves, and it is stopped
  (with every process the block started) when the page is done.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = {"bash": "shell", "sh": "shell", "shell": "shell", "python": "python"}
MARK = re.compile(r"^<!--\s*(not-run|tested-by|continues|background)\s*(?::\s*(.*?))?\s*-->$")


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    """One fenced block of a page.

    Attributes:
        page: the Markdown file.
        line: the 1-based line of its opening fence.
        language: the fence's info string (``""`` for none).
        body: the text between the fences, ending in a newline.
        mark: ``not-run``, ``tested-by``, ``continues``, ``background`` or ``""`` (none).
        note: the text after the mark's colon (the reason, the test file, the address).
    """

    page: Path
    line: int
    language: str
    body: str
    mark: str = ""
    note: str = ""

    @property
    def kind(self) -> str:
        """``shell``, ``python``, or ``""`` for a block nobody runs (output, YAML, TOML, ...)."""
        return RUNNABLE.get(self.language, "")

    @property
    def name(self) -> str:
        """``page:line``, relative to the repository, for test ids and messages."""
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """The README and every ``docs/*.md``, found afresh each run (a new page is picked up by itself)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, in order, each with the mark on the line before its fence.

    Raises:
        ValueError: a fence is not closed, or a mark is malformed (an unknown word, a
            ``not-run`` or ``tested-by`` without its reason or path).
    """
    found: list[Block] = []
    lines = page.read_text().splitlines()
    start, language, body = -1, "", []
    for number, text in enumerate(lines, start=1):
        if text.startswith("```"):
            if start < 0:
                start, language, body = number, text[3:].strip(), []
            else:
                mark, note = _mark(page, lines[start - 2] if start >= 2 else "", start)
                found.append(Block(page, start, language, "\n".join(body) + "\n", mark, note))
                start = -1
        elif start >= 0:
            body.append(text)
    if start >= 0:
        raise ValueError(f"{page}:{start}: a fence that is never closed")
    return found


def _mark(page: Path, text: str, line: int) -> tuple[str, str]:
    text = text.strip()
    if not text.startswith("<!--"):
        return "", ""
    match = MARK.match(text)
    if match is None:
        raise ValueError(f"{page}:{line - 1}: {text!r} is no mark (not-run, tested-by, continues, background)")
    mark, note = match.group(1), (match.group(2) or "").strip()
    if mark in ("not-run", "tested-by", "background") and not note:
        raise ValueError(f"{page}:{line - 1}: `{mark}` needs {'a reason' if mark == 'not-run' else 'its target'}")
    return mark, note


def block_at(page: Path, heading: str, index: int = 0, kind: str = "") -> Block:
    """The ``index``-th block (of ``kind``, if given) under the heading ``heading`` of ``page``.

    Raises:
        LookupError: no such heading or block.
    """
    text = page.read_text().splitlines()
    starts = [n for n, line in enumerate(text, start=1) if re.fullmatch(r"#+ " + re.escape(heading), line)]
    if not starts:
        raise LookupError(f"{page.name}: no heading {heading!r}")
    ends = [n for n, line in enumerate(text, start=1) if line.startswith("#") and n > starts[0]
            and not any(b.line < n <= b.line + b.body.count("\n") for b in blocks(page))]
    end = ends[0] if ends else len(text) + 1
    inside = [b for b in blocks(page) if starts[0] < b.line < end and (not kind or b.kind == kind)]
    if index >= len(inside):
        raise LookupError(f"{page.name}: under {heading!r} there is no block {index}")
    return inside[index]


def commands(block: Block) -> list[str]:
    """The shell block's command lines: comments (``# ...`` after two spaces or more) and blank lines dropped."""
    lines = []
    for line in block.body.splitlines():
        line = re.split(r"\s{2,}#|^#", line)[0].strip()
        if line:
            lines.append(line)
    return lines
