"""Trace ids to block hashes, and the deterministic payload blocks (pure, no server)."""

from __future__ import annotations

import pytest

from kvstore.blocks.tensors import decode_block, verify_block
from kvstore.errors import InvalidArgumentError
from kvstore.tools.loadtest.blocks import PayloadFactory, loadtest_namespace, trace_block_hashes, trace_tokens


def test_hashes_are_deterministic_and_chained() -> None:
    ns = loadtest_namespace()
    a = trace_block_hashes(ns, [7, 8, 9])
    assert a == trace_block_hashes(loadtest_namespace(), (7, 8, 9))
    assert len(set(a)) == 3 and all(len(h) == 16 for h in a)
    # same id after the same prefix: same hash; after another prefix: another hash
    assert trace_block_hashes(ns, [7, 8, 10])[:2] == a[:2]
    assert trace_block_hashes(ns, [7, 8, 10])[2] != a[2]
    assert trace_block_hashes(ns, [6, 8, 9])[1] != a[1]
    assert trace_block_hashes(ns, []) == []


def test_hashes_differ_by_namespace_and_large_ids() -> None:
    ns = loadtest_namespace()
    assert trace_block_hashes(ns, [1]) != trace_block_hashes(loadtest_namespace(model="other"), [1])
    big = (1 << 64) + 1
    assert trace_block_hashes(ns, [big]) != trace_block_hashes(ns, [1])
    tokens = trace_tokens(8, [big, 5])
    assert list(tokens[:8]) == [3, 1, 0, 1, 0, 0, 0, 0]
    assert list(tokens[8:]) == [2, 5, 0, 0, 0, 0, 0, 0]
    with pytest.raises(InvalidArgumentError):
        trace_tokens(3, [1 << 100])
    with pytest.raises(InvalidArgumentError):
        loadtest_namespace(2)


def test_payload_blocks_are_valid_deterministic_and_distinct() -> None:
    ns = loadtest_namespace()
    factory = PayloadFactory(ns, 2048, seed=0)
    h1, h2 = trace_block_hashes(ns, [1, 2])
    block = factory.encoded(h1)
    assert len(block) == factory.encoded_bytes == 128 + 2048
    header = verify_block(block)
    assert header.dtype == "uint8" and header.shape == (1, 2, 1, 512, 2)
    assert tuple(decode_block(block).shape) == (1, 2, 1, 512, 2)
    assert block == PayloadFactory(ns, 2048, seed=0).encoded(h1)
    assert block != factory.encoded(h2)
    assert block != PayloadFactory(ns, 2048, seed=1).encoded(h1)


def test_default_payload_fills_one_64kib_page() -> None:
    factory = PayloadFactory(loadtest_namespace())
    assert factory.encoded_bytes == 64 * 1024 - 1024 + 128
    assert factory.encoded_bytes <= 64 * 1024


def test_payload_size_must_fit_the_block_shape() -> None:
    with pytest.raises(InvalidArgumentError, match="multiple of 2 \\* block_tokens = 1024"):
        PayloadFactory(loadtest_namespace(), 1000)
    with pytest.raises(InvalidArgumentError):
        PayloadFactory(loadtest_namespace(), 0)
