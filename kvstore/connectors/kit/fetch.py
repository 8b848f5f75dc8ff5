"""One fetch of a cached prefix into its destination, by the best path the client offers; every block checked once.

A connector names what its destination holds (a :class:`BlockSpec`: dtype,
layout, shape) and gets a :class:`FetchHandler` for its (source, destination)
pair once (:func:`fetch_handler`); each fetch then returns a :class:`Fetched`:
the good prefix, how many blocks the store had, and why the next one is bad.

* :class:`LeaseHandler`: the store's memory → host arrays, in place
  (``client.read``): the blocks are checked as a batch and viewed with no copy
  (``kvstore.connectors.kit.leased``), held by the lease until
  :meth:`Fetched.release`; the connector's own copy out of them is the only one.
* :class:`CopyHandler`: any store → tensors on any device (``client.get_into``):
  each block copied once, into the caller's destinations or a staging tensor.
  A corrupt block (rare: blocks are checked at put) is found by fetching the
  encoded blocks again (:class:`DecodeHandler`).
* :class:`DecodeHandler`: encoded buffers (``client.get``) → decoded tensors,
  each checked (checksum, dtype, layout, shape) before it is decoded.

Whatever the path, a block is used only if it fits its destination
(``kvstore.blocks.copying.block_mismatch``, the one check); the first that does not
(or is corrupt) ends the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

import numpy as np
import torch

from kvstore.api import BlockClient
from kvstore.blocks.lease import BlockLease
from kvstore.blocks.tensors import decode_block, verify_block
from kvstore.connectors.kit.leased import view_in_place
from kvstore.connectors.kit.spec import BlockSpec
from kvstore.errors import CodecError, DestinationMismatchError
from kvstore.keys import BlockHash, Namespace


@dataclass(slots=True)
class Fetched:
    """The good prefix of one fetch, and why the block after it is bad.

    Attributes:
        num_good: blocks that passed their checks, from the first.
        num_found: blocks the store returned (``num_good`` plus the bad one and any after it).
        bad: why block ``num_good`` failed (corrupt, or not fit for its destination); ``None`` when none did.
        tensors: the good blocks as tensors (the destinations', a staging tensor's rows, or decoded), for
            :class:`CopyHandler` and :class:`DecodeHandler`; else ``None``.
        arrays: the good blocks as arrays over the lease's memory (:class:`LeaseHandler`); else ``None``.
        lease: the lease that holds :attr:`arrays`, released by :meth:`release`; else ``None``.
    """

    num_good: int
    num_found: int
    bad: str | None = None
    tensors: torch.Tensor | Sequence[torch.Tensor] | None = None
    arrays: np.ndarray | list[np.ndarray] | None = None
    lease: BlockLease | None = None

    def still_valid(self) -> bool:
        """Whether the blocks are still what was fetched: ``False`` once a lease ran out (its memory may be reused)."""
        return self.lease is None or self.lease.valid()

    def release(self) -> None:
        """Give back the lease, if any (idempotent); the arrays must not be read after."""
        if self.lease is not None:
            self.lease.release()


class FetchHandler(Protocol):
    """Fetches a prefix from one kind of source into one kind of destination."""

    def fetch(self, namespace: Namespace, hashes: Sequence[BlockHash], destinations: Sequence[torch.Tensor] | None,
              extra: Mapping[str, Any]) -> Fetched:
        """Fetch the cached prefix of ``hashes``.

        Args:
            namespace: the blocks' namespace.
            hashes: their chained hashes, in order.
            destinations: one tensor per hash to copy into, or ``None`` (a staging tensor, decoded tensors or
                leased arrays, by handler).
            extra: the call's further keywords (``session_id``, ``ttl_s``).

        Raises:
            KVStoreError, OSError: when the store call fails.
        """
        ...


class LeaseHandler:
    """The store's memory → host arrays, in place, under a lease (``client.read``); takes no destinations.

    Args:
        client: the store.
        spec: what every block must be.
    """

    def __init__(self, client: BlockClient, spec: BlockSpec) -> None:
        self.client = client
        self.spec = spec

    def fetch(self, namespace: Namespace, hashes: Sequence[BlockHash], destinations: Sequence[torch.Tensor] | None,
              extra: Mapping[str, Any]) -> Fetched:
        """The prefix leased and viewed in place; the caller copies out of :attr:`Fetched.arrays`, then releases."""
        assert destinations is None, "a leased fetch is copied out by its caller"
        lease = self.client.read(namespace, hashes, **extra)
        try:
            viewed = view_in_place(lease, self.spec)
        except BaseException:
            lease.release()
            raise
        return Fetched(viewed.num_good, len(lease.blocks), viewed.bad, arrays=viewed.arrays, lease=lease)


class CopyHandler:
    """Any store → tensors on any device (``client.get_into``): each block copied once.

    Args:
        client: the store.
        spec: what every block must be.
        pin_memory: a staging tensor (no destinations given) is in pinned memory, for a copy on to a GPU.
    """

    def __init__(self, client: BlockClient, spec: BlockSpec, *, pin_memory: bool = False) -> None:
        self.client = client
        self.spec = spec
        self.pin_memory = pin_memory

    def fetch(self, namespace: Namespace, hashes: Sequence[BlockHash], destinations: Sequence[torch.Tensor] | None,
              extra: Mapping[str, Any]) -> Fetched:
        """The prefix copied into ``destinations``, or into one new staging tensor ``[len(hashes), *shape]``."""
        staging = None
        if destinations is None:
            staging = torch.empty((len(hashes), *self.spec.shape), dtype=self.spec.torch_dtype,
                                  pin_memory=self.pin_memory)
            destinations = list(staging)
        try:
            num_blocks = self.client.get_into(namespace, hashes, destinations, **extra)  # checksums: as it checks
        except DestinationMismatchError as exc:
            return Fetched(exc.num_blocks, exc.num_found, f"not fit for its destination ({exc})",
                           tensors=staging[:exc.num_blocks] if staging is not None else destinations[:exc.num_blocks])
        except CodecError:  # a corrupt block: fetch the encoded blocks to find which (rare: blocks are checked at put)
            return DecodeHandler(self.client, self.spec).fetch(namespace, hashes, None if staging is not None
                                                               else destinations, {})
        return Fetched(num_blocks, num_blocks,
                       tensors=staging[:num_blocks] if staging is not None else destinations[:num_blocks])


class DecodeHandler:
    """Encoded buffers (``client.get``) → tensors: each block verified, checked and decoded, then copied into its
    destination where one is given.

    Args:
        client: the store.
        spec: what every block must be.
    """

    def __init__(self, client: BlockClient, spec: BlockSpec) -> None:
        self.client = client
        self.spec = spec

    def fetch(self, namespace: Namespace, hashes: Sequence[BlockHash], destinations: Sequence[torch.Tensor] | None,
              extra: Mapping[str, Any]) -> Fetched:
        """The prefix decoded (and copied into ``destinations`` when given)."""
        buffers = self.client.get(namespace, hashes, **extra)[:len(hashes)]
        good: list[torch.Tensor] = []
        bad = None
        for buffer in buffers:
            try:
                bad = self.spec.mismatch(verify_block(buffer)) or None
                if bad is not None:
                    break
                good.append(decode_block(buffer, verify=False))
            except CodecError as exc:  # corrupt, or a lossy block's scales out of range (kvstore.blocks.encoding.scales)
                bad = f"corrupt ({exc})"
                break
        if destinations is not None:
            for destination, block in zip(destinations, good):
                destination.copy_(block)
            return Fetched(len(good), len(buffers), bad, tensors=destinations[:len(good)])
        return Fetched(len(good), len(buffers), bad, tensors=good)


def fetch_handler(client: BlockClient, spec: BlockSpec, *, in_place: bool = False,
                  pin_memory: bool = False) -> FetchHandler:
    """The best fetch the client offers for a destination of ``spec``.

    A ``read`` in place where the caller copies the blocks out itself (``in_place``, host memory), else
    ``get_into``, else ``get``: every kvstore client and the embedded store offer all three; a third party's
    :class:`~kvstore.api.BlockClient` may leave ``read`` or ``get_into`` out (``None``).

    Args:
        client: the store.
        spec: what every block must be.
        in_place: the caller takes host arrays over the store's memory and copies them itself.
        pin_memory: a staging tensor is in pinned memory (the destination is a GPU).
    """
    if in_place and callable(getattr(client, "read", None)):
        return LeaseHandler(client, spec)
    if callable(getattr(client, "get_into", None)):
        return CopyHandler(client, spec, pin_memory=pin_memory)
    return DecodeHandler(client, spec)


def fetch_into(client: BlockClient, namespace: Namespace, hashes: Sequence[BlockHash],
               destinations: Sequence[torch.Tensor], spec: BlockSpec, **extra: Any) -> Fetched:
    """The cached prefix of ``hashes`` copied into ``destinations`` (one tensor per hash) by the best path the client
    offers (:func:`fetch_handler`); a block that does not fit its destination, or is corrupt, ends the prefix.

    Args:
        client: the store.
        namespace: the blocks' namespace.
        hashes: their chained hashes, in order.
        destinations: one tensor of ``spec`` per hash, on any device.
        spec: what every block must be.
        extra: the call's further keywords (``session_id``, ``ttl_s``).

    Raises:
        KVStoreError, OSError: when the store call fails.
    """
    return fetch_handler(client, spec).fetch(namespace, hashes, destinations, extra)
