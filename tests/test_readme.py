"""The README stays a short page whose commands, code and links work as written.

It opens with the two commands CI runs; every ``kvstore`` command line in it
parses with the real parser, every ``make`` target exists, the embedded quick
start runs, every Python block compiles, every relative link (of the README and
of the pages under docs/ and benchmarks/) names a file that exists, the
install line names the distribution of ``pyproject.toml``, and the sample demo
output has the shape that ``kvstore demo`` prints (``tests/connectors/test_demo.py``
checks the real output against the same pattern).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvstore.cli import build_parser

from tests.support.demo import DEMO_LINE

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 300




def _fenced(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of each fenced code block, in order (``""`` for a block without a language)."""
    blocks, language, body = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if language is None:
                language, body = line[3:].strip(), []
            else:
                blocks.append((language, "\n".join(body) + "\n"))
                language = None
        elif language is not None:
            body.append(line)
    return blocks


def _blocks(text: str, language: str) -> list[str]:
    return [body for lang, body in _fenced(text) if lang == language]


def _readme() -> str:
    return README.read_text()


def python_blocks() -> list[str]:
    """The README's Python blocks, in order (the first is the embedded quick start)."""
    return _blocks(_readme(), "python")


def _command_lines(language: str = "bash") -> list[str]:
    lines = []
    for block in _blocks(_readme(), language):
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def test_readme_opens_with_the_two_commands() -> None:
    head = _readme().split("\n\n", 2)[1]
    assert "make demo" in head and "make test" in head
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_readme_is_a_short_page() -> None:
    assert len(_readme().splitlines()) <= MAX_LINES


def test_every_kvstore_command_parses() -> None:
    commands = [line for line in _command_lines() if line.startswith("kvstore ")]
    assert len(commands) >= 8
    for line in commands:
        argv = shlex.split(line.split("&&")[0])[1:]
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"the README's `{line}` does not parse")
        assert getattr(args, "func", None) is not None, line


def test_every_make_target_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = {t for line in _command_lines() if line.startswith("make ") for t in shlex.split(line)[1:]
               if not t.startswith("-") and "=" not in t}
    assert {"demo", "test"} <= targets
    for target in targets:
        assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), f"make {target}: no such target"


def test_every_file_the_commands_name_exists() -> None:
    for line in _command_lines():
        for word in shlex.split(line.replace("&&", " ")):
            if word.startswith(("deploy/", "docker-compose", "scripts/", "tests/", "benchmarks/")):
                assert (ROOT / word).exists(), f"`{line}` names {word}, which does not exist"


@pytest.mark.slow
def test_the_embedded_quick_start_runs(tmp_path: Path) -> None:
    code = _blocks(_readme(), "python")[0]
    assert "open_store" in code
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "LookupResult(num_blocks=6, tiers=('memory'" in result.stdout


def test_every_python_block_compiles() -> None:
    for index, code in enumerate(_blocks(_readme(), "python")):
        compile(code, f"README.md python block {index}", "exec")


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file(page: Path) -> None:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        if not path:  # an anchor in this page: one of its headings, as GitHub makes their ids
            assert anchor in _heading_ids(page), f"{page.name}: no heading for the anchor #{anchor}"
            continue
        assert (page.parent / path).exists(), f"{page.name}: link to {target}, which does not exist"


def _heading_ids(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_the_install_line_names_the_distribution() -> None:
    name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    installs = [line for line in _command_lines() if line.startswith("pip install") and " torch==" not in line]
    assert installs and all(name in line or "pip install -e '.[" in line for line in installs)  # or a checkout's
    assert f"`pip install '{name}[hf]'`" in _readme()  # once published
    assert f"pip install 'kvstore" not in _readme()


def test_the_sample_demo_output_has_the_demos_shape() -> None:
    (sample,) = [b for b in _blocks(_readme(), "") if "TTFT" in b]
    lines = sample.splitlines()
    assert lines and all(DEMO_LINE.match(line) for line in lines), [l for l in lines if not DEMO_LINE.match(l)]

