"""A model-based test of the events: random puts, gets, deletes, clears, restarts and cancellations over real memory and LMDB
tiers; after every step the events replayed into a view equal what the tiers hold (hypothesis)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from kvstore.config import StoreConfig
from kvstore.errors import ResourceExhaustedError
from kvstore.events.log import EventLog
from kvstore.events.schema import KVEventBatch
from kvstore.events.subscriber import TierView
from kvstore.keys import NAMESPACE_TAG_BYTES
from kvstore.store.tiered import TieredStore
from kvstore.tiers.lmdb import LMDBTier
from tests.support.store import NS, disk_footprint, make_blocks, memory_tier

NUM_BLOCKS = 10
HASHES, BLOCKS = make_blocks(NUM_BLOCKS, seed=11)
runs = st.tuples(st.integers(0, NUM_BLOCKS - 1), st.integers(1, 4)).map(
    lambda t: (t[0], min(NUM_BLOCKS, t[0] + t[1])))


class EventsModel(RuleBasedStateMachine):
    """The store with an event log; one :class:`TierView` follows every log the store had, across restarts."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.path = Path(tempfile.mkdtemp(prefix="kvstore-events-model-"))
        self.view = TierView()
        self.store: TieredStore | None = None
        self.log: EventLog | None = None

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def open(self, floor: int = 0) -> None:
        self.log = EventLog()
        self.store = TieredStore([memory_tier(3), LMDBTier(self.path / "disk", 5 * disk_footprint())],
                                 StoreConfig(demote_min_priority=floor), events=self.log)
        self.run(self.store.start())

    @initialize(floor=st.sampled_from([0, 50]))
    def start(self, floor: int) -> None:
        self.floor = floor
        self.open(floor)

    def teardown(self) -> None:
        if self.store is not None:
            self.run(self.store.close())
        self.loop.close()
        shutil.rmtree(self.path, ignore_errors=True)

    @rule(run=runs, priority=st.sampled_from([None, 10, 90]))
    def put(self, run: tuple[int, int], priority: int | None) -> None:
        i, j = run
        try:
            self.run(self.store.put(NS, HASHES[i:j], BLOCKS[i:j], priority=priority))  # type: ignore[union-attr]
        except ResourceExhaustedError:
            pass

    @rule(run=runs)
    def get(self, run: tuple[int, int]) -> None:
        self.run(self.store.get(NS, HASHES[run[0]:run[1]]))  # type: ignore[union-attr]

    @rule(run=runs)
    def delete(self, run: tuple[int, int]) -> None:
        self.run(self.store.delete(NS, HASHES[run[0]:run[1]]))  # type: ignore[union-attr]

    @rule()
    def clear(self) -> None:
        self.run(self.store.clear(NS))  # type: ignore[union-attr]

    @rule(op=st.sampled_from(["put", "get", "delete", "clear"]), run=runs, turn=st.integers(0, 6))
    def cancelled(self, op: str, run: tuple[int, int], turn: int) -> None:
        """An operation cancelled after ``turn`` loop turns: what it did by then, and after, has its events."""
        i, j = run
        store = self.store
        call = {"put": lambda: store.put(NS, HASHES[i:j], BLOCKS[i:j]),  # type: ignore[union-attr]
                "get": lambda: store.get(NS, HASHES[i:j]),  # type: ignore[union-attr]
                "delete": lambda: store.delete(NS, HASHES[i:j]),  # type: ignore[union-attr]
                "clear": lambda: store.clear(NS)}[op]  # type: ignore[union-attr]

        async def go() -> None:
            task = asyncio.ensure_future(call())
            for _ in range(turn):
                await asyncio.sleep(0)
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, ResourceExhaustedError):
                pass

        self.run(go())

    @rule()
    def restart(self) -> None:
        self.run(self.store.close())  # type: ignore[union-attr]
        self.follow()  # the close's moves down to disk
        self.open(self.floor)

    def follow(self) -> None:
        self.view.apply(KVEventBatch(ts=0.0, events=self.log.take(1 << 20)))  # type: ignore[union-attr]

    @invariant()
    def the_view_is_the_tiers(self) -> None:
        if self.store is None:
            return
        self.run(self.store.drain())
        self.follow()
        store = self.store
        resident = {(key[:NAMESPACE_TAG_BYTES], key[NAMESPACE_TAG_BYTES:]): store.tier_names[level]
                    for level, policy in enumerate(store.index.policies) for key in policy}
        assert self.view.blocks == resident


@pytest.mark.slow
def test_events_replayed_into_a_view_equal_the_tiers() -> None:
    run_state_machine_as_test(EventsModel, settings=settings(
        max_examples=60, stateful_step_count=25, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow]))
