"""Load testing of running kvstore nodes by replaying request traces (``kvstore loadtest``).

``run_loadtest`` replays a trace (``kvstore.tools.trace``) against one or more nodes:
per request a Lookup of the longest cached prefix, a Get of it checked byte
for byte, and a Put of the rest, paced closed loop or open loop, and measures
hit ratios (overall, per tier, over time), throughput and latency percentiles.
``compare_with_simulator`` sets the hit ratio beside ``kvstore simulate``'s on
the same requests. ``kvstore.tools.loadtest.cli`` is the command; ``docs/loadtest.md``
describes it.
"""

from kvstore.tools.loadtest.blocks import PayloadFactory, loadtest_namespace, trace_block_hashes, trace_tokens
from kvstore.tools.loadtest.compare import compare_with_simulator
from kvstore.tools.loadtest.runner import (
    LoadTestConfig,
    LoadTestResult,
    client_target_keyword,
    open_client,
    replay_loadtest,
    run_loadtest,
)

__all__ = [
    "LoadTestConfig",
    "LoadTestResult",
    "PayloadFactory",
    "client_target_keyword",
    "compare_with_simulator",
    "loadtest_namespace",
    "open_client",
    "replay_loadtest",
    "run_loadtest",
    "trace_block_hashes",
    "trace_tokens",
]
