"""What ``kvstore demo`` prints, as the demo test and the README's sample check it."""

from __future__ import annotations

import re

DEMO_LINE = re.compile(
    r"^ *(question|turn) \d+: +\d+ tokens, +\d+ cached \( *\d+%\)  TTFT +[\d.]+ s -> +[\d.]+ s \( *[\d.]+x\)  "
    r"output (identical|DIFFERS) \(logits max \|diff\| \d\.\de[+-]\d\d\)( +\[store failed: full prefill\])?$")
"""A request line of ``kvstore demo``'s output."""
