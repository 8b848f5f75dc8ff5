"""A client of several nodes sends its auth metadata to every node, and an auth failure raises instead of a miss."""

from __future__ import annotations

from typing import Iterator

import pytest

from kvstore.client import KVStoreClient
from kvstore.security import bearer_metadata
from kvstore.error_codes import RemoteError
from tests.support.security import TOKEN_A, auth_config, sha_namespace
from tests.support.server import ThreadedServer, kv_blocks

pytestmark = pytest.mark.slow  # starts processes or servers: outside `make test-fast`


@pytest.fixture(scope="module")
def auth_pair() -> Iterator[list[ThreadedServer]]:
    """Two in-process nodes that require bearer tokens."""
    servers = [ThreadedServer(auth_config()), ThreadedServer(auth_config())]
    yield servers
    for server in servers:
        server.stop()


def test_every_node_gets_the_token(auth_pair: list[ThreadedServer]) -> None:
    ns = sha_namespace("tenant-a")
    hashes, tensors = kv_blocks(ns, 32)
    targets = [server.target for server in auth_pair]
    with KVStoreClient(targets, timeout_s=30, metadata=bearer_metadata(TOKEN_A)) as kv:
        assert len({kv.router.owner(h) for h in hashes}) == 2  # both nodes are called (all on one: p = 2^-31)
        assert kv.put(ns, hashes, tensors) == 32
        assert kv.lookup(ns, hashes).num_blocks == 32
        assert len(kv.node_stats()) == 2


def test_a_missing_token_raises_and_marks_no_node_down(auth_pair: list[ThreadedServer]) -> None:
    ns = sha_namespace("tenant-a")
    hashes, _ = kv_blocks(ns, 12)
    with KVStoreClient([server.target for server in auth_pair], timeout_s=30) as kv:
        with pytest.raises(RemoteError):
            kv.lookup(ns, hashes)
        assert all(status.up for status in kv.nodes())
