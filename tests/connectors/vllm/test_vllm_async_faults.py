"""Asynchronous loads under faults in a real vLLM engine: loads that time out, fail or are aborted mid-flight.

One ``kv_both`` engine with ``load_async`` against one ``kvstore serve`` node
of this module. Each test's reference comes from the same engine with
``{"load": false}``: it computes every prompt (no block from the store takes
part) and saves the blocks the test then hits, so it is the producer's output.

"In flight" is made deterministic with the engine's ``hold_loads`` pauses
(``Engine.generate_holding_loads``): the node is frozen (SIGSTOP) after the
scheduler planned the step's loads and before any worker starts them, so every
load of that step is still in flight when the test acts (kills the node, lets
the timeout pass, aborts the requests). Leaks are counted after: vLLM's free
KV blocks, the connector's per-request state and loads, and the node's
same-host sessions, leases and segments.
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
from typing import Any, Iterator

import pytest

from tests.connectors.vllm.harness import Engine, deltas, tokens
from tests.support.kvnode import KVNode
from tests.support.shm import open_segments
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

TIMEOUT_S = 3.0
"""The connector's ``timeout_s``: a load not begun writing by then is given up (the frozen-node test waits it out)."""
COUNTS = ("hit_blocks", "loaded_blocks", "load_failed_blocks", "lookup_errors")
LENGTHS = [200, 130, 260]
"""Prompt lengths of each test's hits: 6, 4 and 8 loadable blocks."""
NUM_BLOCKS = 6 + 4 + 8
SHM_LEVELS = ("sessions", "leases", "leased_bytes")


def shm_counts(node: KVNode) -> dict[str, float]:
    """The node's ``kvstore_shm_*`` gauges (``sessions``, ``leases``, ``leased_bytes``, ...), by name."""
    text = urllib.request.urlopen(node.metrics_url, timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for line in text.splitlines()
            if (m := re.match(r"^kvstore_shm_(\w+) (\S+)$", line))}


@pytest.fixture(scope="module")
def node() -> Iterator[KVNode]:
    with KVNode(memory_capacity="256MiB") as started:
        yield started


@pytest.fixture(scope="module")
def engine(node: KVNode, models: dict[str, Any]) -> Iterator[Engine]:
    extra = {"target": node.target, "load_async": True, "timeout_s": TIMEOUT_S, "down_backoff_s": 0.2}
    with Engine(models["llama"], extra=extra, max_num_seqs=4) as started:
        yield started


def _prompts(seed: int) -> list[list[int]]:
    return [tokens(n, seed + i) for i, n in enumerate(LENGTHS)]


def _saved(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """The prompts computed with no load (the reference), their blocks saved into the node."""
    reference = engine.generate([{"tokens": p, "load": False} for p in prompts])
    engine.drain()
    return reference


def _baseline(engine: Engine, node: KVNode, prompts: list[list[int]], reference: list[list[int]]
              ) -> tuple[int, dict[str, float], int]:
    """vLLM's free KV blocks, the node's same-host counts and its segments, once the prompts hit (so the
    scheduler's and the worker's clients have both attached their sessions)."""
    assert engine.generate(prompts) == reference
    free_blocks = engine.settle()["free_blocks"]
    return free_blocks, shm_counts(node), len(open_segments(node.pid))


def _assert_shm_back(node: KVNode, before: dict[str, float], num_segments: int) -> None:
    """The node's same-host sessions, leases and leased bytes are back to what they were (a late reply's lease is
    released, a session the client retired after an unclear call has ended), two segments per session."""
    seen: list[dict[str, float]] = []

    def back() -> bool:
        seen.append(shm_counts(node))
        return all(seen[-1][k] == before[k] for k in SHM_LEVELS)

    try:
        wait_until(back, 90, "the node's same-host sessions and leases back to what they were")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: before {before}, now {seen[-1]}") from None
    assert len(open_segments(node.pid)) == num_segments == 2 * before["sessions"]


def _freeze(node: KVNode) -> int:
    assert node.pid is not None
    os.kill(node.pid, signal.SIGSTOP)  # answers nothing, closes nothing: every load started now stays in flight
    return node.pid


def _all_in_flight(engine: Engine) -> None:
    """At the ``loading`` pause: the step's three loads are in flight on the (one) worker, none writing."""
    (worker,) = engine.state()["workers"]
    assert worker["loads"] == len(LENGTHS) and worker["writing"] == 0, worker


def _assert_nothing_held(engine: Engine, free_blocks: int) -> None:
    state = engine.settle()
    assert state["free_blocks"] == free_blocks, state
    assert (state["requests"], state["connector_requests"], state["finish_saves"]) == (0, 0, 0), state
    assert state["workers"] == [{"loads": 0, "writing": 0, "failed_blocks": 0}], state


def _hits_again(engine: Engine, prompts: list[list[int]], reference: list[list[int]],
                timeout_s: float = 120.0) -> None:
    """Serve the prompts until every block loads from the node again (the connector's short backoff ends)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = engine.metrics()
        assert engine.generate(prompts) == reference
        grew = deltas(before, engine.metrics(), *COUNTS)
        if grew["loaded_blocks"] == NUM_BLOCKS and grew["load_failed_blocks"] == 0:
            return
        engine.drain()
    pytest.fail("the connector did not load every block from the node again")


def test_loads_frozen_past_the_timeout_are_recomputed_and_never_written(engine: Engine, node: KVNode) -> None:
    """Every load of a step is in flight on a frozen node: each is given up at its deadline and recomputed.

    The requests finish while the node is still frozen, so their loads were
    given up (nothing could have been fetched); their late replies, once the
    node thaws, give their leases back and write nothing.
    """
    prompts = _prompts(600)
    reference = _saved(engine, prompts)
    free_blocks, shm_before, num_segments = _baseline(engine, node, prompts, reference)
    before = engine.metrics()
    frozen: list[int] = []
    try:
        outputs = engine.generate_holding_loads(prompts, on_loads=lambda: frozen.append(_freeze(node)),
                                                on_loading=lambda: _all_in_flight(engine))
        grew = deltas(before, engine.metrics(), *COUNTS)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    assert outputs == reference
    # (vLLM looks a request up again after its load failed: on the frozen node that is a lookup error, a miss)
    assert (grew["hit_blocks"], grew["loaded_blocks"], grew["load_failed_blocks"]) == (NUM_BLOCKS, 0, NUM_BLOCKS)
    _assert_nothing_held(engine, free_blocks)
    _assert_shm_back(node, shm_before, num_segments)
    _hits_again(engine, prompts, reference)


def test_a_request_aborted_while_its_load_is_in_flight_frees_everything(engine: Engine, node: KVNode) -> None:
    """Hits aborted while their loads hang on a frozen node: vLLM keeps their blocks until the loads end, then
    every block, request, load, lease and segment is back to what it was, and the same prompts hit again."""
    prompts = _prompts(700)
    reference = _saved(engine, prompts)
    free_blocks, shm_before, num_segments = _baseline(engine, node, prompts, reference)
    frozen: list[int] = []
    held: dict[str, Any] = {}

    def abort() -> dict[str, Any]:
        _all_in_flight(engine)
        held.update(engine.state())
        return {"abort": True}

    try:
        outputs = engine.generate_holding_loads(prompts, on_loads=lambda: frozen.append(_freeze(node)),
                                                on_loading=abort)
        assert outputs == [None] * len(prompts)
        assert held["free_blocks"] < free_blocks  # the hits' blocks were allocated for their loads
        # vLLM keeps the aborted requests (and their blocks) until the worker reports their loads ended
        state = engine.state()
        assert state["requests"] == len(prompts) and state["free_blocks"] == held["free_blocks"], state
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    _assert_nothing_held(engine, free_blocks)
    _assert_shm_back(node, shm_before, num_segments)
    _hits_again(engine, prompts, reference)
    _assert_nothing_held(engine, free_blocks)


def test_the_node_killed_while_loads_are_in_flight(engine: Engine, node: KVNode) -> None:
    """The node dies (SIGKILL, while frozen) with every load of a step in flight: each fails, is recomputed,
    the outputs are exact, the engine keeps serving, and a restarted node gives hits again."""
    prompts = _prompts(800)
    reference = _saved(engine, prompts)
    free_blocks = engine.settle()["free_blocks"]
    before = engine.metrics()

    def kill() -> None:
        _all_in_flight(engine)
        node.kill()

    try:
        outputs = engine.generate_holding_loads(prompts, on_loads=lambda: _freeze(node), on_loading=kill)
    finally:
        node.kill()  # no-op once killed; never leave a stopped node behind
    assert outputs == reference
    grew = deltas(before, engine.metrics(), *COUNTS)
    assert grew["hit_blocks"] == NUM_BLOCKS and grew["loaded_blocks"] == 0
    assert grew["load_failed_blocks"] == NUM_BLOCKS
    _assert_nothing_held(engine, free_blocks)
    node.start()  # an empty node on the same port
    assert _saved(engine, prompts) == reference
    _hits_again(engine, prompts, reference)
