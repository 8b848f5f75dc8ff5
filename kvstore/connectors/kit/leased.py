"""A lease's blocks checked against their destination as a batch, and their payloads viewed in place as arrays.

The in-place fetch (``kvstore.connectors.kit.fetch.LeaseHandler``): the
client's ``read`` leases the prefix where it already is (the node's
shared-memory segment on the same host, the embedded store's own memory), this
module checks it and views its payloads, and the connector copies them into its
cache (vLLM: ``PagedKV.scatter_arrays``): that copy is the one copy on this
side, with no staging tensor and no per-block decode.

Checks: a prefix of like blocks has one header but for its checksum, so the
first block's header is parsed and checked against the destination's
:class:`~kvstore.connectors.kit.fetch.BlockSpec`, and every other block's
header is compared with it as bytes (:class:`kvstore.blocks.tensors.LikeBlocks`).
Checksums are checked only where the lease says the blocks crossed a network
(``BlockLease.checked`` is ``False``, gRPC): what the node validated at put
time and serves from its own memory is not checked again (``docs/shared-memory.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from kvstore.blocks.tensors import DTYPES, BlockHeader, LikeBlocks, decode_header, verify_block
from kvstore.errors import CodecError

if TYPE_CHECKING:
    from kvstore.api import Buffer
    from kvstore.blocks.lease import BlockLease
    from kvstore.connectors.kit.spec import BlockSpec

_ITEM_TYPES: dict[int, type[np.generic]] = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
"""The numpy type each block is viewed as, by its dtype's item size: a copy moves bits, so any type of the
size does (numpy has no bfloat16 or float8)."""


def item_type(itemsize: int) -> type[np.generic]:
    """The numpy integer type of ``itemsize`` bytes, used to move elements of any dtype of that size.

    Raises:
        KeyError: for an item size other than 1, 2, 4 or 8.
    """
    return _ITEM_TYPES[itemsize]


@dataclass(slots=True)
class LeasedBlocks:
    """The good prefix of a lease's blocks, as arrays over the lease's memory (no copy), and why the next is bad.

    Attributes:
        arrays: ``[num_good, *block_shape]`` (one strided array over the segment) or one ``block_shape``
            array per block, of :func:`item_type` of the block dtype's size; valid while the lease is.
        num_good: blocks that passed their checks, from the first.
        bad: why block ``num_good`` failed (``None`` when every block passed).
    """

    arrays: np.ndarray | list[np.ndarray]
    num_good: int
    bad: str | None


def view_in_place(lease: BlockLease, spec: BlockSpec) -> LeasedBlocks:
    """Check a lease's blocks against their destination's spec and view their payloads in place.

    Args:
        lease: the blocks, as ``read`` returned them (their memory stays valid until it is released).
        spec: the dtype, layout and shape every block must have, e.g. ``[L, 2, H, T, D]``.

    Returns:
        The good prefix (see :class:`LeasedBlocks`); a corrupt or mismatched block ends it.
    """
    blocks = lease.blocks
    if not blocks:
        return LeasedBlocks([], 0, None)
    check: Callable[[Buffer], BlockHeader] = verify_block if not lease.checked else decode_header
    try:
        header = check(blocks[0])
    except CodecError as exc:
        return LeasedBlocks([], 0, f"corrupt ({exc})")
    bad = spec.mismatch(header) or None
    if bad is not None:
        return LeasedBlocks([], 0, bad)
    like = LikeBlocks(header, blocks[0])
    num_good = 1
    for block in blocks[1:]:
        try:
            if not (like.verify(block) if not lease.checked else like.matches(block)):
                bad = spec.mismatch(check(block)) or None  # another header: the full check names what is wrong
                if bad is not None:
                    break
        except CodecError as exc:
            bad = f"corrupt ({exc})"
            break
        num_good += 1
    item = item_type(DTYPES[header.dtype][1])
    return LeasedBlocks(_payloads(lease, blocks[:num_good], header, item), num_good, bad)


def _payloads(lease: BlockLease, blocks: Sequence[Buffer], header: BlockHeader,
              item: type[np.generic]) -> np.ndarray | list[np.ndarray]:
    """One strided array over the lease's buffer when its blocks lie evenly spaced in it, else one per block."""
    shape = header.shape
    count = header.payload_nbytes // np.dtype(item).itemsize
    offsets = lease.offsets
    first = lease.blocks[0]
    if offsets is not None and len(offsets) >= len(blocks) and isinstance(first, memoryview):
        offsets = offsets[:len(blocks)]
        step = offsets[1] - offsets[0] if len(offsets) > 1 else header.nbytes
        if all(offsets[i + 1] - offsets[i] == step for i in range(len(offsets) - 1)) and step > 0:
            base = memoryview(first.obj)  # the whole mapping all the blocks view
            inner = np.empty(shape, dtype=item).strides
            return np.ndarray((len(blocks), *shape), dtype=item, buffer=base,
                              offset=offsets[0] + header.header_nbytes, strides=(step, *inner))
    return [np.frombuffer(block, dtype=item, count=count, offset=header.header_nbytes).reshape(shape)
            for block in blocks]
