"""Blocks into caller memory and back: a Get's encoded blocks copied into the caller's tensors, a Put's tensors
encoded straight into a target range; one copy each way, and no intermediate ``bytes``.

Used by every transport: the same-host data plane (from and into shared-memory
segments, ``kvstore.shm.client.link``), the gRPC client (from the received messages)
and the embedded store (from the tier's leased memory).
"""

from __future__ import annotations

import ctypes
import struct
import warnings
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence, Union, cast

from kvstore.blocks.tensors import (
    CHECKSUM_SPAN,
    BlockHeader,
    Layout,
    as_block,
    blank_header,
    check_one_shape,
    check_shape,
    decode_header,
    dtype_name,
    encode_block,
    encode_header,
    header_nbytes,
    torch_dtype,
    verify_block,
)
from kvstore.errors import DestinationMismatchError, InvalidArgumentError

if TYPE_CHECKING:
    import torch

    from kvstore.api import Block, Buffer


PutBlock = Union[bytes, bytearray, memoryview, "torch.Tensor"]
"""A block of a put as :func:`blocks_for_put` checks it: encoded bytes of any bytes-like type, or a tensor."""

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


def block_mismatch(header: BlockHeader, dtype: str, shape: tuple[int, ...] | None = None,
                   layout: Layout | str | None = None) -> str:
    """How a block does not fit a destination of ``dtype`` (and ``shape``, and ``layout``, where given); ``""`` if
    it fits. The one check of a block against what it is copied into, or stored under.

    Args:
        header: the block's parsed header.
        dtype: the destination's codec dtype name, e.g. ``bfloat16``.
        shape: the destination's shape, e.g. ``[num_layers, 2, num_kv_heads, block_size, head_dim]``; not
            compared when ``None``.
        layout: the destination's layout (a :class:`~kvstore.blocks.tensors.Layout` or its value); not compared when ``None``.

    Returns:
        ``""``, or the block's then the destination's kind, e.g. ``"float16/kv [2, 2, 4, 16, 8], not bfloat16/kv
        [2, 2, 4, 16, 8]"`` (the layout only where compared, the shape only where given).
    """
    if (header.dtype == dtype and (shape is None or header.shape == shape)
            and (layout is None or header.layout is layout or header.layout.value == layout)):
        return ""
    wanted = layout.value if isinstance(layout, Layout) else layout
    kind = f"{header.dtype}" + (f"/{header.layout.value}" if layout is not None else "")
    other = f"{dtype}" + (f"/{wanted}" if layout is not None else "")
    if shape is not None:
        kind, other = f"{kind} {list(header.shape)}", f"{other} {list(shape)}"
    return f"{kind}, not {other}"


def blocks_for_put(blocks: Sequence[object], layout: Layout | str) -> list[Block]:
    """The blocks of a put, checked as encoding would check them but not encoded (no copy): what a transport takes.

    Encoded bytes and tensors pass through, numpy arrays become tensors over
    their memory (:func:`kvstore.blocks.tensors.as_block`); each tensor's dtype and
    shape are checked against the codec and ``layout``, and the batch must
    have one shape (:func:`kvstore.blocks.tensors.check_one_shape`), as
    :func:`kvstore.blocks.tensors.encode_blocks` would have it.

    Raises:
        InvalidArgumentError: on one block instead of a sequence, or a block of another type (named, with its index).
        UnknownDtypeError: on a tensor whose dtype has no codec code.
        ElementCountError: on a tensor whose shape does not fit the layout, or blocks of different shapes.
    """
    if isinstance(blocks, (bytes, bytearray, memoryview, str)):
        raise InvalidArgumentError(f"expected a sequence of blocks, got {type(blocks).__name__} (one block? pass [block])")
    layout = Layout(layout)
    checked: list[PutBlock] = [block if type(block) is bytes else as_block(block, index=i)
                               for i, block in enumerate(blocks)]
    seen, like = None, True  # like: every block a tensor of one dtype and shape (so of one shape: nothing to compare)
    for block in checked:
        if isinstance(block, (bytes, bytearray, memoryview)):
            like = False
            continue
        kind = (block.dtype, block.shape)
        if kind == seen:
            continue
        dtype_name(block.dtype)
        check_shape(layout, tuple(block.shape))
        like = like and seen is None
        seen = kind
    if not like:
        check_one_shape(checked, layout)
    return cast("list[Block]", checked)  # a bytearray or memoryview block is taken as its bytes, uncopied


def byte_view(buffer: Buffer) -> torch.Tensor:
    """A 1-D ``uint8`` tensor viewing ``buffer`` without a copy (read-only buffers too: never write into it)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the buffer is not writable: it is only read
        return torch.frombuffer(buffer, dtype=torch.uint8)


def copy_block_into(block: Buffer, destination: torch.Tensor, *, verify: bool,
                    source: torch.Tensor | None = None, position: int = 0, num_found: int = 1,
                    header: BlockHeader | None = None) -> BlockHeader:
    """Copy one encoded block's payload into ``destination`` (any device, any strides): one copy.

    Args:
        block: the encoded block (header, then payload).
        destination: a tensor of the block's dtype and shape, e.g. ``[num_layers, 2, num_kv_heads,
            block_size, head_dim]``; a slice of a larger tensor (a cache, a staging buffer) is fine.
        verify: check the block's checksum first.
        source: a ``uint8`` tensor over exactly ``block``'s bytes, if the caller has one (saves making it).
        position: the block's index in its call, for the error.
        num_found: blocks the call fetched, for the error.
        header: the block's header, parsed already (a block whose header bytes are another's, but for the
            checksum); without ``verify`` only.

    Returns:
        The block's header.

    Raises:
        DestinationMismatchError: if the block's dtype or shape is not the destination's.
        CodecError: if the block is malformed, or (with ``verify``) corrupt.
    """
    if header is None or verify:
        header = verify_block(block) if verify else decode_header(block)
    dtype = torch_dtype(header.dtype)
    if block_mismatch(header, _dtype_name(destination.dtype), tuple(destination.shape)):
        raise DestinationMismatchError(
            f"block {position} is {header.dtype} {list(header.shape)}, its destination "
            f"{str(destination.dtype).removeprefix('torch.')} {list(destination.shape)}", position, num_found)
    if header.encoding:  # a lossy block: decoded on the destination's device (kvstore.blocks.encoding)
        from kvstore.blocks.encoding import decode_block_into
        decode_block_into(block, header, destination, source)
        return header
    if header.payload_nbytes == 0:
        return header
    if destination.device.type == "cpu" and destination.is_contiguous():  # a memcpy: no parallel region (below)
        _memcpy_into(destination, memoryview(block).cast("B")[header.header_nbytes:header.nbytes])
        return header
    if source is None:
        source = byte_view(block)
    destination.copy_(source[header.header_nbytes:header.nbytes].view(dtype).view(header.shape))
    return header


_DTYPE_NAMES: dict[torch.dtype, str] = {}
"""The name of each torch dtype a destination had (``bfloat16``): a codec name where the codec has the dtype."""


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _memcpy_into(destination: torch.Tensor, payload: memoryview) -> None:
    """Copy ``payload`` into a contiguous CPU tensor's memory with one single-threaded memcpy (numpy's).

    Not ``Tensor.copy_``: for a block of a few hundred KiB torch opens an
    OpenMP parallel region, whose threads wait for cores a busy host (a gRPC
    client's own threads, other processes) does not give them: a Get into 96
    tensors took 6 ms to 1.6 s that way on a loaded 2-core host, and 5-7 ms
    with one thread (issue 40's slow mode of ``get_into``; ``benchmarks/results/bench_bulk.md``).
    """
    import numpy as np

    nbytes = payload.nbytes
    target = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(destination.data_ptr()))
    np.copyto(target, np.frombuffer(payload, dtype=np.uint8))


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

    Without ``verify``, a block whose length and header bytes (all but the checksum) are the block before's is
    not parsed again: its header is that block's (as ``kvstore.blocks.tensors.LikeBlocks`` has it).

    Raises:
        CodecError: on a malformed block, or (with ``verify``) a corrupt one.
    """
    at, end = CHECKSUM_SPAN
    header: BlockHeader | None = None
    lead = rest = b""
    for position, block in enumerate(blocks):
        like = None
        if header is not None and not verify:
            view = memoryview(block)
            if (view.nbytes == header.nbytes and view[:at] == lead
                    and view[end:header.header_nbytes] == rest):
                like = header
        try:
            parsed = copy_block_into(block, destinations[position], verify=verify,
                                     source=None if sources is None else sources[position], position=position,
                                     num_found=len(blocks), header=like)
        except DestinationMismatchError as exc:
            return Copied(position, len(blocks), exc)
        if parsed is not header:
            header = parsed
            view = memoryview(block).cast("B")
            lead, rest = bytes(view[:at]), bytes(view[end:header.header_nbytes])
    return Copied(len(blocks), len(blocks))


def copy_lent_into(blocks: Sequence[Buffer], destinations: Sequence[torch.Tensor], verify: bool,
                   pool: torch.Tensor | None = None, offsets: Sequence[int] | None = None) -> Copied:
    """Copy leased blocks into their destinations: with the buffer they view (``pool``, a 1-D ``uint8`` tensor,
    and each block's offset in it; ``kvstore.tiers.base.TierLoan.pool``), as one strided copy where the blocks lie
    evenly spaced and the destinations are the rows of one tensor (:func:`copy_batch_into`), else block by block
    from views of ``pool``; without it, as :func:`copy_into_destinations`.

    Raises:
        CodecError: on a malformed block, or (with ``verify``) a corrupt one.
    """
    if pool is None or offsets is None:
        return copy_into_destinations(blocks, destinations, verify)
    views = [block for block in blocks if isinstance(block, memoryview)]  # a tier's lease: views of its pool
    if not verify and len(views) == len(blocks):
        copied = copy_batch_into(views, destinations, pool, offsets)
        if copied is not None:
            return copied
    sources = [pool[offset:offset + len(block)] for offset, block in zip(offsets, blocks)]
    return copy_into_destinations(blocks, destinations, verify, sources)


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
    tensors = [b for b in blocks if isinstance(b, torch.Tensor) and b.dtype == dtype and b.shape == shape
               and b.device == device]
    if len(tensors) != num_blocks:
        return False
    step = offsets[1] - offsets[0]
    head = header_nbytes(first.dim())
    nbytes = head + first.numel() * first.element_size()
    if step < nbytes or any(offsets[i + 1] - offsets[i] != step for i in range(num_blocks - 1)):
        return False
    start = offsets[0]
    header = bytearray(blank_header(dtype_name(dtype), layout, tuple(shape)))  # checksum field zero, taken below
    at = CHECKSUM_SPAN[0]
    base = target_bytes.storage_offset() + start
    heads = target_bytes.as_strided((num_blocks, head), (step, 1), base)
    heads.copy_(torch.frombuffer(header, dtype=torch.uint8).expand(num_blocks, head))
    payloads = target_bytes.as_strided((num_blocks, nbytes - head), (step, 1), base + head)
    rows = payloads.view(dtype).view(num_blocks, *shape)
    pack_into, digest = _CHECKSUM_FIELD.pack_into, xxhash.xxh3_64_intdigest
    stacked = _stacked(tensors)
    per_copy = max(1, _COPY_CHUNK_BYTES // nbytes) if stacked is not None else 1
    for begin in range(0, num_blocks, per_copy):
        end = min(num_blocks, begin + per_copy)
        if stacked is not None:
            rows[begin:end].copy_(stacked[begin:end])
        else:
            rows[begin].copy_(tensors[begin].detach())
        for offset in offsets[begin:end]:
            pack_into(target, offset + at, digest(target[offset:offset + nbytes]))
    return True


_COPY_CHUNK_BYTES = 2 << 20
"""Blocks stacked in one tensor are copied this many bytes at a time, and checksummed while the copy is in cache:
one ``copy_`` (and one parallel region of torch's threads) per chunk instead of per block."""


def _stacked(blocks: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``blocks`` as one ``[num_blocks, *shape]`` view, where they are evenly spaced views of one storage with
    one layout (the rows of one tensor, ``list(t.unbind(0))``), else ``None``."""
    first = blocks[0].detach()
    if len(blocks) < 2 or first.device.type != "cpu":
        return None
    start = first.data_ptr()
    step = blocks[1].data_ptr() - start
    item = first.element_size()
    strides = first.stride()
    if step <= 0 or step % item:
        return None
    for i, block in enumerate(blocks):
        if block.data_ptr() != start + i * step or block.stride() != strides:
            return None
    try:  # within the first block's storage (torch checks), so every block's memory is that storage's
        return first.as_strided((len(blocks), *first.shape), (step // item, *strides))
    except RuntimeError:  # separate tensors that merely lie evenly spaced: copy block by block
        return None


class TensorBlock:
    """One block of a put still as the caller's tensor: encoded only where it is stored, with one copy of its
    payload and one checksum taken over that copy where it lies.

    What the embedded store hands its store for each tensor of a put (:func:`tensor_blocks`): the memory tier
    writes it straight into its pool (:meth:`encode_into`, or :func:`encode_batch_into` for a batch laid out
    evenly), and any other tier takes :meth:`encoded` bytes (``kvstore.store.mover``). Byte for byte what
    :func:`kvstore.blocks.tensors.encode_block` makes of the tensor. It reads the caller's tensor, which the caller may
    change once the put has returned, so it is valid only during the put: what outlives the put (a queued
    write-through) takes :meth:`encoded` bytes first.

    Args:
        tensor: the block, ``[num_layers, 2, num_kv_heads, block_size, head_dim]`` (``kv``) or ``[num_layers, 1,
            block_size, latent_dim]`` (``mla``), any device and strides, of a codec dtype.
        header: its parsed header (checksum 0), shared by the blocks of one batch.
        blank: its header bytes with the checksum field zero (:func:`kvstore.blocks.tensors.blank_header`), shared too.

    Attributes:
        nbytes: the encoded length, header and payload, bytes (``len``).
    """

    __slots__ = ("tensor", "header", "blank", "nbytes", "_encoded")

    def __init__(self, tensor: torch.Tensor, header: BlockHeader, blank: bytes) -> None:
        self.tensor = tensor
        self.header = header
        self.blank = blank
        self.nbytes = header.nbytes
        self._encoded: bytes | None = None

    def __len__(self) -> int:
        """The encoded length, header and payload, bytes (:attr:`nbytes`)."""
        return self.nbytes

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape (what :func:`kvstore.blocks.tensors.check_one_shape` compares)."""
        return self.header.shape

    def encode_into(self, target: memoryview, target_bytes: torch.Tensor) -> None:
        """Write the block encoded at the start of ``target``: the payload copied from the tensor, the header, then
        the checksum of both where they lie.

        Args:
            target: a writable range of at least ``len(self)`` bytes.
            target_bytes: a ``uint8`` tensor over the same range.
        """
        header, head = self.header, self.header.header_nbytes
        nbytes = header.nbytes
        if header.payload_nbytes:
            target_bytes[head:nbytes].view(self.tensor.dtype).view(header.shape).copy_(self.tensor.detach())
        target[:head] = self.blank
        _CHECKSUM_FIELD.pack_into(target, CHECKSUM_SPAN[0], _xxh3_64(target[:nbytes]))

    def encoded(self) -> bytes:
        """The block encoded as ``bytes`` (made once: one copy of the payload and its checksum)."""
        if self._encoded is None:
            self._encoded = encode_block(self.tensor, self.header.layout)
        return self._encoded


def _xxh3_64(data: memoryview) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(data)


def tensor_blocks(blocks: Sequence[object], layout: Layout | str) -> list[Buffer | TensorBlock]:
    """The blocks of a put as an in-process store takes them: encoded bytes as they are, each tensor (or numpy
    array) a :class:`TensorBlock`, checked as :func:`blocks_for_put` checks it; no payload is copied yet.

    Raises:
        InvalidArgumentError, UnknownDtypeError, ElementCountError: as :func:`blocks_for_put`.
    """
    layout = Layout(layout)
    checked = blocks_for_put(blocks, layout)
    made: list[Buffer | TensorBlock] = []
    for block in checked:
        if isinstance(block, (bytes, bytearray, memoryview)):
            made.append(block)
            continue
        key = (block.dtype, block.shape, layout)
        kind = _KINDS.get(key)
        if kind is None:
            name, shape = dtype_name(block.dtype), tuple(block.shape)
            blank = blank_header(name, layout, shape)
            payload = block.numel() * block.element_size()
            kind = (BlockHeader(name, layout, shape, len(blank), payload, 0), blank)
            if len(_KINDS) >= _MAX_KINDS:
                _KINDS.clear()
            _KINDS[key] = kind
        made.append(TensorBlock(block, *kind))
    return made


_KINDS: dict[tuple[object, object, Layout], tuple[BlockHeader, bytes]] = {}
"""Header and blank header bytes of each tensor dtype, shape and layout seen (a process puts a few)."""
_MAX_KINDS = 64


def encoded_values(values: Sequence[Buffer | TensorBlock]) -> list[Buffer]:
    """``values`` with each :class:`TensorBlock` as its :meth:`~TensorBlock.encoded` bytes: for a tier that stores
    bytes, or for what outlives the put."""
    return [v.encoded() if isinstance(v, TensorBlock) else v for v in values]
