"""Hit ratio at the same bytes, raw against int8 and int4 (issue 28): the node's replay model (``kvstore
simulate``) on the bundled conversation trace and the three synthetic agentic workloads of ``bench_sim``.

A block's exact size is that of Llama-3.1-8B in bf16 (32 layers, 8 KV heads of
128 channels: 128 KiB per token); each encoding's block takes the bytes
``kvstore simulate --kv-encoding`` gives it (``kvstore.tools.sim.cli.encoded_block_bytes``), so a byte
capacity holds more of its blocks. Capacities are the raw blocks that fit, as
a fraction of the trace's distinct blocks (1 %, 5 %); the policy is LRU (fast enough to replay every
trace in about a minute here).

    python benchmarks/bench_encoding_capacity.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_sim import AGENTIC  # noqa: E402
from kvstore.tools.sim import simulate  # noqa: E402
from kvstore.tools.sim.agentic import generate_agentic  # noqa: E402
from kvstore.tools.sim.cli import encoded_block_bytes  # noqa: E402
from kvstore.tools.trace import read_trace  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # Llama-3.1-8B, bf16
FRACTIONS = (0.01, 0.05)
ENCODINGS = ("", "int8", "int4")


def main() -> None:
    traces = {"conversation": (read_trace(ROOT / "benchmarks" / "traces" / "mooncake_conversation_trace.jsonl"), 512)}
    for name, config in AGENTIC.items():
        traces[name] = (generate_agentic(config), config.block_tokens)
    rows = []
    for name, (requests, block_tokens) in traces.items():
        unique = len({key for r in requests for key in r.block_ids})
        exact = 128 + block_tokens * BYTES_PER_TOKEN
        for fraction in FRACTIONS:
            capacity_bytes = max(1, int(unique * fraction)) * exact
            row = {"trace": name, "block_tokens": block_tokens, "fraction": fraction,
                   "capacity_gib": capacity_bytes / 2**30}
            for encoding in ENCODINGS:
                block_bytes = encoded_block_bytes(exact, encoding, block_tokens)
                result = simulate(requests, "lru", capacity_bytes // block_bytes, block_tokens=block_tokens)
                row[encoding or "raw"] = result.hit_ratio
                row[f"{encoding or 'raw'}_blocks"] = capacity_bytes // block_bytes
            rows.append(row)
            print(row, flush=True)
    load = os.getloadavg()[0]
    command = "python benchmarks/bench_encoding_capacity.py"
    lines = ["# Hit ratio at the same bytes: raw, int8, int4", "",
             f"`{command}` (load {load:.2f}); policy: LRU; blocks of Llama-3.1-8B in bf16 "
             "(128 KiB per token), capacity in bytes = the raw blocks of that fraction of the distinct blocks.", "",
             "| trace | tokens per block | capacity | GiB | raw | int8 | int4 | int8 / raw | int4 / raw |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['trace']} | {r['block_tokens']} | {r['fraction']:.0%} | {r['capacity_gib']:.1f} | "
                     f"{r['raw']:.4f} | {r['int8']:.4f} | {r['int4']:.4f} | "
                     f"{r['int8'] / max(r['raw'], 1e-9):.2f}× | {r['int4'] / max(r['raw'], 1e-9):.2f}× |")
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_encoding_capacity.md").write_text(text)
    (RESULTS / "bench_encoding_capacity.json").write_text(json.dumps({"command": command, "load": load,
                                                                      "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
