"""Logical bytes of each local tier: what its blocks hold as the engine holds them (decoded, uncompressed).

A tier's capacity counts what it stores (a lossy block's codes and scales, a
compressed frame), so its ``bytes`` say what the tier spends; an operator also
wants what that buys: the bytes of the tensors those blocks give back. A
block's header names that size whatever its encoding (its dtype and shape are
the tensor's before encoding: :attr:`kvstore.blocks.tensors.BlockHeader.logical_nbytes`),
but the index keeps one integer per block, its capacity bytes, and a tier that
compresses holds the header inside a frame.

So this counts, per tier, the blocks of each namespace (by its tag), and learns
each namespace's logical bytes per block from the first header it sees (every
block of a namespace has the model's shape: its layers, heads and block size).
Counting per namespace costs nothing per block; a restarted store learns a
namespace's size from one block of it (:meth:`LogicalBytes.unknown`). Should
one namespace hold blocks of several shapes, its figure is that of the last
header seen.
"""

from __future__ import annotations

from typing import Sequence

from kvstore.blocks.copying import TensorBlock
from kvstore.blocks.tensors import decode_header
from kvstore.errors import CodecError
from kvstore.keys import NAMESPACE_TAG_BYTES, BlockKey


def block_logical_nbytes(block: bytes | memoryview) -> int:
    """The logical bytes of one encoded block (``prod(shape) * itemsize`` from its header, whatever its encoding);
    its length where the header does not parse (a value the caller refuses elsewhere)."""
    try:
        return decode_header(block).logical_nbytes
    except CodecError:
        return memoryview(block).nbytes


class LogicalBytes:
    """Blocks per (tier, namespace tag), and each namespace's logical bytes per block.

    Args:
        num_levels: local tiers, fastest first.
    """

    __slots__ = ("_blocks", "_per_block", "_sample")

    def __init__(self, num_levels: int) -> None:
        self._blocks: list[dict[bytes, int]] = [{} for _ in range(num_levels)]
        self._per_block: dict[bytes, int] = {}
        self._sample: dict[bytes, tuple[int, BlockKey]] = {}  # tags of unknown size: (a tier, a key) to read one from

    def added(self, level: int, key: BlockKey) -> None:
        """A block became resident in tier ``level``."""
        tag = key[:NAMESPACE_TAG_BYTES]
        blocks = self._blocks[level]
        blocks[tag] = blocks.get(tag, 0) + 1
        if tag not in self._per_block and tag not in self._sample:
            self._sample[tag] = (level, key)

    def removed(self, level: int, key: bytes) -> None:
        """A block left tier ``level``."""
        tag = key[:NAMESPACE_TAG_BYTES]
        blocks = self._blocks[level]
        left = blocks.get(tag, 0) - 1
        if left > 0:
            blocks[tag] = left
        else:
            blocks.pop(tag, None)
            if tag in self._sample and self._sample[tag][0] == level:
                del self._sample[tag]

    def learn(self, keys: Sequence[bytes], blocks: Sequence[bytes | memoryview | TensorBlock]) -> None:
        """Learn the logical bytes per block of each namespace of ``keys`` not yet known, from its block's header.

        A block whose header does not parse teaches nothing (the store refuses it elsewhere).
        """
        per_block = self._per_block
        for key, block in zip(keys, blocks):
            tag = key[:NAMESPACE_TAG_BYTES]
            if tag in per_block:
                continue
            try:
                header = block.header if isinstance(block, TensorBlock) else decode_header(block)
                per_block[tag] = header.logical_nbytes
            except CodecError:
                continue
            self._sample.pop(tag, None)

    def unknown(self) -> list[tuple[int, BlockKey]]:
        """``(tier, key)`` of one resident block of each namespace whose size is not known yet (after a restart):
        reading it and passing it to :meth:`learn` makes the namespace's logical bytes known."""
        return list(self._sample.values())

    def logical_bytes(self, level: int, fallback: int = 0) -> int:
        """Logical bytes of the blocks resident in tier ``level``; ``fallback`` (e.g. the tier's stored bytes)
        when a namespace's size is not known yet, in proportion to its blocks."""
        known, unknown_blocks = 0, 0
        for tag, num_blocks in self._blocks[level].items():
            size = self._per_block.get(tag)
            if size is None:
                unknown_blocks += num_blocks
            else:
                known += size * num_blocks
        if unknown_blocks:
            total = sum(self._blocks[level].values())
            known += fallback * unknown_blocks // max(total, 1)
        return known
