#!/usr/bin/env python3
"""Build README.md from docs/: the head, each section (headings shifted so its top is ##), the tail.

The sections in docs/ are the sources; edit them, then run this script.
`python scripts/build_readme.py --check` exits 1 when README.md is stale (a test runs it).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ["service", "demo", "simulate", "loadtest", "redis", "scaleout", "deploy", "security"]


def shift_headings(text: str) -> str:
    """Shift Markdown headings outside code fences so the first one becomes level 2."""
    top = None
    in_code = False
    out = []
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = re.match(r"^(#+) ", line)
        if match and not in_code:
            top = top or len(match.group(1))
            line = "#" * (len(match.group(1)) - top + 2) + line[len(match.group(1)):]
        out.append(line)
    return "\n".join(out) + "\n"


def build() -> str:
    """The README text."""
    parts = [(ROOT / "docs" / "README.head.md").read_text()]
    for name in SECTIONS:
        text = shift_headings((ROOT / "docs" / f"{name}.md").read_text())
        parts.append(text.replace("](demo_ttft.png)", "](docs/demo_ttft.png)").replace("](../", "]("))
    parts.append((ROOT / "docs" / "README.tail.md").read_text())
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    readme = ROOT / "README.md"
    text = build()
    if "--check" in argv:
        if readme.read_text() != text:
            print("README.md is stale: run python scripts/build_readme.py", file=sys.stderr)
            return 1
        return 0
    readme.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
