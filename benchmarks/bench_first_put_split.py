"""A first same-host Put split into its parts: the gRPC channel's connect, the session's attach, and the put.

Each trial is a fresh process: a Lookup first (it opens the client's channel), then the link's attach on its
own (``Capabilities``, ``Attach``, the handoff, the two mappings), then three Puts of 8 blocks of 256 KiB.
``bench_first_call.py`` times "put 1" with all three parts in it (5.9x put 2); this tells them apart.

    .venv/bin/python benchmarks/bench_first_put_split.py   # ~15 s, prints medians of 5 trials
"""
import json, os, statistics, subprocess, sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parent.parent)
sys.path.insert(0, REPO)
from tests.support.kvnode import KVNode
CHILD = r'''
import json, sys, time
sys.path.insert(0, REPO)
from kvstore.client import KVStoreClient
from kvstore.keys import Namespace, hash_blocks
from kvstore.blocks.tensors import encode_header
shape = (8, 2, 8, 16, 64)
payload = bytes(2 * 8 * 2 * 8 * 16 * 64)
blocks = [encode_header("float16", "kv", shape, payload) + payload for _ in range(8)]
ns = Namespace(model="fp/" + sys.argv[2], dtype="float16", block_size=16)
client = KVStoreClient(sys.argv[1], timeout_s=30)
t = {}
s = time.perf_counter(); client.lookup(ns, hash_blocks(ns, list(range(16)))); t["lookup 1 (channel)"] = time.perf_counter() - s
s = time.perf_counter(); client._links[0].ensure(); t["attach"] = time.perf_counter() - s
for i, name in enumerate(("put 1", "put 2", "put 3")):
    h = hash_blocks(ns, list(range(1000 * (i + 1), 1000 * (i + 1) + 128)))
    s = time.perf_counter(); client.put(ns, h, blocks); t[name] = time.perf_counter() - s
print(json.dumps(t)); client.close()
'''
rows = []
with KVNode(memory_capacity="256MiB", metrics=False) as node:
    for trial in range(5):
        out = subprocess.run([sys.executable, "-c", CHILD.replace("REPO", repr(REPO)), node.target, str(trial)], capture_output=True, text=True, timeout=120)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
print("load", os.getloadavg())
for k in rows[0]:
    print(f"{k}: median {statistics.median(r[k] for r in rows) * 1e3:.2f} ms")
