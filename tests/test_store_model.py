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

``IndexStepsModel`` drives the index's steps themselves (``Index.prepare_put`` / ``complete_put`` and
``prepare_read`` / ``complete_read``, and a move's ``complete_put`` with its sources), synchronously: hypothesis
draws which prepared step completes next, and deletes, clears and evictions between them, and every complete step is checked against a dict model: a stale
placement publishes nothing, and a read returns exactly the prefix resident when it was prepared, up to its first
lost block, with the still-current lost blocks forgotten.

``AgenticStoreModel`` runs the same rules with TTLs and sessions in the mix, on a clock the test moves: a pinned
block is never a victim while an unpinned one of its tier is not in use; a get renews the TTLs it hits; a TTL that
ran out is gone once the tier expires them; and a restart (memory flushed to disk, the index rebuilt from LMDB)
keeps every TTL still running.
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

from kvstore.config import PinsConfig, StoreConfig
from kvstore.errors import ResourceExhaustedError
from kvstore.store.index import Entry, Index, PutStep, ReadStep
from kvstore.keys import block_key
from kvstore.policy import make_policy
from kvstore.store.tiered import TieredStore
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
        located = self.run(self.store.lookup(NS, HASHES[i:j])).num_blocks  # the store is drained: nothing moves
        got = self.run(self.store.get(NS, HASHES[i:j]))
        assert len(got) == located, f"a get of blocks {i}..{j} returned {len(got)}, the cached prefix is {located}"
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


KEYS = list(CONTENT)
FOOTPRINT = 100  # capacity bytes per block, in the index model: the tiers never fill


class IndexStepsModel(RuleBasedStateMachine):
    """The index's prepare and complete steps, in orders hypothesis draws, against a dict model (no I/O, no loop)."""

    def __init__(self) -> None:
        super().__init__()
        policies = [make_policy("default", capacity_bytes=1 << 20, demotes=True), make_policy("default",
                                                                                            capacity_bytes=1 << 20)]
        self.index = Index(policies, [1 << 20, 1 << 20], lambda: 0.0)
        self.resident: dict[bytes, int] = {}  # key -> tier, the model
        self.puts: list[tuple[PutStep, list[bytes], int | None]] = []  # prepared; the tier once charged
        self.reads: list[tuple[ReadStep, list[bytes], list[bytes | None]]] = []  # with the model's prefix at prepare
        self.moves: list[tuple[Entry, Entry, int]] = []  # a held source, its copy's placement, the copy's tier
        self.current: dict[int, bool] = {}  # id(entry) -> whether no delete, clear or eviction removed it since
        self.moved: set[int] = set()  # ids of sources moved out: their last reference deletes their record
        self.entries: list[Entry] = []  # every entry seen, kept alive, so that no id above is reused
        self.evicted = 0

    @initialize(split=st.integers(0, NUM_BLOCKS))
    def start(self, split: int) -> None:
        """Every block resident: the first ``split`` in tier 0, the rest in tier 1."""
        self.put((0, split), 0)
        self.put((split, NUM_BLOCKS), 1)

    def _retire(self, keys: list[bytes]) -> None:
        for step, _, _ in self.puts:
            for entry in step.entries:
                if entry.key in keys:
                    self.current[id(entry)] = False
        for step, _, _ in self.reads:
            for entry in step.held:
                if entry.key in keys:
                    self.current[id(entry)] = False
        for source, target, _ in self.moves:
            for entry in (source, target):
                if entry.key in keys:
                    self.current[id(entry)] = False

    def _release(self, entry: Entry) -> None:
        if self.index.release(entry):
            assert id(entry) in self.moved, "a last reference deleted a record only a move leaves to it"

    def _placing(self) -> dict[bytes, Entry]:
        placing = {e.key: e for step, _, _ in self.puts for e in step.entries if self.index.placing(e.key) is e}
        placing.update((t.key, t) for _, t, _ in self.moves if self.index.placing(t.key) is t)
        return placing

    @rule(key=st.sampled_from(KEYS))
    def prepare_move(self, key: bytes) -> None:
        """The mover's prepare of a copy into the other tier: the source held, the copy placed and charged."""
        level = self.resident.get(key)
        if level is None or key in self._placing() or self.index.leaving(level, key):
            return
        source = self.index.hold(level, key)
        target = self.index.place(key, 50, 0.0)
        self.index.charge([target], 1 - level, [FOOTPRINT])
        self.current.setdefault(id(source), True)  # a read may hold the same entry already
        self.current[id(target)] = True
        self.entries += (source, target)
        self.moves.append((source, target, 1 - level))

    @rule(data=st.data(), ok=st.booleans())
    def complete_move(self, data: st.DataObject, ok: bool) -> None:
        """A move's complete step: the source leaves its tier as its copy is published, if both are current."""
        if not self.moves:
            return
        source, target, level = self.moves.pop(data.draw(st.integers(0, len(self.moves) - 1)))
        moves = ok and self.current[id(source)] and self.current[id(target)]
        published, _ = self.index.complete_put([target], [ok], [source])
        assert published == ([target.key] if ok and self.current[id(target)] else [])
        if moves:
            self.moved.add(id(source))
            self.current[id(source)] = False
        if published:
            self.resident[target.key] = level
        self._release(source)

    @rule(run=runs, level=st.sampled_from([0, 1, None]))
    def prepare_put(self, run: tuple[int, int], level: int | None) -> None:
        """A put's prepare; charged to tier ``level`` at once, or (``None``) later, by :meth:`charge`."""
        keys = KEYS[run[0]:run[1]]
        placing = self._placing()
        step = self.index.prepare_put(keys, 50, 0.0)
        new = [i for i, key in enumerate(keys) if key not in self.resident and key not in placing]
        assert step.positions == new
        assert [e.key for e in step.entries] == [keys[i] for i in new]
        assert [id(e) for e in step.waits] == [id(placing[k]) for k in keys if k not in self.resident and k in placing]
        assert step.again == [i for i, k in enumerate(keys) if k in placing and not self.current[id(placing[k])]]
        for entry in step.entries:
            self.current[id(entry)] = True
        self.entries += step.entries
        self.puts.append((step, keys, None))
        if level is not None:
            self._charge(len(self.puts) - 1, level)

    @rule(run=runs, level=st.integers(0, 1))
    def put(self, run: tuple[int, int], level: int) -> None:
        """A put whose steps run with nothing in between."""
        keys = KEYS[run[0]:run[1]]
        placing = self._placing()
        step = self.index.prepare_put(keys, 50, 0.0)
        self.index.charge(step.entries, level, [FOOTPRINT] * len(step.entries))
        published, _ = self.index.complete_put(step.entries, [True] * len(step.entries))
        assert published == [k for k in keys if k not in self.resident and k not in placing]
        self.resident.update(dict.fromkeys(published, level))

    @rule(data=st.data(), level=st.integers(0, 1))
    def charge(self, data: st.DataObject, level: int) -> None:
        """The mover's prepare of a batch: the placements still current are charged to a tier (the rest ended)."""
        uncharged = [i for i, (_, _, tier) in enumerate(self.puts) if tier is None]
        if uncharged:
            self._charge(data.draw(st.sampled_from(uncharged)), level)

    def _charge(self, n: int, level: int) -> None:
        step, keys, _ = self.puts[n]
        step.entries = [e for e in step.entries if self.index.is_current(e)]
        assert all(self.current[id(e)] for e in step.entries)
        self.index.charge(step.entries, level, [FOOTPRINT] * len(step.entries))
        self.puts[n] = (step, keys, level)

    @rule(data=st.data())
    def complete_put(self, data: st.DataObject) -> None:
        if not self.puts:
            return
        n = data.draw(st.integers(0, len(self.puts) - 1))
        if self.puts[n][2] is None:
            self._charge(n, 0)  # the mover charges a batch before it writes it
        step, _, level = self.puts.pop(n)
        written = data.draw(st.lists(st.sampled_from([True, True, True, False]), min_size=len(step.entries),
                                     max_size=len(step.entries)))  # a tier refuses a block now and then
        others = {key: e.level for key, e in self._placing().items()}  # placements of other puts, by their tier
        published, stale = self.index.complete_put(step.entries, written)
        expected = [e.key for e, ok in zip(step.entries, written) if ok and self.current[id(e)]]
        assert published == expected, "a placement published what a delete or clear removed, or lost a current one"
        # every record written for nothing goes, unless a newer block of the key lives in that tier (its record)
        assert sorted(stale) == sorted(e.key for e in step.entries if e.key not in published
                                       and self.resident.get(e.key) != level and others.get(e.key) != level)
        for key in published:
            self.resident[key] = level  # type: ignore[assignment]

    @rule(data=st.data(), shared=st.booleans())
    def prepare_read(self, data: st.DataObject, shared: bool) -> None:
        """A read's prepare, from a resident block mostly (a read of nothing holds nothing)."""
        resident = [i for i, key in enumerate(KEYS) if key in self.resident]
        start = data.draw(st.sampled_from(resident) if resident and data.draw(st.booleans()) else
                          st.integers(0, NUM_BLOCKS - 1))
        keys = KEYS[start:start + data.draw(st.integers(1, 4))]
        step = self.index.prepare_read(keys, shared)
        prefix = 0
        while prefix < len(keys) and keys[prefix] in self.resident:
            prefix += 1
        levels = [self.resident[k] for k in keys[:prefix]]
        if shared and prefix < len(keys):
            levels += [self.resident.get(k) for k in keys[prefix:]]
        assert step.levels == levels
        assert [e.key for e in step.held] == [k for k, level in zip(keys, levels) if level is not None]
        for entry in step.held:
            self.current.setdefault(id(entry), True)  # a move may hold the same entry already
        self.entries += step.held
        # what the read will serve, by the model: the resident prefix, and past it the shared tier's blocks
        # (none here: the model has no shared tier), so the local blocks after a shared miss are read for nothing
        self.reads.append((step, keys, [k if level is not None else None for k, level in zip(keys, levels)]))

    @rule(data=st.data())
    def complete_read(self, data: st.DataObject) -> None:
        """A read's complete step, its tiers having lost a drawn set of the blocks it held."""
        if not self.reads:
            return
        step, keys, served = self.reads.pop(data.draw(st.integers(0, len(self.reads) - 1)))
        lost_keys = set(data.draw(st.lists(st.sampled_from(keys), max_size=3)))
        found = [None if key is None or key in lost_keys else key for key in served]
        hit = found.index(None) if None in found else len(found)
        lost = [e for e in step.held if e.key in lost_keys]
        records = self.index.complete_read(step, keys, hit, lost)
        gone = [e for e in lost if self.current[id(e)]]
        assert sorted(k for ks in records.values() for k in ks) == sorted(e.key for e in gone)
        for entry in gone:
            del self.resident[entry.key]
        for entry in gone:  # a lost block's entry retires; a copy of it being placed elsewhere goes on
            self.current[id(entry)] = False
        # the get rule: exactly the prefix resident at prepare, up to its first lost block
        expected = 0
        while expected < len(served) and served[expected] is not None and served[expected] not in lost_keys:
            expected += 1
        assert hit == expected
        for entry in step.held:
            self._release(entry)

    @rule(run=runs)
    def delete(self, run: tuple[int, int]) -> None:
        keys = KEYS[run[0]:run[1]]
        records, found = self.index.delete(keys)
        assert found == sum(k in self.resident for k in keys)
        assert sorted(k for ks in records.values() for k in ks) == sorted(k for k in keys if k in self.resident)
        for key in keys:
            self.resident.pop(key, None)
        self._retire(keys)

    @rule(now=st.integers(0, 3))
    def clear(self, now: int) -> None:
        if now:
            return  # a clear one time in four: it leaves nothing to read
        records, found = self.index.clear(NS.tag)
        assert found == len(self.resident)
        assert self.index.cleared_since(NS.tag, 0)
        self.resident.clear()
        self._retire(KEYS)

    @rule(key=st.sampled_from(KEYS))
    def evict(self, key: bytes) -> None:
        """An eviction of a block no read holds (a held block is no victim), counted."""
        level = self.resident.get(key)
        if level is None or self.index.held(level, key) is not None:
            return
        assert self.index.forget(level, key)
        del self.resident[key]
        self.evicted += 1

    @invariant()
    def agrees_with_the_model(self) -> None:
        index = self.index
        assert {k: index.level_of(k) for k in KEYS if index.level_of(k) is not None} == self.resident
        for level in (0, 1):
            assert index.policies[level].nbytes == FOOTPRINT * sum(v == level for v in self.resident.values())
        if not self.puts and not self.reads and not self.moves:
            assert index.num_entries() == 0, "an entry outlived every step that used it"
            assert all(index.used_bytes(level) == index.policies[level].nbytes for level in (0, 1))


class AgenticStoreModel(StoreModel):
    """:class:`StoreModel` with TTLs, sessions and a clock the test moves (the ``session`` policy, every pin allowed)."""

    def __init__(self) -> None:
        self.now = 1_000.0
        super().__init__()

    def open(self) -> TieredStore:
        config = StoreConfig(policy="session", pins=PinsConfig(max_tier_fraction=1.0))
        store = TieredStore([memory_tier(3), LMDBTier(self.path / "disk", 5 * disk_footprint(), clock=self.clock)],
                            config, clock=self.clock)
        self.run(store.start())
        store.index.reserve = self._checked_reserve(store)  # type: ignore[method-assign]
        return store

    def clock(self) -> float:
        return self.now

    @staticmethod
    def _checked_reserve(store: TieredStore):  # type: ignore[no-untyped-def]
        """The index's ``reserve``, checking the victims it claims: a pinned one only once no unpinned block of the
        tier is left out of use (the claimed victims are held by then)."""
        reserve = store.index.reserve

        def checked(level: int, nbytes: int) -> list[bytes]:
            victims = reserve(level, nbytes)
            policy = store.index.policies[level]
            if any(policy.is_pinned(key) for key in victims):
                others = [key for key in policy if not policy.is_pinned(key) and not policy.is_held(key)]
                assert not others, f"a pinned block was a victim while {len(others)} unpinned ones were not"
            return victims

        return checked

    @rule(run=runs, ttl=st.sampled_from([None, 5.0, 50.0]), session=st.sampled_from([None, "a", "b"]))
    def put_with_ttl(self, run: tuple[int, int], ttl: float | None, session: str | None) -> None:
        i, j = run
        keys = [block_key(NS, h) for h in HASHES[i:j]]
        bounded = self.store.sessions.bounded_puts
        try:
            self.run(self.store.put(NS, HASHES[i:j], BLOCKS[i:j], ttl_s=ttl, session_id=session))
        except ResourceExhaustedError:
            self._unknown(keys)
            return
        if self.store.sessions.bounded_puts > bounded:
            self._unknown(keys)  # the session policy stored the head of them only
        else:
            self._put_done(keys)

    @rule(run=runs, ttl=st.sampled_from([None, 20.0]), session=st.sampled_from([None, "a", "b"]))
    def get_with_ttl(self, run: tuple[int, int], ttl: float | None, session: str | None) -> None:
        i, j = run
        self.run(self.store.lookup(NS, HASHES[i:j], session_id=session))
        got = self.run(self.store.get(NS, HASHES[i:j], ttl_s=ttl))
        index = self.store.index
        for h in HASHES[i:i + len(got)]:
            key = block_key(NS, h)
            level = index.level_of(key)
            if level is None:
                continue  # promoted and evicted again by then: no longer cached
            ttl_s, until = index.policies[level].pin_of(key)
            if ttl_s and index.held(level, key) is None:
                assert until == self.now + ttl_s, "a hit did not renew the TTL from its time"

    @rule(seconds=st.sampled_from([1.0, 10.0, 60.0]))
    def advance(self, seconds: float) -> None:
        self.now += seconds

    @rule()
    def restart(self) -> None:
        """A restart keeps every TTL still running, with its end, for the blocks it keeps."""
        self.run(self.store.drain())
        before = {key: policy.pin_of(key) for policy in self.store.index.policies for key in policy
                  if policy.is_pinned(key) and policy.pin_of(key)[1] > self.now}
        super().restart()
        for key, (ttl_s, until) in before.items():
            level = self.store.index.level_of(key)
            if level is not None:
                assert self.store.index.policies[level].pin_of(key) == (ttl_s, until), "a restart lost a TTL"

    @invariant()
    def pins_are_evicted_last_and_expire(self) -> None:
        if self.store is None:
            return
        for policy in self.store.index.policies:
            policy.expire(self.now)
            order = list(policy)
            pinned = [policy.is_pinned(key) for key in order if not policy.is_held(key)]
            assert pinned == sorted(pinned), "an unpinned block comes after a pinned one in the eviction order"
            assert all(policy.pin_of(key)[1] > self.now for key in order if policy.is_pinned(key)), \
                "a TTL that ran out is still pinned"


MODEL_SETTINGS = settings(max_examples=int(os.environ.get("KVSTORE_MODEL_EXAMPLES", "25")), stateful_step_count=25,
                          deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_memory_and_disk_agree_with_the_model() -> None:
    run_state_machine_as_test(StoreModel, settings=MODEL_SETTINGS)


def test_ttls_and_sessions_agree_with_the_model() -> None:
    run_state_machine_as_test(AgenticStoreModel, settings=MODEL_SETTINGS)


@pytest.mark.slow
def test_the_index_steps_agree_with_the_model() -> None:
    run_state_machine_as_test(IndexStepsModel, settings=settings(MODEL_SETTINGS, max_examples=200,
                                                                 stateful_step_count=50))


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
