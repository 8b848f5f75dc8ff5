"""Structured logs: one JSON object a line with the event and its fields, or text."""

from __future__ import annotations

import io
import json
import logging

from kvstore.server.logs import configure_logging


def test_json_lines_carry_event_and_fields() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        configure_logging("DEBUG", "json", stream)
        logging.getLogger("kvstore.test").info("serving", extra={"fields": {"port": 5, "level": "clash"}})
        logging.getLogger("kvstore.test").debug("lazy %s", "args")
        lines = [json.loads(line) for line in stream.getvalue().splitlines()]
        assert lines[0]["event"] == "serving" and lines[0]["port"] == 5 and lines[0]["level"] == "INFO"
        assert lines[0]["field_level"] == "clash" and lines[0]["logger"] == "kvstore.test"
        assert lines[1]["event"] == "lazy args"
        configure_logging("WARNING", "text", stream)
        logging.getLogger("kvstore.test").info("hidden")
        logging.getLogger("kvstore.test").warning("shown", extra={"fields": {"port": 7}})
        assert "hidden" not in stream.getvalue() and "shown port=7" in stream.getvalue()
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
