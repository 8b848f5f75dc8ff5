"""What a lossy encoding buys a capacity plan: ``kvstore simulate --kv-encoding`` and the sizes it assumes."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kvstore.blocks.tensors import encode_block
from kvstore.blocks.encoding import Encoding, encode_lossy
from kvstore.blocks.encoding.spec import encoded_fraction
from kvstore.errors import InvalidArgumentError
from kvstore.tools.sim.cli import add_arguments, encoded_block_bytes, run


@pytest.mark.parametrize("encoding", list(Encoding), ids=lambda e: e.value)
@pytest.mark.parametrize("block_tokens", [16, 64])
def test_the_planned_bytes_are_a_real_blocks(encoding: Encoding, block_tokens: int) -> None:
    """The fraction assumed from the tokens per block (heads of 128 channels) is the real block's, within 0.1 %."""
    x = torch.zeros(4, 2, 2, block_tokens, 128, dtype=torch.bfloat16)
    exact = len(encode_block(x))
    real = len(encode_lossy(x, "kv", encoding))
    assert abs(encoded_block_bytes(exact, encoding.value, block_tokens) - real) <= 0.001 * exact
    assert encoded_fraction(None, block_tokens) == 1.0


def _simulate(tmp_path, *extra: str) -> dict:  # type: ignore[type-arg]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / f"out{len(extra)}{'-'.join(extra)}.json"
    args = parser.parse_args(["--capacity", "2GiB", "--block-bytes", "64MiB", "--policy", "lru",
                              "--json", str(out), *extra])
    assert run(args) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_simulate_holds_more_blocks_in_the_same_bytes(tmp_path) -> None:
    raw = _simulate(tmp_path)["results"][0]
    int8 = _simulate(tmp_path, "--kv-encoding", "int8")
    int4 = _simulate(tmp_path, "--kv-encoding", "int4")["results"][0]
    assert int8["kv_encoding"] == "int8"
    int8 = int8["results"][0]
    assert raw["capacity_blocks"] == 32 and int8["capacity_blocks"] == 63 and int4["capacity_blocks"] >= 120
    assert raw["hit_ratio"] < int8["hit_ratio"] < int4["hit_ratio"]


def test_an_encoding_needs_the_exact_block_size() -> None:
    with pytest.raises(InvalidArgumentError, match="--block-bytes"):
        encoded_block_bytes(None, "int8", 512)
    with pytest.raises(InvalidArgumentError, match="unknown KV encoding"):
        encoded_block_bytes(1 << 20, "int3", 512)


def test_loadtest_sizes_its_blocks_as_the_encoding_stores_them() -> None:
    from kvstore.tools.loadtest.cli import encoded_payload_bytes

    assert encoded_payload_bytes(64512, "", 512) == 64512
    assert encoded_payload_bytes(64512, "int8", 512) == 31744  # half, in multiples of 2 * 512
    assert encoded_payload_bytes(64512, "int4", 512) == 16384
    with pytest.raises(InvalidArgumentError, match="unknown KV encoding"):
        encoded_payload_bytes(64512, "int3", 512)
