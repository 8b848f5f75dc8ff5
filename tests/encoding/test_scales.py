"""Poisoned scales (issue 39): a lossy block whose scales section holds NaN, Inf, a huge or a negative value, with a
valid checksum, is refused at every put path (embedded, gRPC Put, same-host PutShared) with INVALID_ARGUMENT
naming the field, is a miss when it sits poisoned in LMDB or Redis, and is never decoded: no non-finite value
comes back from any stored block."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Iterator

import lmdb
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.blocks.tensors import decode_block, decode_header, verify_block
from kvstore.config import DiskTierConfig, MemoryTierConfig, RedisTierConfig, StoreConfig
from kvstore.embedded import EmbeddedStore
from kvstore.blocks.encoding import Encoding, encode_lossy
from kvstore.blocks.encoding.blocks import decode_block_into, plan_of
from kvstore.blocks.encoding.scales import check_scales
from kvstore.blocks.encoding.spec import scales_plan
from kvstore.errors import BadScalesError, InvalidArgumentError
from kvstore.keys import block_key, hash_blocks
from kvstore.validation import check_block
from tests.support.poison import POISONS, SHAPE, poisoned, random_blocks, reseal
from tests.support.redis import RedisProcess, redis_server  # noqa: F401
from tests.support.server import ThreadedServer, make_config, namespace

@pytest.mark.parametrize("poison", list(POISONS), ids=list(POISONS))
@pytest.mark.parametrize("encoding", list(Encoding), ids=lambda e: e.value)
def test_a_poisoned_scale_is_refused_by_the_block_check_and_never_decoded(encoding: Encoding, poison: str) -> None:
    value, dtype = POISONS[poison], torch.bfloat16
    if encoding.grouped and poison == "huge":  # float16 scales: a finite one whose 15 steps overflow float16
        value, dtype = 6e4, torch.float16
    block = poisoned(encoding, value, random_blocks(1)[0].to(dtype))
    header = verify_block(block)  # the checksum is valid: only the scales check sees it
    ns = namespace(dtype=str(dtype).removeprefix("torch."), kv_encoding=encoding.value)
    field = ("K scale" if encoding.grouped else "row scale")
    with pytest.raises(BadScalesError, match=f"block 3: scales section: {field}"):
        check_block(ns, 3, block, 1 << 30)
    assert isinstance(BadScalesError("x"), InvalidArgumentError)
    with pytest.raises(BadScalesError, match="scales section"):
        decode_block(block)
    destination = torch.full(SHAPE, 7.0, dtype=dtype)
    with pytest.raises(BadScalesError):
        decode_block_into(block, header, destination)
    assert bool((destination == 7.0).all())  # nothing written


@pytest.mark.parametrize("encoding", list(Encoding), ids=lambda e: e.value)
def test_every_byte_of_the_codes_decodes_finite_under_the_largest_scale_allowed(encoding: Encoding) -> None:
    """The bound is tight enough: every code byte (e4m3's NaN bytes, int8's -128 included) under a scale at the
    check's limit decodes to finite values in float16, the narrowest dtype."""
    x = torch.randn(SHAPE).to(torch.float16)
    block = encode_lossy(x, "kv", encoding)
    header = decode_header(block)
    plan = plan_of(header)
    start = header.header_nbytes
    data = start + plan.data_offset
    block[data:data + plan.data_nbytes] = bytes(range(256)) * (plan.data_nbytes // 256) + bytes(
        range(plan.data_nbytes % 256))
    if encoding.version == 2:
        rows = scales_plan(encoding, "kv", SHAPE).rows
        limit = 65504.0 / encoding.code_span
        for row in range(rows):
            struct.pack_into("<f", block, start + 4 * row, limit * (1 - 2.0 ** -20))
        if encoding.asymmetric:  # the zero points at their extremes too
            sp = scales_plan(encoding, "kv", SHAPE)
            zeros = bytes([0x80, 0x7F]) * (sp.num_groups // 2)
            block[start + sp.zeros_offset:start + sp.zeros_offset + len(zeros)] = zeros
    elif not encoding.grouped:
        for row in range(SHAPE[0] * SHAPE[1] * SHAPE[2]):
            struct.pack_into("<f", block, start + 4 * row, 65504.0 / encoding.code_span * (1 - 2.0 ** -20))
    reseal(block)
    check_scales(verify_block(block), block)
    assert bool(torch.isfinite(decode_block(block)).all())


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    threaded = ThreadedServer(make_config())
    yield threaded
    threaded.stop()


@pytest.mark.parametrize("path", ["embedded", "grpc", "shared-memory"])
def test_every_put_path_refuses_a_poisoned_block_naming_the_field(server: ThreadedServer, path: str) -> None:
    ns = namespace(dtype="bfloat16", kv_encoding="int8_v2")
    good = [encode_lossy(t, "kv", "int8_v2") for t in random_blocks(3, seed=2)]
    blocks = [good[0], poisoned(Encoding.INT8_V2, float("nan")), good[2]]
    hashes = hash_blocks(ns, range(48))
    if path == "embedded":
        with EmbeddedStore(StoreConfig(memory=MemoryTierConfig(capacity_bytes=16 << 20))) as store:
            with pytest.raises(BadScalesError, match="block 1: scales section: row scale 1 is nan"):
                store.put(ns, hashes, blocks)
            assert store.lookup(ns, hashes).num_blocks == 0
        return
    with KVStoreClient(server.target, timeout_s=30.0, retries=0, shared_memory=path == "shared-memory") as kv:
        with pytest.raises(InvalidArgumentError, match="block 1: scales section: row scale 1 is nan"):
            kv.put(ns, hashes, blocks)
        assert kv.lookup(ns, hashes).num_blocks == 0
        assert kv.put(ns, hashes[:1], good[:1]) == 1  # the node still takes good blocks
        assert bool(torch.isfinite(kv.get_tensors(ns, hashes[:1])[0]).all())


def test_a_block_poisoned_on_disk_is_a_miss(tmp_path: Path) -> None:
    """A block with a valid checksum whose scale was poisoned in data.mdb (as a node without the check might
    have stored it) is not served after a restart: the prefix stops before it, and no value is non-finite."""
    ns = namespace(dtype="bfloat16", kv_encoding="int8_v2")
    tensors = random_blocks(3, seed=3)
    hashes = hash_blocks(ns, range(48))
    config = StoreConfig(memory=MemoryTierConfig(capacity_bytes=16 << 20),
                         disk=DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=256 << 20))
    with EmbeddedStore(config) as store:
        assert store.put(ns, hashes, tensors) == 3
        store.drain()
    key = bytes(block_key(ns, hashes[1]))
    env = lmdb.open(str(tmp_path / "disk"), max_dbs=8, subdir=True)
    try:
        blocks_db = env.open_db(b"blocks")
        with env.begin(write=True, db=blocks_db) as txn:
            record = bytearray(txn.get(key))
            block = record[:-len(key)]
            start = decode_header(bytes(block)).header_nbytes
            struct.pack_into("<f", block, start + 4, float("inf"))
            reseal(block)
            txn.put(key, bytes(block) + key)
    finally:
        env.close()
    config = StoreConfig(memory=MemoryTierConfig(capacity_bytes=16 << 20),
                         disk=DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=256 << 20))
    with EmbeddedStore(config) as store:
        back = store.get_tensors(ns, hashes)
        assert len(back) == 1 and bool(torch.isfinite(back[0]).all())
        assert store.lookup(ns, hashes[:1]).num_blocks == 1


def test_a_block_poisoned_in_redis_is_a_miss(redis_server: RedisProcess) -> None:  # noqa: F811
    ns = namespace(dtype="bfloat16", kv_encoding="int4_v2")
    tensors = random_blocks(2, seed=4)
    hashes = hash_blocks(ns, range(32))

    def config() -> StoreConfig:
        return StoreConfig(memory=MemoryTierConfig(capacity_bytes=16 << 20),
                           redis=RedisTierConfig(url=redis_server.url, mode="write_through"))

    with EmbeddedStore(config()) as writer:
        assert writer.put(ns, hashes, tensors) == 2
        writer.drain()
    client = redis_server.client()
    keys = sorted(k for k in client.scan_iter(match=f"*:{ns.tag.hex()}:*") if not k.endswith(b":generation"))
    assert len(keys) == 2
    target = next(k for k in keys if k.endswith(hashes[0].hex().encode()))
    block = bytearray(client.get(target))
    start = decode_header(bytes(block)).header_nbytes
    struct.pack_into("<f", block, start, float("nan"))
    client.set(target, bytes(reseal(block)))
    with EmbeddedStore(config()) as reader:
        assert reader.get_tensors(ns, hashes) == []
        assert reader.get(ns, hashes) == []
