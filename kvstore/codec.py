"""The block codec: KV tensors as raw bytes behind an explicit header, never pickle.

Wire and disk format of one block (all integers little-endian)::

    offset  size  field
    0       4     magic b"KVB\\x01"
    4       2     version (1)
    6       1     dtype code (see DTYPES)
    7       1     layout code (see Layout)
    8       1     ndim
    9       1     flags (0)
    10      2     header_nbytes: offset of the payload, a multiple of 64
    12      8     payload_nbytes
    20      8     xxh3-64 checksum of the payload
    28      8*n   shape, one uint64 per dimension
    ...           zero padding up to header_nbytes
    header_nbytes payload: the tensor's bytes in C order

The payload is 64-byte aligned inside the buffer so that ``torch.frombuffer``
can view it without a copy. Shapes follow the layout:

* ``kv``  (default): ``[num_layers, 2, num_kv_heads, block_size, head_dim]``,
  the per-layer K and V of vLLM's paged layout stacked along dim 1. GQA and MQA
  are expressed through ``num_kv_heads``.
* ``mla``: ``[num_layers, 1, block_size, latent_dim]``, one compressed latent
  per layer as in DeepSeek-V2's multi-head latent attention.
"""

from __future__ import annotations

import enum
import math
import struct
import warnings
from dataclasses import dataclass

from typing import TYPE_CHECKING, Sequence
import xxhash

if TYPE_CHECKING:  # torch is imported on first use, so parsing a header (the server, `kvstore health`) never loads it
    import torch

from kvstore.errors import (
    BadMagicError,
    ChecksumError,
    ElementCountError,
    TruncatedBlockError,
    UnknownDtypeError,
)

MAGIC = b"KVB\x01"
VERSION = 1
ALIGNMENT = 64
MAX_NDIM = 8
_FIXED = struct.Struct("<4sHBBBBHQQ")  # 28 bytes

DTYPES: dict[str, tuple[int, int]] = {
    "float32": (1, 4),
    "float16": (2, 2),
    "bfloat16": (3, 2),
    "float8_e4m3fn": (4, 1),
    "float8_e5m2": (5, 1),
    "int8": (6, 1),
    "uint8": (7, 1),
    "float64": (8, 8),
}
"""Codec dtype names (as ``torch.<name>``), their one-byte codes and item sizes in bytes. Codes are frozen."""

_CODE_TO_NAME = {code: name for name, (code, _) in DTYPES.items()}


class Layout(str, enum.Enum):
    """Layout tag of a block; the value is stored in the namespace, the code in the header."""

    KV = "kv"
    MLA = "mla"

    @property
    def code(self) -> int:
        """The header's one-byte code of this layout."""
        return _LAYOUT_CODES[self]

    @property
    def ndim(self) -> int:
        """Number of dimensions a block of this layout has."""
        return 5 if self is Layout.KV else 4


_LAYOUT_CODES = {Layout.KV: 1, Layout.MLA: 2}
_CODE_TO_LAYOUT = {code: layout for layout, code in _LAYOUT_CODES.items()}


def dtype_name(dtype: torch.dtype | str) -> str:
    """Return the codec name of a torch dtype or dtype name.

    Raises:
        UnknownDtypeError: if the codec has no code for it.
    """
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name not in DTYPES:
            raise UnknownDtypeError(f"unknown dtype {dtype!r}; known: {sorted(DTYPES)}")
        return name
    try:
        name = str(dtype).removeprefix("torch.")
        if name in DTYPES and getattr(_torch(), name) == dtype:
            return name
        raise KeyError(name)
    except KeyError:
        raise UnknownDtypeError(f"unknown dtype {dtype}; known: {sorted(DTYPES)}") from None


def torch_dtype(name: str) -> torch.dtype:
    """Return the torch dtype of a codec dtype name.

    Raises:
        UnknownDtypeError: if the name is unknown.
    """
    return getattr(_torch(), dtype_name(name))


def _torch():  # type: ignore[no-untyped-def]
    import torch

    return torch


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The parsed header of one encoded block.

    Attributes:
        dtype: codec dtype name.
        layout: layout tag.
        shape: tensor shape (see the module docstring for each layout).
        header_nbytes: offset of the payload in the buffer, bytes.
        payload_nbytes: payload length, bytes.
        checksum: xxh3-64 of the payload.
    """

    dtype: str
    layout: Layout
    shape: tuple[int, ...]
    header_nbytes: int
    payload_nbytes: int
    checksum: int

    @property
    def nbytes(self) -> int:
        """Total encoded length: header plus payload, bytes."""
        return self.header_nbytes + self.payload_nbytes


def header_nbytes(ndim: int) -> int:
    """Bytes of a header for a tensor of ``ndim`` dimensions (a multiple of 64)."""
    raw = _FIXED.size + 8 * ndim
    return -(-raw // ALIGNMENT) * ALIGNMENT


def _check_shape(layout: Layout, shape: tuple[int, ...]) -> None:
    if len(shape) != layout.ndim:
        raise ElementCountError(f"layout {layout.value!r} needs {layout.ndim} dims, got shape {list(shape)}")
    if layout is Layout.KV and shape[1] != 2:
        raise ElementCountError(f"layout 'kv' needs dim 1 == 2 (K and V), got shape {list(shape)}")
    if layout is Layout.MLA and shape[1] != 1:
        raise ElementCountError(f"layout 'mla' needs dim 1 == 1 (one latent), got shape {list(shape)}")


def encode_header(dtype: str, layout: Layout | str, shape: tuple[int, ...], payload: bytes | memoryview) -> bytes:
    """Build the header for ``payload`` (raw tensor bytes in C order).

    Raises:
        UnknownDtypeError: on an unknown dtype.
        ElementCountError: if ``len(payload) != prod(shape) * itemsize`` or the
            shape does not fit the layout.
    """
    name = dtype_name(dtype)
    layout = Layout(layout)
    shape = tuple(int(d) for d in shape)
    _check_shape(layout, shape)
    payload = memoryview(payload).cast("B")
    itemsize = DTYPES[name][1]
    if math.prod(shape) * itemsize != payload.nbytes:
        raise ElementCountError(
            f"payload of {payload.nbytes} bytes does not hold shape {list(shape)} of {name}"
        )
    size = header_nbytes(len(shape))
    header = bytearray(size)
    _FIXED.pack_into(
        header, 0, MAGIC, VERSION, DTYPES[name][0], layout.code, len(shape), 0, size,
        payload.nbytes, xxhash.xxh3_64_intdigest(payload),
    )
    struct.pack_into(f"<{len(shape)}Q", header, _FIXED.size, *shape)
    return bytes(header)


def encode_block(tensor: torch.Tensor, layout: Layout | str = Layout.KV) -> bytes:
    """Encode one block tensor as header plus raw payload bytes.

    Args:
        tensor: ``[num_layers, 2, num_kv_heads, block_size, head_dim]`` for the
            ``kv`` layout, ``[num_layers, 1, block_size, latent_dim]`` for ``mla``;
            any device (it is copied to the host once).
        layout: layout tag.

    Returns:
        ``header || payload``; one copy of the payload is made.

    Raises:
        UnknownDtypeError: if the tensor's dtype has no codec code.
        ElementCountError: if the shape does not fit the layout.
    """
    torch = _torch()
    name = dtype_name(tensor.dtype)
    host = tensor.detach().to("cpu").contiguous()
    payload = memoryview(host.reshape(-1).view(torch.uint8).numpy())
    return b"".join((encode_header(name, layout, tuple(host.shape), payload), payload))


def encode_blocks(blocks: Sequence[object], layout: Layout | str = Layout.KV) -> list[bytes]:
    """Encode the tensors of ``blocks`` with :func:`encode_block` in ``layout``; encoded bytes pass through unchanged.

    What the clients and the embedded store do with the blocks a put is given
    (tensors of the namespace's layout, or blocks encoded already).

    Raises:
        UnknownDtypeError: if a tensor's dtype has no codec code.
        ElementCountError: if a tensor's shape does not fit the layout.
    """
    return [b if isinstance(b, (bytes, bytearray, memoryview)) else encode_block(b, layout)  # type: ignore[misc]
            for b in blocks]


def decode_header(buf: bytes | bytearray | memoryview) -> BlockHeader:
    """Parse and validate the header of an encoded block, without touching the payload.

    Raises:
        TruncatedBlockError: if ``buf`` is shorter than the header or header plus payload.
        BadMagicError: on a wrong magic or version.
        UnknownDtypeError: on an unknown dtype code.
        ElementCountError: if the payload size, shape and layout disagree, or
            bytes trail the payload.
    """
    view = memoryview(buf).cast("B")
    if view.nbytes < _FIXED.size:
        raise TruncatedBlockError(f"block of {view.nbytes} bytes is shorter than the {_FIXED.size}-byte header")
    magic, version, dtype_code, layout_code, ndim, _flags, hdr_nbytes, payload_nbytes, checksum = (
        _FIXED.unpack_from(view, 0)
    )
    if magic != MAGIC or version != VERSION:
        raise BadMagicError(f"not a kvstore block (magic {bytes(magic)!r}, version {version})")
    if dtype_code not in _CODE_TO_NAME:
        raise UnknownDtypeError(f"unknown dtype code {dtype_code}")
    if layout_code not in _CODE_TO_LAYOUT:
        raise ElementCountError(f"unknown layout code {layout_code}")
    if not 0 < ndim <= MAX_NDIM or hdr_nbytes != header_nbytes(ndim):
        raise ElementCountError(f"bad header: ndim {ndim}, header of {hdr_nbytes} bytes")
    if view.nbytes < hdr_nbytes:
        raise TruncatedBlockError(f"block of {view.nbytes} bytes is shorter than its {hdr_nbytes}-byte header")
    shape = struct.unpack_from(f"<{ndim}Q", view, _FIXED.size)
    name = _CODE_TO_NAME[dtype_code]
    layout = _CODE_TO_LAYOUT[layout_code]
    _check_shape(layout, shape)
    if math.prod(shape) * DTYPES[name][1] != payload_nbytes:
        raise ElementCountError(f"header shape {list(shape)} of {name} does not match payload of {payload_nbytes} bytes")
    if view.nbytes < hdr_nbytes + payload_nbytes:
        raise TruncatedBlockError(
            f"block is truncated: {view.nbytes} bytes, header says {hdr_nbytes + payload_nbytes}"
        )
    if view.nbytes > hdr_nbytes + payload_nbytes:
        raise ElementCountError(
            f"{view.nbytes - hdr_nbytes - payload_nbytes} bytes trail the payload the header describes"
        )
    return BlockHeader(name, layout, shape, hdr_nbytes, payload_nbytes, checksum)


def verify_block(buf: bytes | bytearray | memoryview) -> BlockHeader:
    """Validate an encoded block completely: header, sizes and payload checksum.

    Returns:
        The parsed header.

    Raises:
        CodecError: a subclass naming the cause (see :func:`decode_header`), or
            :class:`ChecksumError` if the payload is corrupt.
    """
    header = decode_header(buf)
    payload = memoryview(buf).cast("B")[header.header_nbytes :]
    if xxhash.xxh3_64_intdigest(payload) != header.checksum:
        raise ChecksumError("payload checksum mismatch: the block is corrupt")
    return header


def decode_block(buf: bytes | bytearray | memoryview, *, verify: bool = True) -> torch.Tensor:
    """Decode an encoded block into a CPU tensor that views ``buf`` without a copy.

    The tensor shares memory with ``buf``; when ``buf`` is immutable (``bytes``)
    the caller must not write to it (clone or ``.to(device)`` first).

    Args:
        buf: ``header || payload`` as produced by :func:`encode_block`.
        verify: check the payload checksum (skip only for bytes verified already).

    Returns:
        A tensor of the header's dtype and shape.

    Raises:
        CodecError: a subclass naming the cause (see :func:`verify_block`).
    """
    torch = _torch()
    header = verify_block(buf) if verify else decode_header(buf)
    if header.payload_nbytes == 0:
        return torch.empty(header.shape, dtype=torch_dtype(header.dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers: documented above
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=header.payload_nbytes, offset=header.header_nbytes)
    return flat.view(torch_dtype(header.dtype)).view(header.shape)
