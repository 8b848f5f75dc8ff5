"""bench_peers' worker: one system under test in a process of its own, driven over a line protocol.

Usage: ``python worker.py MODULE:CLASS PAYLOAD_FILE SETTINGS_JSON``, from the
venv of the system's package (``make bench-peers`` builds them). The worker
builds the driver, stores the payload (``Driver.setup``), checks one Get of
each kind, and says ``{"ready": ...}`` with the versions. Then each line on
stdin is a JSON command and each answer one JSON line on stdout:

* ``{"cmd": "op", "op": "get"|"put", "kind": K}``: one call, timed here with
  ``time.perf_counter`` around the call alone; answers ``{"ms": ...}``. Before
  a Get the destination is zeroed, after it the bytes are compared with the
  payload; after a Put its blocks are read back and compared, then deleted
  (all untimed). A wrong answer is an error, never a figure.
* ``{"cmd": "series", "op": ..., "kind": K, "count": N}``: N such calls back to
  back; answers ``{"ms": [...]}``.
* ``{"cmd": "loop", "kind": K, "count": N}``: N Gets back to back, the first and
  last checked; answers ``{"start": ..., "end": ...}`` (``perf_counter``, which is
  CLOCK_MONOTONIC on Linux, so comparable across processes of one host).
* ``{"cmd": "copy_gib"}`` (``CopyDriver`` only) and ``{"cmd": "quit"}``.

An error answers ``{"error": "..."}`` with the traceback. What the system's
libraries print goes to stderr (the worker's log), never into the protocol.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import sys
import time
import traceback
from typing import Any, Callable

import torch

from drivers import KINDS, Driver, Payload


def _protocol_stdout() -> Any:
    """The real stdout for answers; fd 1 (and ``sys.stdout``) then point at stderr, for libraries' prints."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return answers


def _same_bytes(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if not torch.equal(got.view(torch.uint8), expected.view(torch.uint8)):
        raise AssertionError(f"{what}: the bytes differ from the payload's")


class Runner:
    """Times and checks one driver's calls."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.tags = (f"p{i}" for i in itertools.count())

    def get(self, kind: str) -> float:
        """One checked Get; its milliseconds."""
        driver = self.driver
        driver.dst[kind].zero_()
        start = time.perf_counter()
        answer = driver.get(kind)
        ms = (time.perf_counter() - start) * 1e3
        driver.check("get", kind, answer)
        _same_bytes(driver.dst[kind], driver.payload.expected[kind], f"get {kind}")
        return ms

    def put(self, kind: str) -> float:
        """One checked Put under fresh keys, read back and deleted after; its milliseconds."""
        driver, tag = self.driver, next(self.tags)
        start = time.perf_counter()
        answer = driver.put(kind, tag)
        ms = (time.perf_counter() - start) * 1e3
        driver.check("put", kind, answer)
        driver.scratch[kind].zero_()
        driver.read_back(kind, tag)
        _same_bytes(driver.scratch[kind], driver.payload.expected[kind], f"put {kind} read back")
        driver.remove(kind, tag)
        return ms

    def op(self, name: str) -> Callable[[str], float]:
        """The timed call named ``name`` (``get`` or ``put``)."""
        if name not in self.driver.ops:
            raise ValueError(f"{type(self.driver).__name__} has no {name!r}")
        return {"get": self.get, "put": self.put}[name]

    def loop(self, kind: str, count: int) -> dict[str, float]:
        """``count`` Gets back to back (the first and the last checked); start and end times."""
        self.get(kind)
        start = time.perf_counter()
        for _ in range(count):
            self.driver.get(kind)
        end = time.perf_counter()
        self.get(kind)
        return {"start": start, "end": end}

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        """One command's answer."""
        cmd = command["cmd"]
        if cmd == "op":
            return {"ms": self.op(command["op"])(command["kind"])}
        if cmd == "series":
            call = self.op(command["op"])
            return {"ms": [call(command["kind"]) for _ in range(int(command["count"]))]}
        if cmd == "loop":
            return self.loop(command["kind"], int(command["count"]))
        if cmd == "copy_gib":
            return self.driver.copy_gib()  # type: ignore[attr-defined]
        raise ValueError(f"unknown command {cmd!r}")


def main() -> int:
    """Build the driver, say ready, answer commands until ``quit`` or end of input."""
    answers = _protocol_stdout()
    torch.set_num_threads(1)  # every copy a worker makes is single-threaded, as the copy_ baseline
    spec, payload_path, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

    def say(message: dict[str, Any]) -> None:
        answers.write(json.dumps(message) + "\n")

    try:
        module_name, class_name = spec.split(":")
        driver_class = getattr(importlib.import_module(module_name), class_name)
        driver = driver_class(Payload(payload_path), settings)
        driver.setup()
        runner = Runner(driver)
        for kind in KINDS:  # one checked Get of each payload before the first timed call
            if "get" in driver.ops:
                runner.get(kind)
        say({"ready": True, "versions": driver.versions(), "info": driver.info()})
    except Exception:
        say({"error": traceback.format_exc()})
        return 1
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "quit":
            break
        try:
            say(runner.handle(command))
        except Exception:
            say({"error": traceback.format_exc()})
    try:
        say({"info": driver.info()})
    finally:
        driver.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
