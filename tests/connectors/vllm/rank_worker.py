"""One tensor-parallel rank's worker side in a process of its own, for ``test_tp_ranks.py``.

Run as ``python -m tests.connectors.vllm.rank_worker SPEC_JSON``: the spec names
the node, the rank, the model identity's ``tp_size``, and one job, a save or a
load (hashes in hex, vLLM block ids). The rank's paged cache is seeded by its
rank (a saver's shard differs on every rank); a loader starts from zeros. The
process prints one JSON line: the load errors, and the loaded units' bytes in hex.
"""

from __future__ import annotations

import json
import sys

import torch

from kvstore.connectors.vllm.config import parse_config
from kvstore.connectors.vllm.jobs import KVStoreConnectorMetadata, LoadJob, SaveJob, TenantKey
from kvstore.connectors.vllm.layout import KVFamily, PagedKV, PageFormat, canonical_view
from kvstore.connectors.vllm.namespaces import ModelIdentity
from kvstore.connectors.vllm.worker import WorkerSide, open_worker_store

NUM_UNITS, H, N, D, LAYERS = 16, 2, 32, 32, 2
FORMAT = PageFormat(backend="CPU_ATTN", family="split_tokens", interior="cpu_attn:isa=vec", num_layers=LAYERS,
                    num_kv_heads=H, head_size=D, unit_tokens=N, dtype="bfloat16", cache_dtype="auto")


def identity(tp_size: int) -> ModelIdentity:
    """The model identity every rank of the test engine shares."""
    return ModelIdentity(model_id="tp-test", revision="", config_digest="c", act_dtype="bfloat16", quantization="",
                         tp_size=tp_size, pp_size=1)


def shard(tp_rank: int) -> list[torch.Tensor]:
    """The caches a saving rank holds: ``[NUM_UNITS, H, N, 2D]`` per layer, seeded by the rank."""
    generator = torch.Generator().manual_seed(100 + tp_rank)
    return [torch.randn(NUM_UNITS, H, N, 2 * D, generator=generator).bfloat16() for _ in range(LAYERS)]


def main(spec: dict) -> None:
    rank = (0, spec["tp_rank"])
    caches = shard(spec["tp_rank"]) if spec["job"] == "save" else \
        [torch.zeros(NUM_UNITS, H, N, 2 * D, dtype=torch.bfloat16) for _ in range(LAYERS)]
    paged = PagedKV(FORMAT, [canonical_view(c, KVFamily.SPLIT_TOKENS, H, D, N) for c in caches], 1)
    config = parse_config({"target": spec["target"], "timeout_s": 30})
    client, _ = open_worker_store(config)
    worker = WorkerSide(config, identity(spec["tp_size"]), paged, rank, N, client)
    hashes = {rank: [bytes.fromhex(h) for h in spec["hashes"]]}
    try:
        if spec["job"] == "save":
            worker.save(KVStoreConnectorMetadata(saves=[SaveJob("s", TenantKey(), hashes, spec["block_ids"])]))
            assert worker.drain(60), "the saves did not reach the node"
            print(json.dumps({"saved": worker.take_stats().data["saved_blocks"]}))
            return
        worker.start_load(KVStoreConnectorMetadata(loads=[LoadJob("l", TenantKey(), 0, hashes, 0,
                                                                  spec["block_ids"])]))
        errors = sorted(worker.take_load_errors())
        loaded = [c[spec["block_ids"]].view(torch.uint8).numpy().tobytes().hex() for c in caches]
        print(json.dumps({"errors": errors, "layers": loaded}))
    finally:
        worker.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
