"""The KV event stream of a node with tokens: subscribers authenticate, and each tenant reads only its own events.

A real node (gRPC server, LMDB on disk), real ZMQ peers on loopback: tenants' subscribers with their tokens, an
operator's, anonymous SUB and DEALER sockets, and a tenant that asks for another stream's topic. "0 bytes of
another tenant's events" is checked on the raw payloads: no block hash of the other tenant, and no namespace tag
of it, in any byte a subscriber received, live or replayed. Absence is checked after a barrier (an operator's
subscriber has everything, so every batch was sent), with a bounded poll.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

import msgspec
import pytest
import zmq

from kvstore.config import Config
from kvstore.errors import ConfigError
from kvstore.events.schema import AllBlocksCleared, BlockStored, decoder
from kvstore.events.subscriber import EventSubscriber, TierView
from tests.support.redis import TlsFiles, make_tls_files
from tests.support.security import TOKEN_A, TOKEN_ADMIN, TOKEN_B, auth_config, client_of, sha_namespace
from tests.support.server import ThreadedServer, kv_blocks, make_config
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

MiB = 1 << 20
ABSENCE_POLL_MS = 500
"""How long a socket that must get nothing is polled, after the barrier: a bound, not an ordering."""


def events_config(**overrides: object) -> Config:
    return auth_config(**{"events.endpoint": "tcp://127.0.0.1:0", **overrides})


@pytest.fixture
def node() -> Iterator[ThreadedServer]:
    server = ThreadedServer(events_config())
    try:
        yield server
    finally:
        server.stop()


class Follower:
    """A subscriber that keeps every raw payload it received (live and replayed) and the view they build."""

    def __init__(self, server: ThreadedServer, token: str | None, **kwargs: object) -> None:
        publisher = server.server.events.publisher  # type: ignore[union-attr]
        self.sub = EventSubscriber(publisher.endpoint, publisher.replay_endpoint, decode=lambda b: b, token=token,
                                   **kwargs)  # type: ignore[arg-type]
        self.payloads: list[bytes] = []
        self.seqs: list[int] = []
        self.view = TierView()
        self._decode = decoder().decode

    def poll(self) -> None:
        for seq, payload in self.sub.receive(0.1):
            self.seqs.append(seq)
            self.payloads.append(payload)  # type: ignore[arg-type]
            self.view.apply(self._decode(payload))  # type: ignore[arg-type]

    def until(self, condition, what: str) -> None:  # type: ignore[no-untyped-def]
        wait_until(lambda: self.poll() or condition(), 30, what, pause_s=0)

    def hashes(self) -> set[bytes]:
        return {h for _, h in self.view.blocks}

    def close(self) -> None:
        self.sub.close()


def leaked(payloads: list[bytes], secrets: list[bytes]) -> list[bytes]:
    """The ``secrets`` (hashes, tags) found in any of the raw ``payloads``."""
    return [s for s in secrets if any(s in p for p in payloads)]


def drain_raw(sock: zmq.Socket) -> list[list[bytes]]:
    got = []
    while sock.poll(ABSENCE_POLL_MS):
        got.append(sock.recv_multipart())
    return got


def test_each_tenant_reads_only_its_own_events_and_an_operator_reads_all(node: ThreadedServer) -> None:
    ns_a, ns_b = sha_namespace("tenant-a"), sha_namespace("tenant-b")
    hashes_a, tensors_a = kv_blocks(ns_a, 8)
    hashes_b, tensors_b = kv_blocks(ns_b, 4, first_token=1000)
    followers = {name: Follower(node, token) for name, token in
                 (("a", TOKEN_A), ("b", TOKEN_B), ("admin", TOKEN_ADMIN))}
    try:
        with client_of(node, TOKEN_A) as a, client_of(node, TOKEN_B) as b:
            assert a.put(ns_a, hashes_a, tensors_a) == 8
            assert b.put(ns_b, hashes_b, tensors_b) == 4
            followers["admin"].until(lambda: len(followers["admin"].view.blocks) == 12, "the operator sees both")
            followers["a"].until(lambda: followers["a"].hashes() == set(hashes_a), "tenant A sees its 8 blocks")
            followers["b"].until(lambda: followers["b"].hashes() == set(hashes_b), "tenant B sees its 4 blocks")
            assert a.delete(ns_a, hashes_a[:2]) == 2
            b.clear(ns_b)
            followers["admin"].until(lambda: len(followers["admin"].view.blocks) == 6, "the operator sees both go")
            followers["a"].until(lambda: len(followers["a"].view.blocks) == 6, "tenant A sees its delete")
            followers["b"].until(lambda: not followers["b"].view.blocks, "tenant B sees its clear")
        for follower in followers.values():
            follower.poll()
            assert follower.seqs == list(range(len(follower.seqs))) and follower.sub.num_missed == 0  # no gaps
        assert leaked(followers["b"].payloads, [*hashes_a, ns_a.tag]) == []  # 0 bytes of A's events reach B
        assert leaked(followers["a"].payloads, [*hashes_b, ns_b.tag]) == []
        assert {t for t, _ in followers["a"].view.blocks} == {ns_a.tag}
        for token, own, other in ((TOKEN_A, hashes_a, [*hashes_b, ns_b.tag]), (TOKEN_B, hashes_b, [*hashes_a, ns_a.tag])):
            late = Follower(node, token)  # a replay from 0: the whole history of its own stream, nothing else
            try:
                late.poll()
                assert late.seqs == list(range(len(late.seqs))) and late.sub.num_replayed == len(late.seqs)
                assert leaked(late.payloads, other) == [] and leaked(late.payloads, own[-2:]) == own[-2:]
                events = [e for p in late.payloads for e in decoder().decode(p).events]
                assert isinstance(events[0], AllBlocksCleared) and events[0].reason == "start"  # the node's own
            finally:
                late.close()
    finally:
        for follower in followers.values():
            follower.close()


def test_a_subscriber_without_a_valid_token_gets_nothing_live_or_replayed(node: ThreadedServer) -> None:
    publisher = node.server.events.publisher  # type: ignore[union-attr]
    ns_a = sha_namespace("tenant-a")
    hashes, tensors = kv_blocks(ns_a, 8)
    ctx = zmq.Context.instance()
    anonymous = ctx.socket(zmq.SUB)  # no token at all
    anonymous.setsockopt(zmq.SUBSCRIBE, b"")
    wrong = ctx.socket(zmq.SUB)  # a token the node does not know
    wrong.plain_username, wrong.plain_password = b"kvstore", b"not-a-token-of-this-node-0123456789"
    wrong.setsockopt(zmq.SUBSCRIBE, b"")
    replay = ctx.socket(zmq.DEALER)  # the replay socket, asked for everything from 0
    sockets = (anonymous, wrong, replay)
    admin = Follower(node, TOKEN_ADMIN, from_seq=None)
    try:
        for sock in sockets:
            sock.setsockopt(zmq.LINGER, 0)
        anonymous.connect(publisher.endpoint)
        wrong.connect(publisher.endpoint)
        replay.connect(publisher.replay_endpoint)
        replay.send_multipart([b"", (0).to_bytes(8, "big")], flags=zmq.NOBLOCK)
        with client_of(node, TOKEN_A) as a:
            while not admin.payloads:  # until the operator's live subscription is in: the others had time too
                assert a.put(ns_a, hashes[:1], tensors[:1]) == 1
                assert a.delete(ns_a, hashes[:1]) == 1
                admin.poll()
            assert a.put(ns_a, hashes, tensors) == 8
        admin.until(lambda: len(admin.view.blocks) == 8, "the operator sees tenant A's 8 blocks")
        for sock in sockets:  # the barrier is behind us: every batch was sent
            assert drain_raw(sock) == []
    finally:
        admin.close()
        for sock in sockets:
            sock.close(linger=0)


def test_a_tenant_that_asks_for_another_streams_topic_gets_only_its_own(node: ThreadedServer) -> None:
    publisher = node.server.events.publisher  # type: ignore[union-attr]
    ns_a, ns_b = sha_namespace("tenant-a"), sha_namespace("tenant-b")
    hashes_a, tensors_a = kv_blocks(ns_a, 4)
    hashes_b, tensors_b = kv_blocks(ns_b, 2, first_token=500)
    topics = [spec.topic for spec in node.server.events.publisher.streams]  # type: ignore[union-attr]
    greedy = []
    for prefix in (b"", b"kvstore@", b"kvstore@all", *topics):
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.plain_username, sock.plain_password = b"kvstore", TOKEN_B.encode()
        sock.setsockopt(zmq.SUBSCRIBE, prefix)
        sock.connect(publisher.endpoint)
        greedy.append(sock)
    own = Follower(node, TOKEN_B, from_seq=None)
    try:
        with client_of(node, TOKEN_A) as a, client_of(node, TOKEN_B) as b:
            i = 0
            while not own.payloads:  # tenant B's own subscription is in once it gets a batch of its own
                assert b.put(ns_b, hashes_b[i % 2:i % 2 + 1], tensors_b[i % 2:i % 2 + 1]) in (0, 1)
                assert b.delete(ns_b, hashes_b[i % 2:i % 2 + 1]) == 1
                i += 1
                own.poll()
            assert a.put(ns_a, hashes_a, tensors_a) == 4
            assert b.put(ns_b, hashes_b, tensors_b) == 2
        own.until(lambda: own.hashes() == set(hashes_b), "tenant B sees its blocks")
        for sock in greedy:
            frames = drain_raw(sock)
            assert leaked([f for m in frames for f in m], [*hashes_a, ns_a.tag]) == []
            assert {m[0] for m in frames} <= {own_topic(node, TOKEN_B)}  # its own stream's batches, or nothing
    finally:
        own.close()
        for sock in greedy:
            sock.close(linger=0)


def own_topic(server: ThreadedServer, token: str) -> bytes:
    publisher = server.server.events.publisher  # type: ignore[union-attr]
    return publisher.streams[publisher.access.stream_of_token(token)].topic


def test_after_a_restart_restored_blocks_reach_only_their_tenants_stream(tmp_path: Path) -> None:
    disk = {"store.disk.path": str(tmp_path / "disk"), "store.disk.capacity_bytes": 64 * MiB}
    ns_a, ns_b = sha_namespace("tenant-a"), sha_namespace("tenant-b")
    hashes_a, tensors_a = kv_blocks(ns_a, 6)
    hashes_b, tensors_b = kv_blocks(ns_b, 3, first_token=700)
    first = ThreadedServer(events_config(**disk))
    try:
        with client_of(first, TOKEN_A) as a, client_of(first, TOKEN_B) as b:
            assert a.put(ns_a, hashes_a, tensors_a) == 6
            assert b.put(ns_b, hashes_b, tensors_b) == 3
    finally:
        first.stop()  # the memory tier is flushed to LMDB; the pairs tenant -> namespace are on disk
    restarted = ThreadedServer(events_config(**disk))
    followers = {token: Follower(restarted, token) for token in (TOKEN_A, TOKEN_B, TOKEN_ADMIN)}
    try:
        followers[TOKEN_ADMIN].until(lambda: len(followers[TOKEN_ADMIN].view.blocks) == 9, "the operator's view")
        followers[TOKEN_A].until(lambda: followers[TOKEN_A].hashes() == set(hashes_a), "A's restored blocks")
        followers[TOKEN_B].until(lambda: followers[TOKEN_B].hashes() == set(hashes_b), "B's restored blocks")
        assert set(followers[TOKEN_A].view.blocks.values()) == {"disk"}
        assert leaked(followers[TOKEN_B].payloads, [*hashes_a, ns_a.tag]) == []
        assert leaked(followers[TOKEN_A].payloads, [*hashes_b, ns_b.tag]) == []
        stored = [e for p in followers[TOKEN_A].payloads for e in decoder().decode(p).events
                  if isinstance(e, BlockStored)]
        assert stored and all(e.namespace == ns_a.tag for e in stored)
    finally:
        for follower in followers.values():
            follower.close()
        restarted.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    return make_tls_files(tmp_path_factory.mktemp("events-ca"))


def test_a_node_with_client_certificates_and_no_tokens_refuses_a_remote_events_endpoint(pki: TlsFiles) -> None:
    mtls = {"security.tls_cert_file": pki.server_cert, "security.tls_key_file": pki.server_key,
            "security.tls_client_ca_file": pki.ca_cert}
    for endpoint in ("tcp://0.0.0.0:0", "tcp://*:0"):
        for allow_remote in (False, True):  # no token to authenticate subscribers with: never, not even allowed
            with pytest.raises(ConfigError, match="events.endpoint"):
                ThreadedServer(make_config(**mtls, **{"events.endpoint": endpoint,
                                                      "events.allow_remote": allow_remote}))
    with pytest.raises(ConfigError, match="events.replay_endpoint"):
        ThreadedServer(make_config(**mtls, **{"events.endpoint": "tcp://127.0.0.1:0",
                                              "events.replay_endpoint": "tcp://0.0.0.0:0"}))
    local = ThreadedServer(make_config(**mtls, **{"events.endpoint": "tcp://127.0.0.1:0"}))
    try:  # on loopback it publishes, unauthenticated (only processes of this host can connect)
        publisher = local.server.events.publisher  # type: ignore[union-attr]
        assert publisher.endpoint.startswith("tcp://127.0.0.1:") and not publisher.authenticated
        with EventSubscriber(publisher.endpoint, publisher.replay_endpoint) as sub:
            batches = sub.receive(5.0)
        assert batches and isinstance(batches[0][1].events[0], AllBlocksCleared)  # type: ignore[attr-defined]
    finally:
        local.stop()


def test_replayed_batches_decode_with_vllms_field_set(node: ThreadedServer) -> None:
    """A tenant's stream is vLLM's framing and event types, as the stream of a node without tokens."""
    ns_a = sha_namespace("tenant-a")
    hashes, tensors = kv_blocks(ns_a, 2)
    follower = Follower(node, TOKEN_A)
    try:
        with client_of(node, TOKEN_A) as a:
            assert a.put(ns_a, hashes, tensors) == 2
        follower.until(lambda: follower.hashes() == set(hashes), "tenant A's blocks")
        for payload in follower.payloads:
            ts, events, *_ = msgspec.msgpack.decode(payload)
            assert isinstance(ts, float) and {e["type"] for e in events} <= {"BlockStored", "AllBlocksCleared"}
    finally:
        follower.close()
