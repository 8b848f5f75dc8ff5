"""A model-based test of the store: random puts, gets, lookups, deletes, clears, restarts and cancellations over real
memory and LMDB tiers (and a real Redis), checked against a plain dict model, with no sleeps.

After every step, once the store has drained:

* no block is served (by a get) or reported (by a lookup) that a completed delete or clear removed, with no put since;
* every block a put reported stored is still reported, or it was dropped by an eviction, and counted: no more blocks
  are missing than the stats count blocks dropped;
* every local tier holds exactly the blocks the index has resident in it, and no entry is left in use;
* every block served has the bytes that were put under its key, and a get returns exactly the stored prefix: it
  ends only at a block no tier holds (gone since its put, and counted by the invariant above).

Cancellations are made at a chosen loop turn of the operation (hypothesis picks it): cancelled before its first
step, an operation does nothing; after it, it runs to its end, as a delete or a put must.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from kvstore.config import StoreConfig
from kvstore.errors import ResourceExhaustedError
from kvstore.keys import block_key
from kvstore.store import TieredStore
from kvstore.tiers.lmdb import LMDBTier
from kvstore.tiers.redis import RedisTier
from tests.support.redis import RedisProcess, redis_server  # noqa: F401
from tests.support.store import NS, disk_footprint, make_blocks, memory_tier, redis_config, tier_and_index_disagree

NUM_BLOCKS = 8
HASHES, BLOCKS = make_blocks(NUM_BLOCKS, seed=5)
CONTENT = {block_key(NS, h): b for h, b in zip(HASHES, BLOCKS)}

runs = st.tuples(st.integers(0, NUM_BLOCKS - 1), st.integers(1, 4)).map(
    lambda t: (t[0], min(NUM_BLOCKS, t[0] + t[1])))
turns = st.integers(0, 6)


def dropped(store: TieredStore) -> int:
    """Blocks the store's stats count as having left the local tiers for good: evicted from a tier and not demoted
    into the next (or, in write-back mode, into the shared tier)."""
    tiers = store.stats().tiers
    num_local = len(store.index.policies)
    total = 0
    for level in range(num_local):
        below = tiers[level + 1].demotions if level + 1 < len(tiers) else 0
        total += tiers[level].evictions - below
    return total


class StoreModel(RuleBasedStateMachine):
    """The store against a dict model; subclasses choose the shared tier."""

    redis_url: str | None = None
    mode = "write_through"

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.path = Path(tempfile.mkdtemp(prefix="kvstore-model-"))
        self.stored: set[bytes] = set()  # keys a put reported stored, with no delete or clear since
        self.deleted: set[bytes] = set()  # keys a completed delete or clear removed, with no put since
        self.dropped_before = 0  # drops counted by stores closed so far
        self.store: TieredStore | None = None

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def open(self) -> TieredStore:
        config = redis_config(self.redis_url, self.mode) if self.redis_url else StoreConfig()
        shared = RedisTier(config.redis) if self.redis_url else None
        store = TieredStore([memory_tier(3), LMDBTier(self.path / "disk", 5 * disk_footprint())], config,
                            shared=shared)
        self.run(store.start())
        return store

    @initialize()
    def start(self) -> None:
        self.store = self.open()

    def teardown(self) -> None:
        if self.store is not None:
            self.run(self.store.close())
        self.loop.close()
        shutil.rmtree(self.path, ignore_errors=True)

    # ------------------------------------------------------------------ the model's bookkeeping

    def _put_done(self, keys: list[bytes]) -> None:
        self.stored.update(keys)
        self.deleted.difference_update(keys)

    def _deleted(self, keys: list[bytes]) -> None:
        self.stored.difference_update(keys)
        self.deleted.update(keys)

    def _unknown(self, keys: list[bytes]) -> None:
        self.stored.difference_update(keys)
        self.deleted.difference_update(keys)

    # ------------------------------------------------------------------ rules

    @rule(run=runs, priority=st.sampled_from([None, 10, 90]))
    def put(self, run: tuple[int, int], priority: int | None) -> None:
        i, j = run
        keys = [block_key(NS, h) for h in HASHES[i:j]]
        try:
            self.run(self.store.put(NS, HASHES[i:j], BLOCKS[i:j], priority=priority))
        except ResourceExhaustedError:
            self._unknown(keys)  # a batch larger than the room left: some may be stored
        else:
            self._put_done(keys)

    @rule(run=runs)
    def get(self, run: tuple[int, int]) -> None:
        i, j = run
        got = self.run(self.store.get(NS, HASHES[i:j]))
        for h, block in zip(HASHES[i:j], got):
            key = block_key(NS, h)
            assert key not in self.deleted, "a get served a block a completed delete removed"
            assert bytes(block) == CONTENT[key]
        # exactly the stored prefix: a get ends at a block no tier holds, never at one a put stored that is still
        # there (a block gone since its put was evicted, and the invariant checks that every such loss is counted)
        end = i + len(got)
        if end < j and block_key(NS, HASHES[end]) in self.stored:
            assert self.run(self.store.lookup(NS, [HASHES[end]])).num_blocks == 0, (
                f"a get of blocks {i}..{j} returned {len(got)}, but block {end}, stored, is still in the store")

    @rule(run=runs)
    def lookup(self, run: tuple[int, int]) -> None:
        i, j = run
        found = self.run(self.store.lookup(NS, HASHES[i:j])).num_blocks
        for h in HASHES[i:i + found]:
            assert block_key(NS, h) not in self.deleted, "a lookup reported a block a completed delete removed"

    @rule(run=runs)
    def delete(self, run: tuple[int, int]) -> None:
        i, j = run
        self.run(self.store.delete(NS, HASHES[i:j]))
        self._deleted([block_key(NS, h) for h in HASHES[i:j]])

    @rule()
    def clear(self) -> None:
        self.run(self.store.clear(NS))
        self._deleted(list(CONTENT))

    @rule()
    def restart(self) -> None:
        """Close the store (memory is flushed to disk) and open a new one on the same disk path."""
        self.run(self.store.close())
        self.dropped_before += dropped(self.store)  # the flush's evictions too
        self.store = self.open()

    @rule(op=st.sampled_from(["put", "get", "delete", "clear"]), run=runs, turn=turns)
    def cancelled(self, op: str, run: tuple[int, int], turn: int) -> None:
        """An operation cancelled after ``turn`` loop turns (0: before its first step)."""
        i, j = run
        keys = [block_key(NS, h) for h in HASHES[i:j]]
        call = {"put": lambda: self.store.put(NS, HASHES[i:j], BLOCKS[i:j]),
                "get": lambda: self.store.get(NS, HASHES[i:j]),
                "delete": lambda: self.store.delete(NS, HASHES[i:j]),
                "clear": lambda: self.store.clear(NS)}[op]

        async def go() -> bool:
            task = asyncio.ensure_future(call())
            for _ in range(turn):
                await asyncio.sleep(0)
            started = turn > 0
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, ResourceExhaustedError):
                pass
            return started

        started = self.run(go())
        if not started:
            return  # cancelled before its first step: it never ran
        if op == "put":
            self._unknown(keys)  # placed to its end, or refused for room
        elif op == "delete":
            self._deleted(keys)
        elif op == "clear":
            self._deleted(list(CONTENT))

    @rule(run=runs, turn=turns, whole=st.booleans())
    def put_racing_a_delete(self, run: tuple[int, int], turn: int, whole: bool) -> None:
        """A put, then after ``turn`` loop turns a delete of its blocks (or a clear) while it may still be placing.

        With ``turn`` 0 the delete comes first (the put has not run its first step): the put is the newer and its
        blocks stay. Otherwise the put began first and the delete wins, however far the put had got.
        """
        i, j = run
        keys = [block_key(NS, h) for h in HASHES[i:j]]

        async def go() -> None:
            put = asyncio.ensure_future(self.store.put(NS, HASHES[i:j], BLOCKS[i:j]))
            for _ in range(turn):
                await asyncio.sleep(0)
            if whole:
                await self.store.clear(NS)
            else:
                await self.store.delete(NS, HASHES[i:j])
            try:
                await put
            except ResourceExhaustedError:
                pass

        self.run(go())
        if whole:
            others = [key for key in CONTENT if key not in keys]
            self._deleted(others)
        if turn == 0:
            self._unknown(keys)  # the newer put: stored, unless refused for room
            if not whole:
                self.deleted.difference_update(keys)
        else:
            self._deleted(keys)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def agrees_with_the_model(self) -> None:
        if self.store is None:
            return
        store = self.store
        problems = self.run(tier_and_index_disagree(store))  # drains first
        assert not problems, problems
        found = {key for key, h in zip(CONTENT, HASHES) if self.run(store.lookup(NS, [h])).num_blocks}
        assert not found & self.deleted, "a block a completed delete or clear removed is reported"
        missing = self.stored - found
        assert len(missing) <= self.dropped_before + dropped(store), (
            f"{len(missing)} stored blocks are missing, {self.dropped_before + dropped(store)} drops counted")


MODEL_SETTINGS = settings(max_examples=int(os.environ.get("KVSTORE_MODEL_EXAMPLES", "25")), stateful_step_count=25,
                          deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_memory_and_disk_agree_with_the_model() -> None:
    run_state_machine_as_test(StoreModel, settings=MODEL_SETTINGS)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["write_through", "write_back"])
def test_memory_disk_and_redis_agree_with_the_model(redis_server: RedisProcess, mode: str) -> None:  # noqa: F811
    class WithRedis(StoreModel):
        pass

    WithRedis.redis_url = redis_server.url
    WithRedis.mode = mode

    def flush() -> None:
        with redis_server.client() as client:
            client.flushall()

    class Fresh(WithRedis):
        def __init__(self) -> None:
            flush()  # each example starts with an empty Redis
            super().__init__()

    run_state_machine_as_test(Fresh, settings=settings(MODEL_SETTINGS, max_examples=max(2, MODEL_SETTINGS.max_examples // 2)))
