"""A node whose disk goes bad under one block stays up for a client of several nodes (issue 18, finding 3)."""

from __future__ import annotations

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.keys import block_key
from tests.support.server import kv_blocks, namespace
from tests.support.kvnode import KVNode
from tests.support.lmdb_pages import page_map


@pytest.mark.slow
def test_a_record_lmdb_cannot_delete_costs_its_prefix_not_the_node(tmp_path) -> None:
    """Regression: after 64 KiB of a node's data.mdb were zeroed, a Get of a block there failed with
    UNAVAILABLE ('mdb_del: MDB_CORRUPTED'), the client marked the whole node down, and it missed every block the
    node still held intact."""
    nodes = [KVNode(memory_capacity="0", disk_path=tmp_path / f"lmdb{i}", disk_capacity="64MiB") for i in range(2)]
    try:
        for node in nodes:
            node.start()
        ns = namespace()
        with KVStoreClient([node.target for node in nodes], timeout_s=30, retries=0) as kv:
            first_token = 0
            # a prefix whose blocks both nodes own past its fifth, the fifth and at least 6 after it on node 0: the
            # 64 KiB zeroed below cover node 0's records of the fifth block and of the next 3 (20 KiB each, laid
            # out in order), so some of node 0's later blocks stay intact whatever the router (its ports) decides
            while True:
                hashes, tensors = kv_blocks(ns, 16, first_token=first_token)
                owners = [kv.router.owner(h) for h in hashes]
                if (owners[4] == nodes[0].target and owners[5:].count(nodes[0].target) >= 6
                        and nodes[1].target in owners[5:]):
                    break
                first_token += 1
            assert kv.put(ns, hashes, tensors) == 16
            victim = next(i for i in range(4, 16) if kv.router.owner(hashes[i]) == nodes[0].target)
            data_file = tmp_path / "lmdb0" / "data.mdb"
            layout = page_map(data_file)
            record = layout.records[b"blocks"][block_key(ns, hashes[victim])]
            with open(data_file, "r+b") as data:  # while the node runs
                data.seek(record.overflow.start * layout.page_bytes)
                data.write(bytes(64 * 1024))
            zeroed = set(range(record.overflow.start, record.overflow.start + 16))
            mine = {h for h in hashes if kv.router.owner(h) == nodes[0].target}
            hit = [h in mine and layout.hit(b"blocks", block_key(ns, h), zeroed) for h in hashes]
            assert hit[victim] and not any(hit[:victim])

            got = kv.get_tensors(ns, hashes)  # observed: UnavailableError, then the node marked down
            assert len(got) == victim and all(torch.equal(a, b) for a, b in zip(got, tensors))
            assert all(status.up for status in kv.nodes())
            assert kv.lookup(ns, hashes).num_blocks == victim  # the node forgot the block
            rest = [i for i in range(victim + 1, 16) if not hit[i]]
            for i in rest:  # every block the node still holds intact is served
                [block] = kv.get_tensors(ns, hashes[i:i + 1])
                assert torch.equal(block, tensors[i])
            assert any(hashes[i] in mine for i in rest)
            assert all(status.up for status in kv.nodes())
            assert kv.health() == "SERVING"
    finally:
        for node in nodes:
            node.close()
