"""Blocks into caller memory and back: a Get's encoded blocks copied into the caller's tensors, a Put's tensors
encoded straight into a target range; one copy each way, and no intermediate ``bytes``.

Used by every transport: the same-host data plane (from and into shared-memory
segments, ``kvstore.shm.client.link``), the gRPC client (from the received messages)
and the embedded store (from the tier's leased memory).
"""

from __future__ import annotations

import struct
import warnings
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from kvstore.codec import (
    CHECKSUM_SPAN,
    Layout,
    _check_shape,
    as_block,
    check_one_shape,
    decode_header,
    dtype_name,
    encode_header,
    header_nbytes,
    torch_dtype,
    verify_block,
)
from kvstore.errors import DestinationMismatchError, InvalidArgumentError

if TYPE_CHECKING:
    import torch

    from kvstore.api import Block, Buffer


_CHECKSUM_FIELD = struct.Struct("<Q")
"""A header's checksum field (at ``CHECKSUM_SPAN[0]``)."""


def check_destinations(destinations: Sequence[Any], num_hashes: int) -> None:
    """Check the destinations of a Get into caller tensors before any call starts.

    Raises:
        InvalidArgumentError: if there is not one per hash, or one is not a ``torch.Tensor``.
    """
    import torch

    if isinstance(destinations, torch.Tensor) or len(destinations) != num_hashes:
        count = "a tensor" if isinstance(destinations, torch.Tensor) else f"{len(destinations)} destinations"
        raise InvalidArgumentError(f"give one destination tensor per block hash: {num_hashes} hashes, {count}")
    for position, destination in enumerate(destinations):
        if not isinstance(destination, torch.Tensor):
            raise InvalidArgumentError(f"destination {position}: expected a torch.Tensor, got "
                                       f"{type(destination).__name__}")


def blocks_for_put(blocks: Sequence[object], layout: Layout | str) -> list[Block]:
    """The blocks of a put, checked as encoding would check them but not encoded (no copy): what a transport takes.

    Encoded bytes and tensors pass through, numpy arrays become tensors over
    their memory (:func:`kvstore.codec.as_block`); each tensor's dtype and
    shape are checked against the codec and ``layout``, and the batch must
    have one shape (:func:`kvstore.codec.check_one_shape`), as
    :func:`kvstore.codec.encode_blocks` would have it.

    Raises:
        InvalidArgumentError: on one block instead of a sequence, or a block of another type (named, with its index).
        UnknownDtypeError: on a tensor whose dtype has no codec code.
        ElementCountError: on a tensor whose shape does not fit the layout, or blocks of different shapes.
    """
    if isinstance(blocks, (bytes, bytearray, memoryview, str)):
        raise InvalidArgumentError(f"expected a sequence of blocks, got {type(blocks).__name__} (one block? pass [block])")
    layout = Layout(layout)
    checked = [block if type(block) is bytes else as_block(block, index=i) for i, block in enumerate(blocks)]
    seen, like = None, True  # like: every block a tensor of one dtype and shape (so of one shape: nothing to compare)
    for block in checked:
        if isinstance(block, (bytes, bytearray, memoryview)):
            like = False
            continue
        kind = (block.dtype, block.shape)
        if kind == seen:
            continue
        dtype_name(block.dtype)
        _check_shape(layout, tuple(block.shape))
        like = like and seen is None
        seen = kind
    if not like:
        check_one_shape(checked, layout)
    return checked  # type: ignore[return-value]


def byte_view(buffer: Buffer) -> torch.Tensor:
    """A 1-D ``uint8`` tensor viewing ``buffer`` without a copy (read-only buffers too: never write into it)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the buffer is not writable: it is only read
        return torch.frombuffer(buffer, dtype=torch.uint8)


def copy_block_into(block: Buffer, destination: torch.Tensor, *, verify: bool,
                    source: torch.Tensor | None = None, position: int = 0, num_found: int = 1) -> None:
    """Copy one encoded block's payload into ``destination`` (any device, any strides): one copy.

    Args:
        block: the encoded block (header, then payload).
        destination: a tensor of the block's dtype and shape, e.g. ``[num_layers, 2, num_kv_heads,
            block_size, head_dim]``; a slice of a larger tensor (a cache, a staging buffer) is fine.
        verify: check the block's checksum first.
        source: a ``uint8`` tensor over exactly ``block``'s bytes, if the caller has one (saves making it).
        position: the block's index in its call, for the error.
        num_found: blocks the call fetched, for the error.

    Raises:
        DestinationMismatchError: if the block's dtype or shape is not the destination's.
        CodecError: if the block is malformed, or (with ``verify``) corrupt.
    """
    header = verify_block(block) if verify else decode_header(block)
    dtype = torch_dtype(header.dtype)
    if destination.dtype != dtype or tuple(destination.shape) != header.shape:
        raise DestinationMismatchError(
            f"block {position} is {header.dtype} {list(header.shape)}, its destination "
            f"{str(destination.dtype).removeprefix('torch.')} {list(destination.shape)}", position, num_found)
    if header.encoding:  # a lossy block: decoded on the destination's device (kvstore.encoding)
        from kvstore.encoding import decode_block_into
        return decode_block_into(block, header, destination, source)
    if header.payload_nbytes == 0:
        return
    if source is None:
        source = byte_view(block)
    destination.copy_(source[header.header_nbytes:header.nbytes].view(dtype).view(header.shape))


class Copied(NamedTuple):
    """A Get into caller tensors, on one node: blocks copied in prefix order, blocks found, and the mismatch if any."""

    num_copied: int
    num_found: int
    error: DestinationMismatchError | None = None


def copy_batch_into(blocks: Sequence[memoryview], destinations: Sequence[torch.Tensor], raw: torch.Tensor,
                    offsets: Sequence[int]) -> Copied | None:
    """Copy a batch of like blocks, evenly spaced in one buffer, into stacked destinations with one ``copy_``.

    The same-host Get's common case: the node lays a prefix's blocks out in
    one leased range at a fixed spacing, and the caller's destinations are the
    rows of one tensor (``list(dest.unbind(0))``, a staging buffer). Then one
    strided view of the payloads, ``[num_blocks, *shape]``, is copied into one
    view of the rows, instead of a header parse, three tensor views and a
    ``copy_`` per block. Checksums are not checked (the caller verifies on the
    per-block path).

    Args:
        blocks: the encoded blocks, views of ``raw``'s memory.
        destinations: one tensor per block (at least as many).
        raw: a 1-D ``uint8`` tensor over the whole buffer.
        offsets: each block's offset in ``raw``, bytes.

    Returns:
        What was copied, or ``None`` when the batch is not of that form (nothing was copied: use
        :func:`copy_into_destinations`).

    Raises:
        CodecError: if the first block's header is malformed.
    """
    num_blocks = len(blocks)
    if num_blocks < 2 or len(destinations) < num_blocks:
        return None
    step = offsets[1] - offsets[0]
    size = blocks[0].nbytes
    if any(offsets[i + 1] - offsets[i] != step or blocks[i + 1].nbytes != size for i in range(num_blocks - 1)):
        return None
    header = decode_header(blocks[0])
    if header.payload_nbytes == 0 or header.encoding:  # lossy blocks are decoded one by one
        return None
    start, end = CHECKSUM_SPAN
    lead, rest = blocks[0][:start], blocks[0][end:header.header_nbytes]
    if any(b[:start] != lead or b[end:header.header_nbytes] != rest for b in blocks[1:]):
        return None
    dtype = torch_dtype(header.dtype)
    first = destinations[0]
    row = first.numel() * first.element_size()
    if not all(d.dtype == dtype and tuple(d.shape) == header.shape and d.is_contiguous() and d.device == first.device
               and d.data_ptr() == first.data_ptr() + i * row for i, d in enumerate(destinations[:num_blocks])):
        return None
    target = first.as_strided((num_blocks, *header.shape), (first.numel(), *first.stride()))
    payload_offset = raw.storage_offset() + offsets[0] + header.header_nbytes
    source = raw.as_strided((num_blocks, header.payload_nbytes), (step, 1), payload_offset)
    target.copy_(source.view(dtype).view(num_blocks, *header.shape))
    return Copied(num_blocks, num_blocks)


def copy_into_destinations(blocks: Sequence[Buffer], destinations: Sequence[torch.Tensor], verify: bool,
                           sources: Sequence[torch.Tensor] | None = None) -> Copied:
    """Copy blocks into their destinations, in order, until one does not fit (:func:`copy_block_into`).

    Args:
        blocks: the encoded blocks fetched, in prefix order.
        destinations: one tensor per block (at least as many).
        verify: check each checksum first.
        sources: ``uint8`` tensors over the blocks' bytes, if the caller has them.

    Raises:
        CodecError: on a malformed block, or (with ``verify``) a corrupt one.
    """
    for position, block in enumerate(blocks):
        try:
            copy_block_into(block, destinations[position], verify=verify,
                            source=None if sources is None else sources[position], position=position,
                            num_found=len(blocks))
        except DestinationMismatchError as exc:
            return Copied(position, len(blocks), exc)
    return Copied(len(blocks), len(blocks))


def encoded_nbytes(block: Block) -> int:
    """The encoded length of a block (encoded bytes as they are, or a tensor to encode), bytes."""
    if isinstance(block, (bytes, bytearray, memoryview)):
        return memoryview(block).nbytes
    return header_nbytes(block.dim()) + block.numel() * block.element_size()


def encode_into(block: Block, layout: Layout | str, target: memoryview, target_bytes: torch.Tensor | None) -> int:
    """Write one block encoded into ``target`` (at its start): encoded bytes are copied as they are; a tensor's
    payload is copied straight in (from any device), then its header is computed over that copy and written
    before it. Returns the encoded length, bytes.

    Args:
        block: encoded bytes, or a tensor of the layout's shape (``[num_layers, 2, num_kv_heads, block_size,
            head_dim]`` for ``kv``).
        layout: the namespace's layout.
        target: a writable range of at least :func:`encoded_nbytes` bytes.
        target_bytes: a ``uint8`` tensor over the same range (``None`` only for encoded bytes).

    Raises:
        UnknownDtypeError: if a tensor's dtype has no codec code.
        ElementCountError: if a tensor's shape does not fit the layout.
    """
    if isinstance(block, (bytes, bytearray, memoryview)):
        view = memoryview(block).cast("B")
        target[:view.nbytes] = view
        return view.nbytes
    assert target_bytes is not None, "a tensor is encoded through a tensor over its target"
    name = dtype_name(block.dtype)
    head = header_nbytes(block.dim())
    nbytes = head + block.numel() * block.element_size()
    if nbytes > head:
        target_bytes[head:nbytes].view(block.dtype).view(block.shape).copy_(block.detach())
    header = encode_header(name, layout, tuple(block.shape), target[head:nbytes])
    target[:head] = header
    return nbytes


def encode_batch_into(blocks: Sequence[Block], layout: Layout | str, target: memoryview, target_bytes: torch.Tensor,
                      offsets: Sequence[int]) -> bool:
    """Write a batch of like tensors encoded at evenly spaced ``offsets`` of one buffer, with one header built
    for all and three calls per block; ``False`` (nothing written) when the batch is not of that form.

    The same-host Put's common case: blocks of one dtype and shape, staged one
    after another in one range of the put segment. Byte for byte what
    :func:`encode_into` writes per block, without its per-block header build
    (a dozen Python steps) and tensor views: the header, the same for every
    block but its checksum, is built once and written before every payload in
    one strided copy with its checksum field zero; then each payload is copied
    into one row of a strided view of the payloads, and at once (the copy still
    in cache) the block's checksum is one xxh3-64 over its header and payload
    where they lie, stored into its field.

    Args:
        blocks: tensors of the layout's shape (``[num_layers, 2, num_kv_heads, block_size, head_dim]`` for ``kv``),
            all of one dtype, shape and device (any device: each is copied from there once).
        layout: the namespace's layout.
        target: the writable buffer (the put segment's view).
        target_bytes: a 1-D ``uint8`` tensor over the whole of ``target``.
        offsets: each block's offset in ``target``, bytes, evenly spaced by at least :func:`encoded_nbytes`.

    Returns:
        Whether the batch was written (``False``: a single block, not all tensors of one dtype, shape and
        device, or offsets not evenly spaced; encode those with :func:`encode_into`).

    Raises:
        UnknownDtypeError: if the tensors' dtype has no codec code.
        ElementCountError: if their shape does not fit the layout.
    """
    import torch
    import xxhash

    num_blocks = len(blocks)
    if num_blocks < 2 or len(offsets) != num_blocks:
        return False
    first = blocks[0]
    if not isinstance(first, torch.Tensor) or first.numel() == 0:
        return False
    dtype, shape, device = first.dtype, first.shape, first.device
    if not all(isinstance(b, torch.Tensor) and b.dtype == dtype and b.shape == shape and b.device == device
               for b in blocks):
        return False
    step = offsets[1] - offsets[0]
    head = header_nbytes(first.dim())
    nbytes = head + first.numel() * first.element_size()
    if step < nbytes or any(offsets[i + 1] - offsets[i] != step for i in range(num_blocks - 1)):
        return False
    start = offsets[0]
    # any bytes of the payload's length make the header: its checksum field is cleared, and taken per block below
    header = bytearray(encode_header(dtype_name(dtype), layout, tuple(shape), target[start + head:start + nbytes]))
    at, end = CHECKSUM_SPAN
    header[at:end] = bytes(end - at)
    base = target_bytes.storage_offset() + start
    heads = target_bytes.as_strided((num_blocks, head), (step, 1), base)
    heads.copy_(torch.frombuffer(header, dtype=torch.uint8).expand(num_blocks, head))
    payloads = target_bytes.as_strided((num_blocks, nbytes - head), (step, 1), base + head)
    rows = payloads.view(dtype).view(num_blocks, *shape).unbind(0)
    pack_into, digest = _CHECKSUM_FIELD.pack_into, xxhash.xxh3_64_intdigest
    for row, block, offset in zip(rows, blocks, offsets):
        row.copy_(block.detach())
        pack_into(target, offset + at, digest(target[offset:offset + nbytes]))
    return True
