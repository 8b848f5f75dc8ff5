"""The Redis tier's corruption fuzzer: put blocks through a store whose only tier is Redis, damage the stored
values with a plain Redis client, read everything back and check every byte against digests kept here.

Damage (:data:`MODES`): byte flips anywhere in the values (1 to 1,000 in all), flips aimed at the header
(dtype, layout, flags, shape, checksum, padding), values cut short or extended, the format version changed,
values zeroed. A block whose value was not touched, with every block before it in its prefix, must be served;
a block served must be the one put. Values swapped between keys are outside this: a checksum proves a value
whole, not that whoever could write Redis put it under the right key (``docs/security.md``).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from kvstore.config import MemoryTierConfig, RedisTierConfig, StoreConfig
from kvstore.embedded import open_store
from kvstore.keys import Namespace, block_key
from kvstore.tiers.redis import RedisTier
from tests.support.disk_fuzz import chain_blocks, digest

MODES = ("flips", "header", "truncate", "extend", "version", "zero")


@dataclass
class RedisCounts:
    """What trials found; ``wrong_blocks`` and ``lost_blocks`` must stay 0."""

    trials: int = 0
    flips: int = 0
    values_damaged: int = 0
    blocks_checked: int = 0
    blocks_served: int = 0
    corrupt_records: int = 0
    wrong_blocks: int = 0
    lost_blocks: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, other: RedisCounts) -> None:
        for name, value in asdict(other).items():
            if name == "failures":
                self.failures.extend(other.failures)
            else:
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _damage(value: bytes, rng: random.Random, mode: str, budget: int) -> tuple[bytes, int]:
    """One damaged value, and how many bytes were flipped."""
    data = bytearray(value)
    if mode == "flips":
        offsets = [rng.randrange(len(data)) for _ in range(max(1, budget))]
    elif mode == "header":  # any byte of the 128-byte header: dtype, layout, flags, sizes, checksum, shape, padding
        offsets = [rng.randrange(128) for _ in range(rng.randint(1, 3))]
    elif mode == "truncate":
        return bytes(data[: rng.randrange(len(data))]), 0
    elif mode == "extend":
        return bytes(data) + bytes(rng.randrange(1, 4096)), 0
    elif mode == "version":
        data[4] = rng.choice([0, 1, 3, 255])
        return bytes(data), 1
    elif mode == "zero":
        start, num_bytes = rng.randrange(len(data)), rng.randint(1, 4096)
        data[start:start + num_bytes] = bytes(len(data[start:start + num_bytes]))
        return bytes(data), 0
    else:
        raise ValueError(mode)
    for offset in offsets:
        data[offset] ^= rng.randrange(1, 256)
    return bytes(data), len(offsets)


def run_trial(redis_url: str, seed: int, mode: str, *, num_chains: int = 16, length: int = 4, kv_encoding: str = "",
              compression: str = "none") -> RedisCounts:
    """One trial against the Redis at ``redis_url`` (flushed first); see the module docstring. ``kv_encoding``:
    lossy blocks in a namespace of that encoding; ``compression``: the tier stores them compressed."""
    import redis

    counts = RedisCounts(trials=1)
    rng = random.Random(seed)
    namespace = Namespace(model=f"tests/redis-fuzz-{seed}", dtype="float16", block_size=16, kv_encoding=kv_encoding)
    raw = redis.Redis.from_url(redis_url)
    raw.flushall()
    # timeouts far above a busy machine's round trip, and no breaker: a slow reply must not pass for a lost block
    redis_config = RedisTierConfig(url=redis_url, mode="write_back", connect_timeout_s=30.0, socket_timeout_s=30.0,
                                   breaker_failures=0, compression=compression)
    config = StoreConfig(memory=MemoryTierConfig(enabled=False), redis=redis_config)
    chains = [chain_blocks(seed, chain, length, kv_encoding) for chain in range(num_chains)]
    names = RedisTier(config.redis)  # only to name the keys; it never connects
    with open_store(config) as store:
        for hashes, blocks in chains:
            assert store.put(namespace, hashes, blocks) == length
        damaged: set[bytes] = set()
        keys = [block_key(namespace, h) for hashes, _ in chains for h in hashes]
        victims = rng.sample(keys, rng.randint(1, max(1, len(keys) // 8)))  # most prefixes stay whole
        budget = max(1, round(10 ** rng.uniform(0, 3)))  # flips in all, spread over the victims
        for key in victims:
            name = names.redis_key(key)
            value = raw.get(name)
            assert value is not None
            new, flipped = _damage(value, rng, mode, max(1, budget // len(victims)))
            if new != value:
                raw.set(name, new)
                damaged.add(key)
                counts.flips += flipped
        counts.values_damaged += len(damaged)
        for hashes, blocks in chains:
            intact = 0
            for h in hashes:
                if block_key(namespace, h) in damaged:
                    break
                intact += 1
            got = store.get(namespace, hashes)
            counts.blocks_checked += length
            counts.blocks_served += len(got)
            for served, block in zip(got, blocks):
                if digest(served) != digest(block):
                    counts.wrong_blocks += 1
                    counts.failures.append(f"seed {seed} {mode}: a wrong block served")
            if len(got) < intact:
                counts.lost_blocks += intact - len(got)
                counts.failures.append(f"seed {seed} {mode}: {len(got)} served, {intact} untouched")
        counts.corrupt_records += store.stats().tier("redis").corrupt_records
    return counts


def trials(redis_url: str, seeds: range, **kwargs: Any) -> RedisCounts:
    """One trial per seed, the mode cycling through :data:`MODES`; the counts summed."""
    total = RedisCounts()
    for seed in seeds:
        total.add(run_trial(redis_url, seed, MODES[seed % len(MODES)], **kwargs))
    return total
