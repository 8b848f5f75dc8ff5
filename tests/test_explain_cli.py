"""``kvstore explain`` against a real node: token lists, hash lists and request ids, in words and as JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstore.client import KVStoreClient
from kvstore.keys import Namespace, hash_blocks
from kvstore.wire import agentic_fields, decode_hash_request, encode_get_request
from kvstore.v1 import kvstore_pb2 as pb
from tests.support.kvnode import KVNode

pytestmark = pytest.mark.slow  # starts a node

NS = Namespace(model="explain-model", block_size=4)
TOKENS = list(range(100, 140))  # 10 blocks


def _explain(node: KVNode, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", "explain", "--target", node.target, *args],
                          capture_output=True, text=True, timeout=60, check=False)


def test_explain_by_tokens_hashes_and_request_id() -> None:
    import torch

    hashes = hash_blocks(NS, TOKENS)
    blocks = [torch.full((2, 2, 1, 4, 8), float(i), dtype=torch.float16) for i in range(len(hashes))]
    with KVNode(metrics=False) as node, KVStoreClient(node.target, timeout_s=10) as client:
        client.put(NS, hashes[:6], blocks[:6], session_id="agent-1", ttl_s=60)
        client.delete(NS, hashes[2:3])
        assert client.lookup(NS, hashes, session_id="agent-1", request_id="req-7").num_blocks == 2
        namespace = ["--model", NS.model, "--block-size", "4"]
        out = _explain(node, *namespace, "--tokens", ",".join(map(str, TOKENS)))
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == "10 blocks: 2 hit, 8 missed"
        assert lines[1] == "  blocks 0-1 (2): hit in memory"
        assert lines[2].startswith("  block 2: deleted: deleted by a client")
        assert lines[3].startswith("  blocks 3-5 (3): after_miss [in memory]")
        assert lines[4].startswith("  blocks 6-9 (4): never_stored")
        by_id = json.loads(_explain(node, "--request-id", "req-7", "--json").stdout)
        assert [b["cause"] for b in by_id["blocks"]] == ["", "", "deleted", *["after_miss"] * 3, *["never_stored"] * 4]
        by_hash = json.loads(_explain(node, *namespace, "--hashes", ",".join(h.hex() for h in hashes[:3]),
                                      "--json").stdout)
        assert [b["hit"] for b in by_hash["blocks"]] == [True, True, False]
        changed = _explain(node, *namespace, "--revision", "v2", "--tokens", ",".join(map(str, TOKENS)))
        assert "other_namespace" in changed.stdout and "differs in revision" in changed.stdout
        assert "the same tokens under it: 2 of 10 blocks cached" in changed.stdout
        assert _explain(node, "--request-id", "nobody").returncode == 1
        assert _explain(node, "--tokens", "1,2").returncode == 2  # no --model
        stats = client.stats()
        assert stats.missed_blocks["deleted"] == 1 and stats.counters["pinned_bytes"] > 0


def test_the_agentic_fields_are_read_without_protobuf_before_or_after_the_hashes() -> None:
    hashes = hash_blocks(NS, TOKENS)
    for count in (3, 10):  # hand-coded, and through protobuf
        request = decode_hash_request(pb.GetRequest, encode_get_request(NS, hashes[:count], "s", 12.5))
        assert (request.session_id, request.ttl_s, len(request.block_hashes)) == ("s", 12.5, count)
    late = pb.LookupRequest(block_hashes=hashes, agent_session_id="x", ttl_s=3.0, request_id="r").SerializeToString()
    assert decode_hash_request(pb.LookupRequest, late)[2:] == ("x", 3.0, "r")
    assert agentic_fields() == b""
