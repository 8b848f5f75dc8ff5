"""A call's objects are freed when it ends: nothing of it is left for the cycle collector."""

from __future__ import annotations

import pytest

import gc
import threading

import grpc
import grpc._cython.cygrpc
import torch

from kvstore.client import KVStoreClient
from kvstore.codec import encode_block
from kvstore.server.servicer import GrpcCall
from kvstore.wire import namespace_to_pb
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

from tests.support.server import MiB, ThreadedServer, kv_blocks, make_config, namespace
from tests.support.waiting import wait_until


def _live(cls: type) -> int:
    """Objects of ``cls`` alive, but for those of same-host sessions' Attach calls (they live as long as their
    clients: the client's session is open)."""
    objects = gc.get_objects()
    sessions = [o for o in objects if type(o) is GrpcCall and o.method == "Attach"]
    ignored = {id(o) for o in sessions} | {id(o.context) for o in sessions}
    return sum(1 for o in objects if type(o) is cls and id(o) not in ignored)


@pytest.mark.slow
def test_a_finished_call_leaves_no_reference_cycle(server: ThreadedServer) -> None:
    """context.add_done_callback keeps partial(_finish, context) in rpc_state.callbacks, which gRPC never clears:
    GrpcCall -> context -> rpc_state -> callbacks -> GrpcCall. Every call became cyclic garbage (was: freed at once)."""
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 2)
    with KVStoreClient(server.target, retries=0) as kv:
        kv.put(ns, hashes, tensors)
        gc.collect()
        gc.disable()
        try:
            for _ in range(50):
                kv.get(ns, hashes)
                kv.lookup(ns, hashes)
            wait_until(lambda: _live(GrpcCall) == 0, 30, "every call's end has run (a done callback, after the reply)")
            assert _live(grpc._cython.cygrpc._ServicerContext) == 0
        finally:
            gc.enable()
