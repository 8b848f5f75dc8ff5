"""Corruption fuzzers of the disk tier (LMDB) and the shared tier (Redis), bounded for CI (issue 18).

Each trial damages stored bytes behind the store's back and checks, against digests kept by the test, that
no block is served whose bytes differ from what was put, that the node always comes up, and that every block
the damage did not reach is still served (``tests/support/disk_fuzz.py``, ``tests/support/redis_fuzz.py``).
``benchmarks/bench_corruption.py`` runs many more seeds and records the counts.
"""

from __future__ import annotations

import pytest

from tests.support import disk_fuzz, redis_fuzz
from tests.support.redis import RedisProcess, redis_server  # noqa: F401

pytestmark = pytest.mark.slow  # starts processes or servers, or takes seconds: outside `make test-fast`


def _assert_clean(counts) -> None:  # type: ignore[no-untyped-def]
    summary = {k: v for k, v in counts.as_dict().items() if k != "failures"}
    print(summary)
    assert counts.wrong_blocks == 0, counts.failures
    assert counts.lost_blocks == 0, counts.failures
    assert getattr(counts, "failed_starts", 0) == 0, counts.failures
    assert counts.blocks_served > 0


def test_lmdb_corruption_in_a_store_process(tmp_path) -> None:
    """A seed of every mode: random flips (1 to 1,000), leaf, branch, meta, free-list and overflow pages, value
    sizes off the map, truncation, zeroed regions."""
    counts = disk_fuzz.trials(range(len(disk_fuzz.MODES)), workdir=tmp_path)
    _assert_clean(counts)
    assert counts.repaired_starts > 0  # the damage did reach the file's structure
    assert set(counts.per_mode) == set(disk_fuzz.MODES)


@pytest.mark.parametrize("mode", ["value_size", "truncate", "meta"])
def test_lmdb_corruption_of_a_real_node(tmp_path, mode: str) -> None:
    """The same through ``kvstore serve`` and gRPC, for the damage that used to stop a node: a value size off the
    map (SIGBUS on every start), a truncated file, zeroed meta pages."""
    seed = 1000 + disk_fuzz.MODES.index(mode)
    _assert_clean(disk_fuzz.run_trial(seed, mode, node_kind="serve", workdir=tmp_path))


@pytest.mark.parametrize(("kv_encoding", "compression"), [("int8", "none"), ("int4", "none"), ("int8", "zstd"), ("int8", "blosc2")])
def test_redis_value_corruption_of_lossy_and_compressed_blocks(redis_server: RedisProcess, kv_encoding: str,  # noqa: F811
                                                               compression: str) -> None:
    """The same damage to lossy blocks (scales, codes, the encoding byte) and to compressed frames (Gaussian int8
    codes compress by about 8 %, so they are stored as frames): 0 wrong blocks served, never a block decoded from
    damaged scales."""
    counts = redis_fuzz.trials(redis_server.url, range(2 * len(redis_fuzz.MODES)), kv_encoding=kv_encoding,
                               compression=compression)
    _assert_clean(counts)
    assert counts.corrupt_records > 0


def test_redis_value_corruption(redis_server: RedisProcess) -> None:  # noqa: F811
    """Flipped, cut, extended, zeroed values and changed versions in Redis: 0 wrong blocks served."""
    counts = redis_fuzz.trials(redis_server.url, range(6 * len(redis_fuzz.MODES)))
    _assert_clean(counts)
    assert counts.corrupt_records > 0
