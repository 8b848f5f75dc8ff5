"""kvstore.serve_in_process: an embedded store served over gRPC from its own process, behind a fresh token."""

from __future__ import annotations

import pytest

import kvstore
from kvstore.client import KVStoreClient
from kvstore.errors import UnavailableError
from kvstore.error_codes import UnauthenticatedError
from kvstore.security import bearer_metadata
from tests.support.server import kv_blocks, namespace


@pytest.mark.slow
def test_a_served_store_is_the_same_store_and_needs_its_token() -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 3)
    with kvstore.open_store() as store:
        store.put(ns, hashes[:2], tensors[:2])  # put in-process
        with kvstore.serve_in_process(store) as served:
            assert served.target.startswith("127.0.0.1:") and not served.target.endswith(":0")
            with KVStoreClient(served.target, metadata=bearer_metadata(served.token), retries=0) as client:
                assert client.lookup(ns, hashes).num_blocks == 2  # what the process put, seen over gRPC
                client.put(ns, hashes[2:], tensors[2:])
            assert store.lookup(ns, hashes).num_blocks == 3  # and what gRPC put, seen in-process
            with KVStoreClient(served.target, metadata=bearer_metadata("not-the-token"), retries=0) as stranger:
                with pytest.raises(UnauthenticatedError):
                    stranger.lookup(ns, hashes)
        with KVStoreClient(served.target, timeout_s=1.0, retries=0, shared_memory=False, bulk=False) as late:
            with pytest.raises(UnavailableError):  # closed: nothing listens there any more
                late.lookup(ns, hashes)
        assert store.lookup(ns, hashes).num_blocks == 3  # closing the server left the store open
