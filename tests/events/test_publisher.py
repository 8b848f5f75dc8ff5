"""The node's event stream over ZMQ: a real server publishing on 127.0.0.1, real SUB and DEALER subscribers."""

from __future__ import annotations

import pytest
import zmq

from kvstore.client import KVStoreClient
from kvstore.config import EventsConfig
from kvstore.errors import ConfigError
from kvstore.events import open_node_events
from kvstore.events.log import EventLog
from kvstore.events.publisher import EventPublisher, PublisherSettings
from kvstore.events.schema import (
    CLEARED_NAMESPACE,
    CLEARED_START,
    END_SEQ,
    REMOVED_CLEARED,
)
from kvstore.events.subscriber import EventStreamError, EventSubscriber, TierView
from tests.support.security import AUTH_TOKENS
from tests.support.server import ThreadedServer, encoded, kv_blocks, make_config, namespace, scrape
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def node():  # type: ignore[no-untyped-def]
    server = ThreadedServer(make_config(**{"events.endpoint": "tcp://127.0.0.1:0"}))
    try:
        yield server
    finally:
        server.stop()


def subscriber(node: ThreadedServer, **kwargs: object) -> EventSubscriber:
    publisher = node.server.events.publisher  # type: ignore[union-attr]
    return EventSubscriber(publisher.endpoint, publisher.replay_endpoint, **kwargs)  # type: ignore[arg-type]


def resident(node: ThreadedServer) -> dict[tuple[bytes, bytes], str]:
    store = node.server.store

    async def read() -> dict[tuple[bytes, bytes], str]:
        return {(key[:8], key[8:]): store.tier_names[level]
                for level, policy in enumerate(store.index.policies) for key in policy}

    return node.call(read())


def test_puts_and_a_clear_reach_a_subscriber_in_order_without_gaps(node: ThreadedServer) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 6)
    view = TierView()
    seqs: list[int] = []

    def follow(sub: EventSubscriber, condition) -> None:  # type: ignore[no-untyped-def]
        def done() -> bool:
            for seq, batch in sub.receive(0.2):
                seqs.append(seq)
                view.apply(batch)  # type: ignore[arg-type]
            return condition()

        wait_until(done, 20, "the events")

    with subscriber(node) as sub, KVStoreClient(node.target, retries=0) as kv:
        for i in range(3):
            kv.put(ns, hashes[2 * i:2 * i + 2], encoded(ns, tensors[2 * i:2 * i + 2]))
        follow(sub, lambda: len(view.blocks) == 6)
        assert view.blocks == resident(node)
        assert {h for _, h in view.blocks} == set(hashes) and {t for t, _ in view.blocks} == {ns.tag}
        kv.clear(ns)
        follow(sub, lambda: not view.blocks)
        assert view.num_events[f"cleared_{CLEARED_NAMESPACE}"] == 1 and view.num_events[REMOVED_CLEARED] == 6
        assert view.num_events[f"cleared_{CLEARED_START}"] == 1  # the node's start, replayed from seq 0
        assert seqs == list(range(len(seqs))) and sub.num_missed == 0


def test_a_late_subscriber_replays_what_it_missed(node: ThreadedServer) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 4)
    publisher = node.server.events.publisher  # type: ignore[union-attr]
    with KVStoreClient(node.target, retries=0) as kv:
        kv.put(ns, hashes, encoded(ns, tensors))
        wait_until(lambda: publisher.counters()["events"] >= 2, 20, "the put's events published")
        with subscriber(node) as late:
            got = late.receive(5.0)
        assert [seq for seq, _ in got] == list(range(publisher.next_seq))
        view = TierView()
        for _, batch in got:
            view.apply(batch)  # type: ignore[arg-type]
        assert view.blocks == resident(node) and len(view.blocks) == 4
        assert late.num_replayed == len(got)


def test_a_stalled_subscriber_misses_batches_puts_go_on_and_it_catches_up_by_replay() -> None:
    log = EventLog()
    publisher = EventPublisher(log, PublisherSettings(endpoint="tcp://127.0.0.1:0", hwm=2))
    ctx = zmq.Context.instance()
    stalled = ctx.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 2)
    stalled.setsockopt(zmq.RCVBUF, 4096)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect(publisher.endpoint)
    probe = EventSubscriber(publisher.endpoint, publisher.replay_endpoint, from_seq=None)
    try:
        first = 0
        while not probe.receive(0.05):  # the subscriptions have reached the publisher once a batch gets through
            log.cleared(b"probe---")
            first += 1
        num_batches = 200  # of 8,192 hashes (about 150 KB) each: more than the socket buffers hold
        for i in range(num_batches):  # nobody reads `stalled`: ZMQ drops its batches past the HWM, nothing waits
            for j in range(8192):
                log.stored(0, block_key_of(i * 8192 + j))
            wait_until(lambda: not len(log), 10, "the log taken", pause_s=0.001)
        wait_until(lambda: publisher.next_seq >= first + num_batches, 10, "every batch sent")
        received = []
        while stalled.poll(200):
            received.append(int.from_bytes(stalled.recv_multipart()[1], "big"))
        assert 0 < len(received) < num_batches  # it missed batches: the gaps show in the sequence numbers
        missing = sorted(set(range(received[0], publisher.next_seq)) - set(received))
        assert missing
        late = EventSubscriber(publisher.endpoint, publisher.replay_endpoint, from_seq=None)
        replayed = {seq for seq, _ in late.replay(missing[0], 5.0)}
        late.close()
        assert set(missing) <= replayed  # the replay buffer still had every batch it missed
        assert publisher.counters()["dropped_events"] == 0  # the log dropped nothing
        assert publisher.counters()["subscriber_overruns"] >= 1  # the node counted that a subscriber lost batches
    finally:
        probe.close()
        stalled.close(linger=0)
        publisher.close()


def test_a_stalled_subscribers_drops_are_counted_while_puts_and_a_reading_subscriber_go_on() -> None:
    """On inproc (no kernel buffers) a subscriber that never reads fills its queue within a few batches; every
    put still completes, the node counts the overruns on /metrics, and a subscriber that reads sees every batch."""
    endpoint = f"inproc://test-events-stalled-{id(object())}"
    server = ThreadedServer(make_config(**{"events.endpoint": endpoint, "events.replay_endpoint": "off",
                                           "events.hwm": 1}))
    stalled = zmq.Context.instance().socket(zmq.SUB)  # the node's context: inproc needs the same one
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.LINGER, 0)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect(endpoint)
    try:
        publisher = server.server.events.publisher  # type: ignore[union-attr]
        ns = namespace()
        num_puts = 12
        hashes, tensors = kv_blocks(ns, num_puts)
        with EventSubscriber(endpoint, None, topic="", from_seq=None) as reader, \
                KVStoreClient(server.target, retries=0) as kv:
            seqs: list[int] = []
            while not seqs:  # both subscriptions are in once the reader gets a batch (the stalled one came first)
                kv.put(ns, hashes[:1], encoded(ns, tensors[:1]))
                kv.delete(ns, hashes[:1])
                seqs += [seq for seq, _ in reader.receive(0.2)]
            for i in range(num_puts):  # one batch per put at least: each waits for the last one's batch
                before = publisher.next_seq
                kv.put(ns, hashes[i:i + 1], encoded(ns, tensors[i:i + 1]))
                wait_until(lambda: publisher.next_seq > before, 20, "the put's batch sent")
                seqs += [seq for seq, _ in reader.receive(0)]
            assert kv.lookup(ns, hashes).num_blocks == num_puts  # every put completed
            wait_until(lambda: bool(seqs.extend(seq for seq, _ in reader.receive(0.2))) or
                       seqs[-1] == publisher.next_seq - 1, 20, "the reader has the last batch")
        assert seqs == list(range(seqs[0], publisher.next_seq)) and reader.num_missed == 0  # the reader lost none
        overruns = publisher.counters()["subscriber_overruns"]
        assert overruns >= 1  # the stalled one holds 2 batches at most (its HWM and the node's): it lost the rest
        assert scrape(server)['kvstore_events_total{event="subscriber_overruns"}'] == overruns
    finally:
        stalled.close(linger=0)
        server.stop()


def block_key_of(i: int) -> bytes:
    return b"tag-tag-" + i.to_bytes(16, "big")


def test_a_malformed_replay_request_gets_an_error_and_the_node_stays_up(node: ThreadedServer) -> None:
    publisher = node.server.events.publisher  # type: ignore[union-attr]
    ctx = zmq.Context.instance()
    for request in ([b"", b"abc"], [b"", b"x" * 9], [b"one", b"two", b"three"], [b"\x00" * 8, b"\x00" * 8]):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(publisher.replay_endpoint)
        sock.send_multipart(request)
        assert sock.poll(5000), request
        frames = sock.recv_multipart()
        assert frames[-2] == END_SEQ and frames[-1].startswith(b"error: "), frames
        sock.close()
    big = ctx.socket(zmq.DEALER)  # a request over MAX_REQUEST_BYTES: the peer is dropped, nothing else
    big.setsockopt(zmq.LINGER, 0)
    big.connect(publisher.replay_endpoint)
    big.send_multipart([b"", b"y" * 100_000])
    big.close()
    assert publisher.counters()["replay_errors"] == 4
    with subscriber(node) as sub:
        assert sub.replay(0, 5.0)[0][0] == 0  # a good request is served as before
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 1)
    with KVStoreClient(node.target, retries=0) as kv:
        kv.put(ns, hashes, encoded(ns, tensors))
        assert kv.lookup(ns, hashes).num_blocks == 1
    with pytest.raises(EventStreamError, match="error: "):
        _replay_raw(publisher.replay_endpoint, b"short")


def _replay_raw(endpoint: str, payload: bytes) -> None:
    """Send one raw replay request and raise what the subscriber raises on an error marker."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", payload])
        assert sock.poll(5000)
        frames = sock.recv_multipart()
        if frames[-2] == END_SEQ and frames[-1]:
            raise EventStreamError(frames[-1].decode())
    finally:
        sock.close()


def test_the_metrics_export_the_publishers_counts(node: ThreadedServer) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 2)
    publisher = node.server.events.publisher  # type: ignore[union-attr]
    with KVStoreClient(node.target, retries=0) as kv:
        kv.put(ns, hashes, encoded(ns, tensors))
    wait_until(lambda: publisher.counters()["events"] >= 2, 20, "the put's events published")
    samples = scrape(node)
    assert samples['kvstore_events_total{event="batches"}'] >= 2
    assert samples['kvstore_events_total{event="dropped_events"}'] == 0
    assert "kvstore_events_queued" in samples


def test_events_are_off_by_default() -> None:
    assert make_config().events.endpoint == ""
    assert open_node_events(EventsConfig(), client_auth=True) is None


def test_a_node_that_authenticates_clients_publishes_only_on_a_local_endpoint() -> None:
    for endpoint in ("tcp://*:0", "tcp://0.0.0.0:0", "tcp://10.1.2.3:5557"):
        with pytest.raises(ConfigError, match="events.endpoint"):
            open_node_events(EventsConfig(endpoint=endpoint), client_auth=True)
        with pytest.raises(ConfigError, match="events.endpoint"):  # an unauthenticated stream: even when allowed
            open_node_events(EventsConfig(endpoint=endpoint, allow_remote=True), client_auth=True)
    with pytest.raises(ConfigError, match="events.replay_endpoint"):
        open_node_events(EventsConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://*:0"), client_auth=True)
    for config, client_auth in ((EventsConfig(endpoint="tcp://127.0.0.1:0"), True),
                                (EventsConfig(endpoint="tcp://*:0"), False)):
        events = open_node_events(config, client_auth=client_auth)
        assert events is not None
        events.close()
    server = ThreadedServer(make_config(**{"events.endpoint": "tcp://127.0.0.1:0", "security.auth_tokens": AUTH_TOKENS}))
    try:
        assert server.server.events is not None and server.server.events.publisher.authenticated
    finally:
        server.stop()
    with pytest.raises(ConfigError, match="events.endpoint"):
        ThreadedServer(make_config(**{"events.endpoint": "tcp://*:0", "security.auth_tokens": AUTH_TOKENS}))
    server = ThreadedServer(make_config(**{"events.endpoint": "tcp://*:0", "events.allow_remote": True,
                                           "security.auth_tokens": AUTH_TOKENS}))
    try:  # tokens, and the operator said so: subscribers authenticate (their tokens in the clear)
        assert server.server.events is not None and server.server.events.publisher.authenticated
    finally:
        server.stop()


def test_vllms_own_decoder_reads_the_nodes_batches(node: ThreadedServer) -> None:
    """The stream uses only vLLM's three event tags and sends every field vLLM requires: checked against a copy
    of vLLM's required fields here, and against vLLM's own classes in tests/connectors/vllm/test_events.py."""
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 2)
    with subscriber(node, decode=lambda b: b) as sub, KVStoreClient(node.target, retries=0) as kv:
        kv.put(ns, hashes, encoded(ns, tensors))
        kv.delete(ns, hashes[:1])
        import msgspec

        raw: list[object] = []
        wait_until(lambda: raw.extend(msgspec.msgpack.decode(b) for _, b in sub.receive(0.2)) or
                   sum(len(e["block_hashes"]) for _, events, *_ in raw for e in events if "block_hashes" in e) >= 3,
                   20, "the put's and the delete's events")
    types = {e["type"] for _, events, *_ in raw for e in events}
    assert types <= {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    for _, events, *_ in raw:
        for e in events:
            if e["type"] == "BlockStored":
                assert {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                        "lora_name"} <= set(e) and e["token_ids"] == []
            if e["type"] == "BlockRemoved":
                assert {"block_hashes", "medium"} <= set(e)


def test_the_events_settings_are_checked_and_one_variable_turns_them_on() -> None:
    from kvstore.config import load_config

    assert load_config(env={"KVSTORE_EVENTS_ENDPOINT": "ipc:///tmp/x"}).events.endpoint == "ipc:///tmp/x"
    for overrides, field in (({"events.endpoint": "http://127.0.0.1:5557"}, "events.endpoint"),
                             ({"events.hwm": 0}, "events.hwm"), ({"events.buffer_steps": 0}, "events.buffer_steps")):
        with pytest.raises(ConfigError, match=field):
            load_config(env={}, overrides=overrides)
