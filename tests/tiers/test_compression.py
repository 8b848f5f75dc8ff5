"""Lossless compression of the LMDB and Redis tiers: the tier contract with it on, the same bytes back across
restarts (on, off, another codec), and a damaged frame counted as corruption, never served."""

from __future__ import annotations

import random

import pytest
import torch

from kvstore.blocks.tensors import encode_block, verify_block
from kvstore.config import RedisTierConfig
from kvstore.blocks.encoding import encode_lossy
from kvstore.errors import CodecError
from kvstore.tiers.compression import Codec, Compressor, is_frame, logical_nbytes, unpack, unpack_or_keep
from kvstore.tiers.lmdb import LMDBTier
from kvstore.tiers.redis import RedisTier
from tests.support.redis import RedisProcess, redis_binaries, redis_server  # noqa: F401 - fixture by name
from tests.support.tier_contract import TierContract, make_key, meta

MiB = 1 << 20
CODECS = [Codec.BLOSC2, Codec.ZSTD, Codec.LZ4]


def kv_block(seed: int, dtype: torch.dtype = torch.bfloat16) -> bytes:
    """A bf16 block with KV's structure: values of a few magnitudes per channel (exponents repeat)."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.rand(1, 1, 1, 1, 64, generator=generator) * 4
    return encode_block((torch.randn(2, 2, 4, 16, 64, generator=generator) * scale).to(dtype))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.value)
def test_frames_round_trip_exactly_and_are_smaller(codec: Codec) -> None:
    compressor = Compressor(codec)
    for block, must_shrink in ((kv_block(1), True), (kv_block(2, torch.float16), False),
                               (kv_block(3, torch.float32), False),
                               (bytes(encode_lossy(torch.zeros(2, 2, 4, 16, 64), "kv", "int8")), True)):
        frame = compressor.pack(block)  # fp16's exponent straddles its bytes: lz4 may not save 3 % of it
        assert is_frame(frame) or not must_shrink
        assert not is_frame(frame) or len(frame) < 0.97 * len(block)
        assert unpack(frame) == block and logical_nbytes(frame) == len(block)
    noise = encode_block(torch.randint(0, 256, (1, 2, 1, 1, 4096), dtype=torch.uint8))
    assert compressor.pack(noise) is noise  # incompressible: stored as it is
    assert unpack(noise) is noise


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.value)
def test_every_damaged_frame_fails_as_corruption(codec: Codec) -> None:
    frame = Compressor(codec).pack(kv_block(4))
    rng = random.Random(codec.value)
    for position in list(range(24)) + rng.sample(range(24, len(frame)), 48):
        damaged = bytearray(frame)
        damaged[position] ^= 1 << rng.randrange(8)
        with pytest.raises(CodecError):
            verify_block(unpack_or_keep(bytes(damaged)))
    with pytest.raises(CodecError):
        unpack(frame[:20])


class TestCompressedLMDBContract(TierContract):
    @pytest.fixture
    async def tier(self, tmp_path):
        tier = LMDBTier(tmp_path / "env", 4 * MiB, compressor=Compressor(Codec.BLOSC2))
        yield tier
        await tier.close()


async def test_lmdb_returns_the_same_bytes_across_restarts_whatever_the_setting(tmp_path) -> None:
    path = tmp_path / "env"
    keys = [make_key(i) for i in range(4)]
    blocks = [kv_block(10 + i) for i in range(4)]
    tier = LMDBTier(path, 4 * MiB, compressor=Compressor(Codec.ZSTD))
    await tier.put(keys[:2], blocks[:2], [meta()] * 2)
    compressed_bytes = tier.used_bytes
    await tier.close()
    tier = LMDBTier(path, 4 * MiB)  # off: frames already stored are still read
    await tier.put(keys[2:], blocks[2:], [meta()] * 2)
    assert await tier.get(keys) == blocks
    await tier.close()
    tier = LMDBTier(path, 4 * MiB, compressor=Compressor(Codec.BLOSC2))
    assert await tier.get(keys) == blocks
    entries = {entry.key: entry.nbytes for entry in await tier.resident()}
    assert set(entries) == set(keys)
    # what each record stores, as the store counts it against the capacity: the frames, then the blocks put with
    # compression off
    frames = [Compressor(Codec.ZSTD).pack(b) for b in blocks[:2]]
    assert [entries[k] for k in keys] == [len(frames[0]), len(frames[1]), len(blocks[2]), len(blocks[3])]
    assert all(map(is_frame, frames))
    assert 0 < compressed_bytes < sum(map(len, blocks[:2]))  # what the file holds: the frames
    await tier.close()


async def test_lmdb_counts_a_damaged_frame_as_a_corrupt_record(tmp_path) -> None:
    import lmdb

    path = tmp_path / "env"
    tier = LMDBTier(path, 4 * MiB, compressor=Compressor(Codec.LZ4))
    key = make_key(7)
    await tier.put([key], [kv_block(7)], [meta()])
    await tier.close()
    env = lmdb.open(str(path), max_dbs=3)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True, db=blocks) as txn:
        record = bytearray(txn.get(key))
        assert record[:4] == b"KVZ\x01"
        record[40] ^= 0x10
        txn.put(key, bytes(record))
    env.close()
    tier = LMDBTier(path, 4 * MiB, compressor=Compressor(Codec.LZ4))
    assert await tier.get([key]) == [None]
    assert tier.counters()["corrupt_records"] == 1
    await tier.close()


@pytest.mark.skipif(redis_binaries() is None, reason="redis-server not installed")
class TestCompressedRedis:
    @pytest.fixture
    async def tier(self, redis_server: RedisProcess):  # noqa: F811
        tier = RedisTier(RedisTierConfig(url=redis_server.url, compression="blosc2", connect_timeout_s=2.0,
                                         socket_timeout_s=2.0))
        yield tier
        await tier.close()

    async def test_values_are_frames_and_come_back_as_the_blocks(self, tier: RedisTier,
                                                                 redis_server: RedisProcess) -> None:  # noqa: F811
        keys = [make_key(i) for i in range(3)]
        blocks = [kv_block(20 + i) for i in range(3)]
        assert await tier.put(keys, blocks, [meta()] * 3) == [True] * 3
        with redis_server.client() as client:
            stored = [client.get(tier.redis_key(k)) for k in keys]
        assert all(is_frame(v) and len(v) < len(b) for v, b in zip(stored, blocks))
        assert await tier.get(keys) == blocks
        plain = RedisTier(RedisTierConfig(url=redis_server.url))  # another node, compression off, reads them
        try:
            assert await plain.get(keys) == blocks
        finally:
            await plain.close()

    async def test_a_damaged_frame_is_a_miss_deleted_and_counted(self, tier: RedisTier,
                                                                  redis_server: RedisProcess) -> None:  # noqa: F811
        good, bad = make_key(1), make_key(2)
        await tier.put([good, bad], [kv_block(1), kv_block(2)], [meta()] * 2)
        with redis_server.client() as client:
            value = bytearray(client.get(tier.redis_key(bad)))
            value[30] ^= 0x01
            client.set(tier.redis_key(bad), bytes(value))
        assert await tier.get([good, bad]) == [kv_block(1), None]
        assert tier.counters()["corrupt_records"] == 1
        with redis_server.client() as client:
            assert client.exists(tier.redis_key(bad)) == 0


@pytest.mark.skipif(redis_binaries() is None, reason="redis-server not installed")
async def test_a_compressing_redis_holds_more_blocks_in_the_same_maxmemory() -> None:
    """Redis counts what it stores against ``maxmemory``: frames, so more blocks fit where they compress."""
    generator = torch.Generator().manual_seed(3)
    blocks = [encode_block((torch.randint(-4, 4, (8, 2, 4, 16, 128), generator=generator) / 4).to(torch.float16))
              for _ in range(12)]  # 512 KiB each, few distinct values (as quantized KV): they compress well
    keys = [make_key(i) for i in range(12)]
    held = {}
    for codec in ("none", "zstd"):
        with RedisProcess(maxmemory_bytes=4 * MiB, maxmemory_policy="noeviction") as server:
            tier = RedisTier(RedisTierConfig(url=server.url, compression=codec, connect_timeout_s=10.0,
                                             socket_timeout_s=10.0))  # a loaded machine: no timeout for a miss
            try:
                stored = []
                for key, block in zip(keys, blocks):  # one at a time: the server checks memory before each write
                    stored += await tier.put([key], [block], [meta()])
                written = [k for k, ok in zip(keys, stored) if ok]
                assert await tier.get(written) == [b for b, ok in zip(blocks, stored) if ok]
                held[codec] = len(written)
                counts = tier.counters()
                assert counts["errors"] == 0, counts
                assert counts["written_logical_bytes"] == len(written) * 8 * 2 * 4 * 16 * 128 * 2  # the tensors'
                with server.client() as client:
                    assert counts["written_stored_bytes"] == sum(len(client.get(tier.redis_key(k))) for k in written)
            finally:
                await tier.close()
    assert held["none"] < 8 and held["zstd"] == 12, held  # 6 MiB of blocks: only the frames fit in 4 MiB
