"""LMCache's in-process store (``LocalCPUBackend``) as a peer of ``bench_embedded.py``: a worker in LMCache's own venv.

``bench_embedded.py`` starts this script with the python of a venv that has
``lmcache==0.5.6`` (and CPU torch 2.13.0) and drives it one operation at a time
over its stdin and stdout (one JSON object a line), so that LMCache's steps
interleave with kvstore's and ``Tensor.copy_``'s in the same run. Nothing of
kvstore is imported here (it is not installed in that venv).

The operations, on the same payloads as the kvstore side (the same seed, the
same dtype and shapes, so the same bytes) and into the same destination (a
preallocated tensor this process owns):

* ``put``: ``batched_allocate`` one ``MemoryObj`` per chunk (a block: ``[2, num_layers, chunk_size,
  num_kv_heads * head_dim]`` of LMCache's ``KV_2LTD``), copy each block into its object, ``batched_submit_put_task``,
  and give back this caller's reference (``ref_count_down``), as LMCache's storage manager does;
* ``get``: ``get_blocking`` each key (its stored object, referenced), copy it into its row of the destination
  tensor, ``ref_count_down``;
* ``copy``: one ``Tensor.copy_`` of the payload's bytes in this process (a check on the baseline).

Before each operation an untimed 1 MiB ``copy_`` wakes torch's threads (asleep while this process waited on
the pipe; ``bench_embedded.py`` does the same before each of its own steps). Each reply gives the seconds the
operation took, timed in this process; a ``get`` also says whether the bytes
are the ones put (checked after the timing). ``remove`` drops a round's keys (untimed).

Protocol: ``{"op": "setup", "layers": L, "kv_heads": H, "head_dim": D, "tokens": T, "num_blocks": N,
"seed": S, "dtype": "float16", "threads": N}`` once (``threads``: torch's threads, optional) (reply ``{"ok": true, "version": ...}``), then ``{"op": "put" | "get" |
"copy" | "remove", "round": R}``; ``{"op": "exit"}`` ends it.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def main() -> None:
    import lmcache
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    state: dict = {}

    def reply(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        if op == "exit":
            break
        if op == "setup":
            layers, heads, dim, tokens, num_blocks = (msg[k] for k in ("layers", "kv_heads", "head_dim", "tokens",
                                                                       "num_blocks"))
            dtype = getattr(torch, msg["dtype"])
            if msg.get("threads"):
                torch.set_num_threads(msg["threads"])
            torch.manual_seed(msg["seed"])
            # kvstore's block layout [layers, 2, heads, tokens, dim] is the payload; LMCache's KV_2LTD object is
            # [2, layers, tokens, heads * dim] of the same bytes count: each block is copied in as raw bytes
            source = torch.randn(num_blocks, layers, 2, heads, tokens, dim).to(dtype)
            block_bytes = source[0].numel() * source.element_size()
            capacity_gb = max(2.0, 4 * num_blocks * block_bytes / 1e9)
            config = LMCacheEngineConfig.from_defaults(chunk_size=tokens, local_cpu=True,
                                                       max_local_cpu_size=capacity_gb)
            metadata = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0,
                                       local_worker_id=0, kv_dtype=dtype,
                                       kv_shape=(layers, 2, tokens, heads, dim), chunk_size=tokens)
            backend = LocalCPUBackend(config, metadata, dst_device="cpu")
            shape = torch.Size([2, layers, tokens, heads * dim])
            state.update(backend=backend, source=source, rows=[b.view(-1).view(torch.uint8) for b in source],
                         destination=torch.empty_like(source), shape=shape, dtype=dtype,
                         flat_source=source.view(-1).view(torch.uint8).clone(), fmt=MemoryFormat.KV_2LTD,
                         key=lambda r, i: CacheEngineKey("bench", 1, 0, r * 100_000 + i, dtype))
            state["flat_destination"] = torch.empty_like(state["flat_source"])
            state["spare"] = (torch.ones(1 << 20, dtype=torch.uint8), torch.empty(1 << 20, dtype=torch.uint8))
            state["destination_rows"] = [b.view(-1).view(torch.uint8) for b in state["destination"]]
            reply({"ok": True, "version": getattr(lmcache, "__version__", "?"), "block_bytes": block_bytes})
            continue
        backend, rows, n = state["backend"], state["rows"], len(state["rows"])
        state["spare"][1].copy_(state["spare"][0])  # untimed: wakes torch's threads, asleep while the pipe waited
        keys = [state["key"](msg.get("round", 0), i) for i in range(n)]
        if op == "put":
            started = time.perf_counter()
            objs = backend.batched_allocate(state["shape"], state["dtype"], n, state["fmt"])
            for obj, row in zip(objs, rows):
                obj.tensor.view(-1).view(torch.uint8).copy_(row)
            backend.batched_submit_put_task(keys, objs)
            for obj in objs:
                obj.ref_count_down()
            reply({"s": time.perf_counter() - started})
        elif op == "get":
            state["destination"].zero_()
            started = time.perf_counter()
            found = 0
            for key, out in zip(keys, state["destination_rows"]):
                obj = backend.get_blocking(key)
                if obj is None:
                    break
                out.copy_(obj.tensor.view(-1).view(torch.uint8))
                obj.ref_count_down()
                found += 1
            elapsed = time.perf_counter() - started
            ok = found == n and torch.equal(state["destination"], state["source"])
            reply({"s": elapsed, "ok": bool(ok)})
        elif op == "copy":
            started = time.perf_counter()
            state["flat_destination"].copy_(state["flat_source"])
            reply({"s": time.perf_counter() - started})
        elif op == "remove":
            for key in keys:
                backend.remove(key)
            reply({"ok": True})
        else:
            reply({"error": f"unknown op {op!r}"})
    if "backend" in state:
        state["backend"].close()


if __name__ == "__main__":
    main()
