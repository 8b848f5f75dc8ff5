"""The replay socket's bounds, on a real publisher and real ZMQ peers over loopback: one replay per peer, a cap
per stream and in total, a stall bound (on an injected clock), and peers' replays freed when they go."""

from __future__ import annotations

from typing import Iterator

import pytest

from kvstore.events.access import EventAccess
from kvstore.events.log import EventLog
from kvstore.events.publisher import EventPublisher, PublisherSettings
from kvstore.events.replay import ReplayLimits
from kvstore.events.subscriber import EventStreamError, EventSubscriber
from kvstore.server.auth import Authenticator, parse_tokens
from tests.support.replay_hog import ReplayHog
from tests.support.security import AUTH_TOKENS, TOKEN_A, TOKEN_ADMIN
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

TAG_A = b"tenant-a"  # a namespace tag of tenant A (8 bytes)
NUM_BATCHES = 40  # of 8,192 hashes each, about 150 KB: more than a peer's queue and the socket buffers hold
LIMITS = ReplayLimits(max_replays=4, max_replays_per_stream=2, replay_hwm=4, replay_stall_s=10.0)


class Clock:
    """A clock the test moves (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def publisher(clock: Clock) -> Iterator[EventPublisher]:
    authenticator = Authenticator(parse_tokens(AUTH_TOKENS, "test", compact=True))
    access = EventAccess(authenticator.principals, authenticator.principal_of, "kvstore")
    log = EventLog()
    log.set_routes({TAG_A: access.tenant_routes["tenant-a"]})
    events = EventPublisher(log, PublisherSettings(endpoint="tcp://127.0.0.1:0", replay=LIMITS), access=access,
                            clock=clock)
    try:
        for i in range(NUM_BATCHES):  # tenant A's blocks: in A's stream and the operator's
            for j in range(8192):
                log.stored(0, TAG_A + (i * 8192 + j).to_bytes(16, "big"))
            wait_until(lambda: not len(log), 10, "the log taken", pause_s=0.001)
        wait_until(lambda: events.next_seq >= NUM_BATCHES, 10, "every batch sent")
        yield events
    finally:
        events.close()


def replay_of(publisher: EventPublisher, token: str) -> list[tuple[int, object]]:
    with EventSubscriber(publisher.endpoint, publisher.replay_endpoint, from_seq=None, token=token,
                         decode=lambda b: b) as sub:
        return sub.replay(0, 10.0)


def stuck(publisher: EventPublisher, hogs: list[ReplayHog], replays: int) -> None:
    """Wait until the node took ``replays`` requests and filled each hog's queue (it has nothing more to send)."""
    wait_until(lambda: publisher.counters()["replays"] >= replays, 20, "the requests taken")
    full = len(hogs) * LIMITS.replay_hwm
    wait_until(lambda: publisher.counters()["replayed_batches"] >= full, 20, "the peers' queues full")


def test_a_peer_that_asks_again_restarts_its_replay_and_never_holds_two(publisher: EventPublisher) -> None:
    hog = ReplayHog(publisher.replay_endpoint, peers=1, requests_per_peer=10, token=TOKEN_A).start()  # type: ignore
    try:
        stuck(publisher, [hog], 10)
        assert publisher.counters()["replays_pending"] == 1
    finally:
        hog.close()
    wait_until(lambda: publisher.counters()["replays_pending"] == 0, 20, "the peer's replay freed as it went")


def test_one_tenant_cannot_take_every_replay_and_peers_that_go_free_theirs(publisher: EventPublisher) -> None:
    hogs = [ReplayHog(publisher.replay_endpoint, peers=1, requests_per_peer=1, token=TOKEN_A).start()  # type: ignore
            for _ in range(LIMITS.max_replays_per_stream)]
    try:
        stuck(publisher, hogs, len(hogs))
        with pytest.raises(EventStreamError, match="busy"):  # tenant A's stream has its replays under way
            replay_of(publisher, TOKEN_A)
        assert publisher.counters()["replays_refused"] == 1
        assert len(replay_of(publisher, TOKEN_ADMIN)) >= NUM_BATCHES  # another stream is served meanwhile
    finally:
        for hog in hogs:
            hog.close()
    wait_until(lambda: publisher.counters()["replays_pending"] == 0, 20, "the peers' replays freed")
    assert len(replay_of(publisher, TOKEN_A)) >= NUM_BATCHES


def test_a_replay_whose_peer_reads_nothing_is_dropped(publisher: EventPublisher, clock: Clock) -> None:
    hog = ReplayHog(publisher.replay_endpoint, peers=1, requests_per_peer=1, token=TOKEN_ADMIN).start()  # type: ignore
    try:
        stuck(publisher, [hog], 1)
        clock.now += LIMITS.replay_stall_s / 2
        assert publisher.counters()["replays_pending"] == 1  # not yet

        def dropped() -> bool:  # the clock moves past the bound at each look: once the peer's socket buffers are
            clock.now += 2 * LIMITS.replay_stall_s  # full, the node sends nothing more, and drops the replay
            return publisher.counters()["replays_pending"] == 0

        wait_until(dropped, 20, "the stalled replay dropped")
        assert publisher.counters()["replays_abandoned"] == 1
    finally:
        hog.close()
