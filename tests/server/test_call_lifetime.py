"""A call's objects are freed when it ends: nothing of it is left for the cycle collector."""

from __future__ import annotations

import pytest

import gc
import threading

import torch

from kvstore.client import KVStoreClient
from kvstore.blocks.tensors import encode_block
from kvstore.server.call import GrpcCall
from kvstore.wire import namespace_to_pb
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

from tests.support.server import MiB, ThreadedServer, kv_blocks, make_config, namespace
from tests.support.waiting import wait_until


_GRPC_SERVICER_CONTEXT = "grpc._cython.cygrpc._ServicerContext"
"""grpc.aio's servicer context: one per call (what a reference cycle through a call's callbacks kept alive)."""


def _live(cls: type | str) -> int:
    """Objects of ``cls`` (a type, or the qualified name of one: grpc.aio's own servicer context, a type of its
    private Cython module, named rather than imported) alive, but for those of same-host sessions' Attach calls
    (they live as long as their clients: the client's session is open)."""
    objects = gc.get_objects()
    sessions = [o for o in objects if type(o) is GrpcCall and o.method == "Attach"]
    ignored = {id(o) for o in sessions} | {id(o.context) for o in sessions}
    return sum(1 for o in objects if _is(o, cls) and id(o) not in ignored)


def _is(obj: object, cls: type | str) -> bool:
    kind = type(obj)
    return kind is cls if isinstance(cls, type) else f"{kind.__module__}.{kind.__qualname__}" == cls


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
            assert _live(_GRPC_SERVICER_CONTEXT) == 0
        finally:
            gc.enable()
