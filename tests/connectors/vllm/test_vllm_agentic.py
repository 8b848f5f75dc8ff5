"""Agentic sessions through a real vLLM engine: ``kv_transfer_params`` carry a session id and a TTL to the node.

The engine's connector reads ``{"kvstore": {"session_id": ..., "ttl_s": ...}}`` from each request, sends them
with its lookup, its loads and its saves, and names the vLLM request id in its lookups, so that ``kvstore
explain --request-id`` tells why a request missed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from kvstore.client import KVStoreClient
from tests.connectors.vllm.harness import Engine, deltas, tokens
from tests.support.kvnode import KVNode

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TURN = tokens(200, 81)  # 6 full blocks of 32 and 8 tokens


def test_a_session_and_its_ttl_reach_the_node_and_explain_names_the_request(models: dict[str, Any]) -> None:
    with KVNode(memory_capacity="256MiB", extra_args=("--policy", "session")) as node, \
            Engine(models["llama"], kv_role="kv_both", extra={"target": node.target}) as engine, \
            KVStoreClient(node.target, timeout_s=10) as client:
        first = engine.call("generate", prompts=[{"tokens": TURN, "session_id": "agent-7", "ttl_s": "5m"}],
                            max_tokens=16, tag="turn1")
        engine.drain()
        stats = client.stats()
        assert stats.counters["pinned_bytes"] > 0  # the saved blocks carry the TTL
        assert stats.counters["sessions"] == 1 and stats.counters["ttl_clamped"] == 0
        before = engine.metrics()
        second = engine.call("generate", prompts=[{"tokens": TURN, "session_id": "agent-7", "ttl_s": 300}],
                             max_tokens=16, tag="turn2")
        assert second == first  # loaded from the node, and the same tokens
        assert deltas(before, engine.metrics(), "hit_blocks")["hit_blocks"] == 6
        explained = subprocess.run([sys.executable, "-m", "kvstore.cli", "explain", "--target", node.target,
                                    "--request-id", "turn1-0", "--json"], capture_output=True, text=True,
                                   timeout=60, check=True)
        blocks = json.loads(explained.stdout)["blocks"]
        assert len(blocks) == 6 and all(b["hit"] for b in blocks)  # turn 1's blocks: all cached now
        assert client.stats().missed_blocks["never_stored"] >= 6  # turn 1 missed them: never stored until then
