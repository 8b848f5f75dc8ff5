"""A load's blocks viewed in place for a vLLM worker's page format (``kvstore.connectors.kit.leased``).

The hit path of the worker (``kvstore.connectors.vllm.worker``) on the CPU:
the client's ``read`` leases the prefix where it already is (the node's
shared-memory segment on the same host, the embedded store's own memory),
:func:`view_leased` checks it against the worker's page format and views its
payloads, and ``PagedKV.scatter_arrays`` copies them into vLLM's paged cache:
the scatter is the one copy on this side, with no staging tensor and no
per-block decode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.connectors.kit.spec import BlockSpec
from kvstore.connectors.kit.leased import LeasedBlocks, view_in_place

if TYPE_CHECKING:
    from kvstore.blocks.lease import BlockLease
    from kvstore.connectors.vllm.layout import PageFormat

__all__ = ["LeasedBlocks", "view_leased"]


def view_leased(lease: BlockLease, fmt: PageFormat, block_shape: tuple[int, ...]) -> LeasedBlocks:
    """Check a lease's blocks against the page format and view their payloads in place
    (:func:`kvstore.connectors.kit.leased.view_in_place`).

    Args:
        lease: the blocks, as ``read`` returned them (their memory stays valid until it is released).
        fmt: this worker's page format (dtype, layout).
        block_shape: the shape every block must have, e.g. ``[L, 2, H, T, D]``.

    Returns:
        The good prefix (see :class:`~kvstore.connectors.kit.leased.LeasedBlocks`); a corrupt or mismatched
        block ends it.
    """
    return view_in_place(lease, BlockSpec(fmt.dtype, fmt.layout, block_shape))
