"""Structured logging of the server: one JSON object a line (default) or plain text, on stderr.

A record's message is its ``event``; structured fields travel in
``extra={"fields": {...}}``::

    logger.info("serving", extra={"fields": {"port": 50051}})
    # {"ts": "2025-01-01T00:00:00.000Z", "level": "INFO", "logger": "kvstore.server.app",
    #  "event": "serving", "port": 50051}
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

_RESERVED = ("ts", "level", "logger", "event")

LIFECYCLE_LOGGER = "kvstore.server.lifecycle"
"""Logger of the server's lifecycle events (``serving``, ``signal received``, ``shutting down``, ``stopped``).

It logs at INFO whatever the configured level, so the ``serving`` line (with
the bound ports) is always there for tools that start ``kvstore serve --port 0``.
"""


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object: ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``event``, then its fields."""

    def format(self, record: logging.LogRecord) -> str:
        """Return the record as a single line of JSON."""
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        line: dict[str, Any] = {"ts": ts, "level": record.levelname, "logger": record.name,
                                "event": record.getMessage()}
        for key, value in getattr(record, "fields", {}).items():
            line[f"field_{key}" if key in _RESERVED else key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """Formats a record as ``time level logger: event key=value ...``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        """Return the record as one line of text (plus a traceback, if any)."""
        text = super().format(record)
        fields = getattr(record, "fields", {})
        if fields:
            first, _, rest = text.partition("\n")
            text = first + " " + " ".join(f"{k}={v}" for k, v in fields.items()) + (f"\n{rest}" if rest else "")
        return text


def configure_logging(level: str = "INFO", fmt: str = "json", stream: TextIO | None = None) -> None:
    """Send every log record at ``level`` or above to ``stream`` in ``fmt``; replaces earlier handlers.

    Args:
        level: ``DEBUG``, ``INFO``, ``WARNING`` or ``ERROR``.
        fmt: ``json`` or ``text``.
        stream: where to write; ``sys.stderr`` when ``None``.
    """
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger(LIFECYCLE_LOGGER).setLevel(logging.INFO)
