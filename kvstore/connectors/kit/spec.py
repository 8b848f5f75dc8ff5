"""What one block of a connector's destination holds (:class:`BlockSpec`), and whether a block fits it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.blocks.copying import block_mismatch
from kvstore.blocks.tensors import BlockHeader, Layout, torch_dtype


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """What one block of a destination holds.

    Attributes:
        dtype: codec dtype name, e.g. ``bfloat16``.
        layout: codec layout (``kv`` or ``mla``).
        shape: the block's shape, e.g. ``[num_layers, 2, num_kv_heads, block_size, head_dim]``.
    """

    dtype: str
    layout: Layout
    shape: tuple[int, ...]

    def mismatch(self, header: BlockHeader) -> str:
        """How a block does not fit (``"of float16/kv [...], not bfloat16/kv [...]"``); ``""`` if it fits."""
        mismatch = block_mismatch(header, self.dtype, self.shape, self.layout)
        return f"of {mismatch}" if mismatch else ""

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of :attr:`dtype`."""
        return torch_dtype(self.dtype)
