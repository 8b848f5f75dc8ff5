"""Lossy blocks with poisoned scales and a valid checksum: what a writer that means the damage sends (issue 39).

Shared by ``tests/encoding/test_scales.py`` and the soak's poisoned-scale writer (``benchmarks/soak.py``).
"""

from __future__ import annotations

import struct

import torch

from kvstore.blocks.tensors import block_checksum, decode_header
from kvstore.blocks.encoding import Encoding, encode_lossy

SHAPE = (2, 2, 2, 16, 64)
"""``[num_layers, 2, num_kv_heads, block_size, head_dim]`` of the blocks poisoned by default."""
POISONS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "huge": 3e38, "negative": -0.5}
"""The scale values a poisoned block carries, by name."""


def random_blocks(num_blocks: int, seed: int = 0) -> list[torch.Tensor]:
    """``num_blocks`` bfloat16 blocks of :data:`SHAPE`, reproducible from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=generator).to(torch.bfloat16) for _ in range(num_blocks)]


def reseal(block: bytearray) -> bytearray:
    """The block's checksum recomputed over its damaged bytes (in place; returned)."""
    head = struct.unpack_from("<H", block, 10)[0]  # header_nbytes (kvstore/blocks/tensors.py)
    struct.pack_into("<Q", block, 20, block_checksum(block[:head], block[head:]))
    return block


def poisoned(encoding: Encoding, value: float, x: torch.Tensor | None = None, index: int = 1) -> bytearray:
    """A block of ``encoding`` whose ``index``-th scale (float32 row scale; the first layout's int4/int2: a
    float16 scale) is ``value``, checksum valid."""
    block = encode_lossy(random_blocks(1)[0] if x is None else x, "kv", encoding)
    start = decode_header(block).header_nbytes
    if encoding.grouped:
        struct.pack_into("<e", block, start + 2 * index, value if abs(value) < 7e4 or value != value else
                         (float("inf") if value > 0 else float("-inf")))
    else:
        struct.pack_into("<f", block, start + 4 * index, value)
    return reseal(block)
