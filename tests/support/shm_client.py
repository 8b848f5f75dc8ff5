"""A same-host client in a process of its own, for the tests that kill it: ``python -m tests.support.shm_client``.

Usage: ``python -m tests.support.shm_client TARGET MODE`` where MODE is

* ``read``:  put 4 blocks, hold them under a read lease, print ``HOLDING <session id hex>``, then wait on stdin;
* ``write``: put batches through the put segment for ever, printing ``WRITING <session id hex>`` after the first.

The test kills it (SIGKILL) while it holds or writes.
"""

from __future__ import annotations

import sys

import torch

from kvstore.client import KVStoreClient
from kvstore.keys import Namespace, hash_blocks

NAMESPACE = Namespace(model="shm-client-process", dtype="float16", block_size=16)


def blocks(first_token: int, num_blocks: int) -> tuple[list[bytes], list[torch.Tensor]]:
    """``num_blocks`` blocks of 64 KiB, each filled with its index (so a test can check what it reads)."""
    hashes = hash_blocks(NAMESPACE, list(range(first_token, first_token + 16 * num_blocks)))
    return hashes, [torch.full((2, 2, 2, 16, 256), (first_token // 16 + i) % 1000, dtype=torch.float16)
                    for i in range(num_blocks)]


def main(target: str, mode: str) -> None:
    with KVStoreClient(target, retries=0) as client:
        hashes, tensors = blocks(0, 4)
        client.put(NAMESPACE, hashes, tensors)
        session = client._links[0].current()
        assert session is not None, client.shared_memory()
        if mode == "read":
            lease = client.read(NAMESPACE, hashes)
            assert len(lease.blocks) == 4
            print(f"HOLDING {session.session_id:x}", flush=True)
            sys.stdin.read()
            return
        first = 64
        while True:
            hashes, tensors = blocks(first, 64)  # 4 MiB a put
            client.put(NAMESPACE, hashes, tensors)
            if first == 64:
                print(f"WRITING {session.session_id:x}", flush=True)
            first += 64 * 16


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
