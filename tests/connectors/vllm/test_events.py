"""KV events with vLLM: the node's stream decodes with vLLM's own classes, and a real vLLM CPU engine with
``kv_events_config`` on publishes ``BlockStored`` with kvstore's medium for the blocks it saves, then
``BlockRemoved`` once the node clears their namespace (vLLM's ZMQ publisher on 127.0.0.1, vLLM's msgspec classes).
The connector is given only the node's ``target``: it finds the node's event stream in its ``Capabilities``."""

from __future__ import annotations

import socket
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from kvstore.client import KVStoreClient
from kvstore.connectors.vllm.events import MEDIUM_PREFIX
from tests.connectors.vllm.harness import BLOCK_SIZE, Engine, tokens, write_llama
from tests.support.kvnode import KVNode
from tests.support.server import ThreadedServer, encoded, kv_blocks, make_config, namespace
from tests.support.waiting import wait_until

VLLM_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Batches:
    """A SUB socket on a publisher; every batch decoded with vLLM's own ``KVEventBatch``."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.events: list[Any] = []

    def poll(self) -> list[Any]:
        while self.sock.poll(100):
            _topic, _seq, payload = self.sock.recv_multipart()
            self.events += VLLM_DECODER.decode(payload).events
        return self.events

    def close(self) -> None:
        self.sock.close()


def step_until(engine: Engine, condition: Any, what: Any, timeout_s: float = 90.0) -> None:
    """Run engine steps (a short prompt each) until ``condition()`` holds: vLLM takes the connector's events only
    in a step, and the node's report of a block reaches the connector a moment after the step that saved it."""
    seed = iter(range(1000, 10_000))

    def stepped() -> bool:
        if condition():
            return True
        engine.generate([tokens(8, next(seed))], max_tokens=1)
        return False

    try:
        wait_until(stepped, timeout_s, "")
    except AssertionError:
        raise AssertionError(f"not within {timeout_s} s: {what()}") from None


def test_vllms_decoder_reads_the_nodes_stream() -> None:
    server = ThreadedServer(make_config(**{"events.endpoint": "tcp://127.0.0.1:0"}))
    try:
        publisher = server.server.events.publisher  # type: ignore[union-attr]
        ns = namespace()
        hashes, tensors = kv_blocks(ns, 3)
        from kvstore.events.subscriber import EventSubscriber

        with EventSubscriber(publisher.endpoint, publisher.replay_endpoint, decode=VLLM_DECODER.decode) as sub, \
                KVStoreClient(server.target, retries=0) as kv:
            kv.put(ns, hashes, encoded(ns, tensors))
            kv.delete(ns, hashes[:1])
            events: list[Any] = []
            wait_until(lambda: events.extend(e for _, b in sub.receive(0.2) for e in b.events) or  # type: ignore[attr-defined]
                       any(isinstance(e, BlockRemoved) for e in events), 20, "the delete's event")
        stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
        assert sorted(stored) == sorted(hashes)
        assert all(e.medium == "memory" for e in events if isinstance(e, (BlockStored, BlockRemoved)))
        assert [e.block_hashes for e in events if isinstance(e, BlockRemoved)] == [hashes[:1]]
    finally:
        server.stop()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_engine_announces_its_saved_blocks_and_their_removal(tmp_path: Any) -> None:
    events_port, replay_port, vllm_port = free_port(), free_port(), free_port()
    node_events = f"tcp://127.0.0.1:{events_port}"
    node_replay = f"tcp://127.0.0.1:{replay_port}"
    model = write_llama(tmp_path / "llama")
    with KVNode(memory_capacity="64MiB", extra_args=["--events-endpoint", node_events],
                env={"KVSTORE_EVENTS__REPLAY_ENDPOINT": node_replay}) as node:
        vllm_events = f"tcp://127.0.0.1:{vllm_port}"
        batches = Batches(vllm_events)
        try:
            with Engine(model, extra={"target": node.target},  # the connector asks the node for its stream
                        prefix_caching=True,
                        kv_events={"enable_kv_cache_events": True, "publisher": "zmq",
                                   "endpoint": f"tcp://*:{vllm_port}", "topic": "kv"}) as engine:
                prompt = tokens(3 * BLOCK_SIZE + 5, 41)  # three full blocks, saved as the prefill computes them
                engine.generate([prompt], max_tokens=2)
                engine.drain()

                def ours() -> list[Any]:
                    return [e for e in batches.poll() if isinstance(e, BlockStored)
                            and (e.medium or "").startswith(MEDIUM_PREFIX)]

                step_until(engine, lambda: len({h for e in ours() for h in e.block_hashes}) >= 3,
                           lambda: f"BlockStored with kvstore's medium for the saved blocks; saw "
                                   f"{[(type(e).__name__, e.medium) for e in batches.events]}")
                stored = ours()
                assert {e.medium for e in stored} == {f"{MEDIUM_PREFIX}:memory"}
                saved = [h for e in stored for h in e.block_hashes]
                # the same hashes as vLLM's own events for its GPU blocks: a router matches them as they are
                gpu = {h for e in batches.events if isinstance(e, BlockStored) and e.medium == "GPU"
                       for h in e.block_hashes}
                assert set(saved) <= gpu and len(saved) == 3
                assert [e.token_ids for e in stored] == [prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE] for i in range(3)]
                assert [e.parent_block_hash for e in stored] == [None, *saved[:2]]  # in prefix order, chained
                assert all(e.block_size == BLOCK_SIZE for e in stored)

                with KVStoreClient(node.target, retries=0) as kv:
                    assert kv.clear(engine.namespace()) >= 3

                def removed() -> set[Any]:
                    return {h for e in batches.poll() if isinstance(e, BlockRemoved)
                            and e.medium == f"{MEDIUM_PREFIX}:memory" for h in e.block_hashes}

                step_until(engine, lambda: set(saved) <= removed(), lambda: "BlockRemoved for the cleared blocks")
        finally:
            batches.close()
