"""The connector's events without an engine: a real vLLM ``Request`` (vLLM's block hasher) and a real store's
event log, turned into vLLM's events as the scheduler's ``take_events`` returns them."""

from __future__ import annotations

from pathlib import Path

from vllm import SamplingParams
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request

from kvstore.connectors.vllm.events import MEDIUM_PREFIX, ConnectorEvents
from kvstore.events.log import EventLog
from kvstore.keys import Namespace, hash_blocks
from kvstore.store.tiered import TieredStore
from kvstore.tiers.lmdb import LMDBTier
from tests.support.store import disk_footprint, make_blocks, memory_tier

VLLM_BLOCK = 4
NS = Namespace(model="test-model", dtype="float16", block_size=2 * VLLM_BLOCK)  # a kvstore block: 2 vLLM blocks
_, BLOCKS = make_blocks(4, seed=1, ns=NS)


def request(num_tokens: int, seed: int = 0) -> Request:
    init_none_hash(sha256_cbor)
    tokens = [(seed * 7919 + i * 31) % 30000 for i in range(num_tokens)]
    return Request(f"r{seed}", tokens, SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(VLLM_BLOCK, sha256_cbor))


def external(req: Request) -> list[object]:
    """The request's block hashes as vLLM's events carry them (ints unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    return [maybe_convert_block_hash(h) for h in req.block_hashes]


def node_events(log: EventLog) -> list[object]:
    return log.take(1 << 20)


async def test_saved_blocks_are_announced_when_the_node_stores_them_and_removed_when_it_lets_them_go(
        tmp_path: Path) -> None:
    req = request(4 * NS.block_size + 1)
    kv_hashes = hash_blocks(NS, req.all_token_ids[:4 * NS.block_size])
    events = ConnectorEvents(VLLM_BLOCK, NS.block_size)
    events._follows = True  # as with events_target, without the thread: the test feeds the node's events
    log = EventLog()
    store = TieredStore([memory_tier(3), LMDBTier(tmp_path / "disk", 5 * disk_footprint())], events=log)
    await store.start()
    try:
        events.apply(node_events(log))  # the node's start: a clear, before this engine saved anything
        events.saved(req, [NS.tag], 0, [kv_hashes])
        assert events.take() == []  # nothing until the node has them
        await store.put(NS, kv_hashes, BLOCKS)  # 4 blocks into 3: one moves down to disk
        await store.drain()
        events.apply(node_events(log))
        stored = events.take()
        assert all(isinstance(e, BlockStored) for e in stored)
        assert [h for e in stored for h in e.block_hashes] == external(req)[:8]  # vLLM's, in prefix order
        assert [e.parent_block_hash for e in stored] == [None, *external(req)[1:7:2]]
        assert [e.token_ids for e in stored] == [req.all_token_ids[i * 8:(i + 1) * 8] for i in range(4)]
        tiers = [store.tier_names[store.index.level_of(NS.tag + h)] for h in kv_hashes]  # type: ignore[index]
        assert "disk" in tiers and "memory" in tiers
        assert [e.medium for e in stored] == [f"{MEDIUM_PREFIX}:{t}" for t in tiers]  # where the node holds each
        assert all(e.block_size == VLLM_BLOCK and e.locality == "REMOTE" for e in stored)

        await store.delete(NS, kv_hashes[3:])
        events.apply(node_events(log))
        (removed,) = events.take()
        assert isinstance(removed, BlockRemoved) and removed.block_hashes == external(req)[6:8]

        await store.clear(NS)
        events.apply(node_events(log))
        gone = events.take()
        assert sorted(h for e in gone for h in e.block_hashes) == sorted(external(req)[:6])
        assert all(isinstance(e, BlockRemoved) for e in gone)
        events.apply(node_events(log))
        assert events.take() == []
    finally:
        await store.close()


def test_without_the_nodes_stream_blocks_are_announced_at_save_time() -> None:
    req = request(2 * NS.block_size + 3, seed=2)
    events = ConnectorEvents(VLLM_BLOCK, NS.block_size)
    events.saved(req, [NS.tag], 0, [hash_blocks(NS, req.all_token_ids[:2 * NS.block_size])])
    stored = events.take()
    assert [h for e in stored for h in e.block_hashes] == external(req)[:4]
    assert {e.medium for e in stored} == {MEDIUM_PREFIX}


def test_a_restart_of_the_node_and_the_oldest_past_the_bound_are_announced_removed() -> None:
    from kvstore.events.schema import AllBlocksCleared
    from kvstore.events.schema import BlockStored as NodeStored

    events = ConnectorEvents(VLLM_BLOCK, NS.block_size, max_tracked_blocks=2)
    events._follows = True
    reqs = [request(NS.block_size + 1, seed=10 + i) for i in range(3)]
    hashes = [hash_blocks(NS, r.all_token_ids[:NS.block_size])[0] for r in reqs]
    for r, h in zip(reqs[:2], hashes):
        events.saved(r, [NS.tag], 0, [[h]])
    events.apply([NodeStored(block_hashes=hashes[:2], parent_block_hash=None, token_ids=[], block_size=0,
                             lora_id=None, medium="memory", lora_name=None, namespace=NS.tag)])
    assert len(events.take()) == 2
    events.saved(reqs[2], [NS.tag], 0, [[hashes[2]]])  # a third: the oldest is forgotten, and announced removed
    (removed,) = events.take()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == external(reqs[0])[:2]
    events.apply([AllBlocksCleared(reason="start")])
    (removed,) = events.take()  # the third was never stored: nothing to remove
    assert removed.block_hashes == external(reqs[1])[:2]


def fold(view: dict[object, str | None], events: list[object]) -> dict[object, str | None]:
    """A router's index of vLLM's events, ``{vLLM block hash: medium}``: a store sets it, a removal in that
    medium drops it."""
    for event in events:
        if isinstance(event, BlockStored):
            for h in event.block_hashes:
                view[h] = event.medium
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                if view.get(h) == event.medium:
                    del view[h]
    return view


def node_view(store: TieredStore, req: Request, tags_and_hashes: list[tuple[bytes, list[bytes]]]) -> dict:
    """What the router must see: each vLLM block of a kvstore block every rank's shard of which the node holds,
    in the tier of the first rank's shard."""
    expected = {}
    hashes = external(req)
    for i in range(len(tags_and_hashes[0][1])):
        levels = [store.index.level_of(tag + chain[i]) for tag, chain in tags_and_hashes]
        if all(level is not None for level in levels):
            for h in hashes[2 * i:2 * i + 2]:
                expected[h] = f"{MEDIUM_PREFIX}:{store.tier_names[levels[0]]}"  # type: ignore[index]
    return expected


async def test_demotions_and_promotions_move_the_blocks_medium(tmp_path: Path) -> None:
    req = request(2 * NS.block_size + 1, seed=3)
    kv_hashes = hash_blocks(NS, req.all_token_ids[:2 * NS.block_size])
    other_hashes, other_blocks = make_blocks(3, seed=4, ns=NS)
    events = ConnectorEvents(VLLM_BLOCK, NS.block_size)
    events._follows = True
    log = EventLog()
    store = TieredStore([memory_tier(3), LMDBTier(tmp_path / "disk", 8 * disk_footprint())], events=log)
    await store.start()
    view: dict[object, str | None] = {}
    try:
        events.apply(node_events(log))
        events.saved(req, [NS.tag], 0, [kv_hashes])
        await store.put(NS, kv_hashes, BLOCKS[:2])
        await store.drain()
        events.apply(node_events(log))
        first = events.take()
        assert fold(view, first) == node_view(store, req, [(NS.tag, kv_hashes)])
        assert set(view.values()) == {f"{MEDIUM_PREFIX}:memory"}

        await store.put(NS, other_hashes, other_blocks)  # three others into a memory tier of three: ours go to disk
        await store.drain()
        events.apply(node_events(log))
        moved = events.take()
        assert fold(view, moved) == node_view(store, req, [(NS.tag, kv_hashes)])
        assert f"{MEDIUM_PREFIX}:disk" in set(view.values()) and len(view) == 4
        removed = [e for e in moved if isinstance(e, BlockRemoved)]
        stored = [e for e in moved if isinstance(e, BlockStored)]
        assert moved == [*removed, *stored]  # gone from memory first, then stored on disk
        assert {e.medium for e in removed} == {f"{MEDIUM_PREFIX}:memory"}
        assert stored and len(stored) == len(removed)
        before = {tuple(e.block_hashes): e for e in first}
        for again in stored:  # the same block announced again: same hashes, parent and tokens
            was = before[tuple(again.block_hashes)]
            assert again.medium == f"{MEDIUM_PREFIX}:disk" and (again.block_hashes, again.parent_block_hash, again.token_ids, again.block_size) == \
                (was.block_hashes, was.parent_block_hash, was.token_ids, was.block_size)

        assert len(await store.get(NS, kv_hashes)) == 2  # hits on disk: promoted back to memory
        await store.drain()
        events.apply(node_events(log))
        promoted = events.take()
        assert fold(view, promoted) == node_view(store, req, [(NS.tag, kv_hashes)])
        assert {e.medium for e in promoted if isinstance(e, BlockStored)} == {f"{MEDIUM_PREFIX}:memory"}
        assert {e.medium for e in promoted if isinstance(e, BlockRemoved)} == {f"{MEDIUM_PREFIX}:disk"}
    finally:
        await store.close()


async def test_with_two_ranks_a_block_is_announced_once_both_shards_are_stored_and_removed_with_either() -> None:
    ns1 = Namespace(model=NS.model, dtype=NS.dtype, block_size=NS.block_size, tp_size=2, tp_rank=1)
    ns0 = Namespace(model=NS.model, dtype=NS.dtype, block_size=NS.block_size, tp_size=2, tp_rank=0)
    req = request(2 * NS.block_size + 1, seed=5)
    chains = [hash_blocks(ns, req.all_token_ids[:2 * NS.block_size]) for ns in (ns0, ns1)]
    shards = [make_blocks(2, seed=6 + r, ns=ns)[1] for r, ns in enumerate((ns0, ns1))]
    events = ConnectorEvents(VLLM_BLOCK, NS.block_size)
    events._follows = True
    log = EventLog()
    store = TieredStore([memory_tier(8)], events=log)
    await store.start()
    ranks = [(ns0.tag, chains[0]), (ns1.tag, chains[1])]
    view: dict[object, str | None] = {}
    try:
        events.apply(node_events(log))
        events.saved(req, [ns0.tag, ns1.tag], 0, chains)
        await store.put(ns0, chains[0], shards[0])  # the first rank's shards only: nothing to announce yet
        events.apply(node_events(log))
        assert events.take() == [] and node_view(store, req, ranks) == {}
        await store.put(ns1, chains[1][:1], shards[1][:1])  # the second rank's first shard: block 0 is complete
        events.apply(node_events(log))
        assert fold(view, events.take()) == node_view(store, req, ranks) and len(view) == 2
        await store.put(ns1, chains[1][1:], shards[1][1:])
        events.apply(node_events(log))
        assert fold(view, events.take()) == node_view(store, req, ranks) and len(view) == 4
        await store.delete(ns1, chains[1][:1])  # one rank's shard gone: the block is gone
        events.apply(node_events(log))
        assert fold(view, events.take()) == node_view(store, req, ranks) and len(view) == 2
        await store.clear(ns0)
        events.apply(node_events(log))
        assert fold(view, events.take()) == {} == node_view(store, req, ranks)
        assert len(events._saved) == 0  # every rank's key is forgotten
    finally:
        await store.close()


def test_the_connector_finds_the_nodes_stream_by_itself_and_announces_removals() -> None:
    """With only ``target`` set (no ``events_target``) the connector asks the node for its stream and follows it."""
    follow_the_nodes_stream(NS, BLOCKS, {})


def test_on_a_node_with_tokens_the_connector_follows_its_tenants_stream_with_its_token(tmp_path: Path) -> None:
    """A node with tokens sends events only to subscribers with a token: the connector subscribes with its own
    and follows the stream of its tenant (``docs/events.md``, "Trust model")."""
    import dataclasses

    from kvstore.keys import HashAlgorithm
    from tests.support.security import AUTH_TOKENS, TOKEN_A

    ns = dataclasses.replace(NS, cache_salt="tenant-a", hash_algorithm=HashAlgorithm.SHA256)
    _, blocks = make_blocks(1, seed=2, ns=ns)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN_A)
    follow_the_nodes_stream(ns, blocks, {"security.auth_tokens": AUTH_TOKENS}, token_file=str(token_file))


def follow_the_nodes_stream(ns: Namespace, blocks: list[bytes], overrides: dict[str, str], **connector: str) -> None:
    """A node with events (and ``overrides``); a connector with ``target`` (and ``connector``) set finds its
    stream, announces a put block when the node stored it and its removal when the node clears it."""
    import functools
    import time

    from kvstore.client import KVStoreClient
    from kvstore.connectors.vllm.config import VLLMConnectorConfig
    from kvstore.connectors.vllm.events import discover_streams
    from kvstore.security import bearer_metadata
    from tests.support.server import ThreadedServer, make_config

    server = ThreadedServer(make_config(**{"events.endpoint": "tcp://127.0.0.1:0", **overrides}))
    settings = VLLMConnectorConfig(target=server.target, **connector)
    token = settings.bearer_token()
    events = ConnectorEvents(VLLM_BLOCK, ns.block_size, streams=functools.partial(discover_streams, settings))
    got: list[object] = []

    def collected(condition, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got.extend(events.take())
            if condition():
                return True
            time.sleep(0.02)  # polling the event subscriber: events arrive from the node's publisher thread
        return False

    try:
        with KVStoreClient(server.target, retries=0, metadata=bearer_metadata(token) if token else ()) as kv:
            for seed in range(100, 200):  # until the connector has subscribed: the first put it sees announced
                req = request(ns.block_size + 1, seed=seed)
                hashes = hash_blocks(ns, req.all_token_ids[:ns.block_size])
                events.saved(req, [ns.tag], 0, [hashes])
                kv.put(ns, hashes, blocks[:1])
                if collected(lambda: bool(got), 1.0):
                    break
            stored = [e for e in got if isinstance(e, BlockStored)]
            assert stored and {e.medium for e in stored} == {f"{MEDIUM_PREFIX}:memory"}
            kv.clear(ns)
            announced = {h for e in stored for h in e.block_hashes}
            assert collected(lambda: {h for e in got if isinstance(e, BlockRemoved) for h in e.block_hashes}
                             == announced, 20)
    finally:
        events.close()
        server.stop()


def test_when_the_nodes_publish_no_events_blocks_are_announced_at_save_time() -> None:
    events = ConnectorEvents(VLLM_BLOCK, NS.block_size, streams=lambda: [])
    req = request(NS.block_size + 1, seed=7)
    events.saved(req, [NS.tag], 0, [hash_blocks(NS, req.all_token_ids[:NS.block_size])])
    events.close()  # the thread found no stream: what waited is announced, and saves are announced from now
    req2 = request(NS.block_size + 1, seed=8)
    events.saved(req2, [NS.tag], 0, [hash_blocks(NS, req2.all_token_ids[:NS.block_size])])
    taken = events.take()
    assert [e.block_hashes for e in taken] == [external(req)[:2], external(req2)[:2]]
    assert {e.medium for e in taken} == {MEDIUM_PREFIX} and all(e.token_ids for e in taken)
