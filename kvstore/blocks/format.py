"""The block format: a KV block's bytes behind an explicit header (dtypes, layouts, header, checksum), no torch.

The floor that the codec (``kvstore.blocks.tensors``: tensors to blocks and back), the
lossy encodings (``kvstore.blocks.encoding``), the keys and the tiers stand on; it
imports only the errors and the lossy encodings' size arithmetic
(``kvstore.blocks.encoding.spec``, which imports nothing of ours but the errors).

Wire and disk format of one block (all integers little-endian)::

    offset  size  field
    0       4     magic b"KVB\\x01"
    4       2     version (2)
    6       1     dtype code (see DTYPES)
    7       1     layout code (see Layout)
    8       1     ndim
    9       1     flags (0, or 1: the payload is lossily encoded)
    10      2     header_nbytes: offset of the payload, a multiple of 64
    12      8     payload_nbytes
    20      8     checksum: xxh3-64 of the whole block with these 8 bytes as zeros
    28      8*n   shape, one uint64 per dimension
    28+8n   4     only with flag 1: encoding code (u8), 0 (u8), value group (u16)
    ...           zero padding up to header_nbytes
    header_nbytes payload: the tensor's bytes in C order (flag 1: the encoding's sections)

The checksum covers every byte of the block: the header (its own field read
as zeros, so that it can be computed before it is written) and the payload,
in that order, as one xxh3-64 stream with seed 0. A reader that checks it knows
that the dtype, layout, shape, flags and padding are the ones the writer set,
not only the payload. Padding and unknown flags must be zero.

Flag 1 marks a block of a lossy KV encoding (``kvstore.blocks.encoding``): the dtype
and shape are the tensor's before encoding (what a reader gets back), and the
payload is that encoding's scales and data (``kvstore/blocks/encoding/spec.py``), its
size set by the encoding, the shape and the group. The checksum covers the
encoding's code, its group and its scales like any other byte. A reader refuses
a code it does not know (:class:`~kvstore.errors.UnknownEncodingError`), and an
exact block is byte for byte what it was before encodings existed.

Version 1 checksummed the payload alone, so a flipped dtype byte (float16 read
as bfloat16) went unseen. It is no longer read: a version-1 block is a
:class:`~kvstore.errors.BadMagicError` naming the version, and stored ones are
dropped (``docs/disk.md``, ``docs/security.md``).

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import xxhash

if TYPE_CHECKING:  # torch is imported on first use, so parsing a header (the server, `kvstore health`) never loads it
    import torch

from kvstore.blocks.encoding.spec import Encoding, encoding_of, encoding_of_code, payload_plan
from kvstore.errors import (
    BadMagicError,
    ChecksumError,
    ElementCountError,
    TruncatedBlockError,
    UnknownDtypeError,
    UnsupportedVersionError,
)

__all__ = ["ALIGNMENT", "CHECKSUM_SPAN", "DTYPES", "FLAG_ENCODED", "MAGIC", "MAX_NDIM", "VERSION", "BlockHeader",
           "Layout", "LikeBlocks", "blank_header", "block_checksum", "check_one_shape", "check_shape",
           "decode_header", "dtype_name", "encode_header", "encoding_of", "header_nbytes", "torch_dtype",
           "verify_block"]

MAGIC = b"KVB\x01"
VERSION = 2
"""The block format this build writes and reads (see the module docstring); version 1 is refused."""
ALIGNMENT = 64
MAX_NDIM = 8
_FIXED = struct.Struct("<4sHBBBBHQQ")  # 28 bytes
CHECKSUM_SPAN = (_FIXED.size - 8, _FIXED.size)
"""Where a header holds the block's checksum, ``[start, end)`` bytes: the rest of two blocks' headers is equal
exactly when their dtype, layout and shape are."""
_CHECKSUM_AT = 20  # offset of the checksum field in the header
_CHECKSUM_BYTES = 8
_NO_CHECKSUM = bytes(_CHECKSUM_BYTES)
FLAG_ENCODED = 0x01
"""Header flag: the payload is a lossy encoding's (see the module docstring)."""
_ENCODING = struct.Struct("<BBH")  # code, reserved (0), value group

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


def dtype_name(dtype: torch.dtype | str | object) -> str:
    """Return the codec name of a torch dtype or dtype name (anything else is an unknown dtype).

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
        import torch

        if name in DTYPES and getattr(torch, name) == dtype:
            return name
        raise KeyError(name)
    except KeyError:
        raise UnknownDtypeError(f"unknown dtype {dtype}; known: {sorted(DTYPES)}") from None


def torch_dtype(name: str) -> torch.dtype:
    """Return the torch dtype of a codec dtype name.

    Raises:
        UnknownDtypeError: if the name is unknown.
    """
    import torch

    dtype: torch.dtype = getattr(torch, dtype_name(name))
    return dtype




@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The parsed header of one encoded block.

    Attributes:
        dtype: codec dtype name.
        layout: layout tag.
        shape: tensor shape (see the module docstring for each layout).
        header_nbytes: offset of the payload in the buffer, bytes.
        payload_nbytes: payload length, bytes.
        checksum: xxh3-64 of the whole block, its own field as zeros (see the module docstring).
        encoding: the lossy KV encoding's name (``kvstore.blocks.encoding.Encoding``), ``""`` for an exact block.
        group: the encoding's value group (channels; 0 where it has none).
    """

    dtype: str
    layout: Layout
    shape: tuple[int, ...]
    header_nbytes: int
    payload_nbytes: int
    checksum: int
    encoding: str = ""
    group: int = 0

    @property
    def nbytes(self) -> int:
        """Total encoded length: header plus payload, bytes."""
        return self.header_nbytes + self.payload_nbytes

    @property
    def logical_nbytes(self) -> int:
        """Bytes of the tensor the block holds, as the engine holds it (``prod(shape) * itemsize``)."""
        return math.prod(self.shape) * DTYPES[self.dtype][1]


def header_nbytes(ndim: int, *, encoded: bool = False) -> int:
    """Bytes of a header for a tensor of ``ndim`` dimensions (a multiple of 64); ``encoded``: of a lossy block."""
    raw = _FIXED.size + 8 * ndim + (_ENCODING.size if encoded else 0)
    return -(-raw // ALIGNMENT) * ALIGNMENT


def check_shape(layout: Layout, shape: tuple[int, ...]) -> None:
    """Check that ``shape`` is one of ``layout``'s (see the module docstring): its number of dimensions, and dim 1.

    Raises:
        ElementCountError: naming the layout and the shape, if it is not.
    """
    if len(shape) != layout.ndim:
        raise ElementCountError(f"layout {layout.value!r} needs {layout.ndim} dims, got shape {list(shape)}")
    if layout is Layout.KV and shape[1] != 2:
        raise ElementCountError(f"layout 'kv' needs dim 1 == 2 (K and V), got shape {list(shape)}")
    if layout is Layout.MLA and shape[1] != 1:
        raise ElementCountError(f"layout 'mla' needs dim 1 == 1 (one latent), got shape {list(shape)}")


def encode_header(dtype: str, layout: Layout | str, shape: tuple[int, ...], payload: bytes | memoryview, *,
                  encoding: Encoding | str | None = None, group: int = 0) -> bytes:
    """Build the header for ``payload`` (raw tensor bytes in C order, or a lossy encoding's sections).

    Args:
        dtype, layout, shape: the tensor's (before any encoding).
        payload: the payload bytes.
        encoding: the lossy encoding of ``payload``; ``None`` or ``""`` for raw bytes (flags 0).
        group: the encoding's value group (``kvstore.blocks.encoding.spec.payload_plan``).

    Raises:
        UnknownDtypeError: on an unknown dtype.
        UnknownEncodingError: on an unknown encoding.
        ElementCountError: if ``len(payload) != prod(shape) * itemsize`` (or the encoding's size) or the
            shape does not fit the layout.
    """
    name = dtype_name(dtype)
    layout = Layout(layout)
    shape = tuple(int(d) for d in shape)
    check_shape(layout, shape)
    payload = memoryview(payload).cast("B")
    itemsize = DTYPES[name][1]
    lossy = encoding_of(encoding.value if isinstance(encoding, Encoding) else encoding)
    expected = math.prod(shape) * itemsize if lossy is None else payload_plan(lossy, layout.value, shape,
                                                                              group).payload_nbytes
    if expected != payload.nbytes:
        raise ElementCountError(
            f"payload of {payload.nbytes} bytes does not hold shape {list(shape)} of {name}"
            + ("" if lossy is None else f" encoded as {lossy.value}")
        )
    header = _blank_header(name, layout, shape, payload.nbytes, lossy, group)
    struct.pack_into("<Q", header, _CHECKSUM_AT, block_checksum(header, payload))
    return bytes(header)


def blank_header(dtype: str, layout: Layout | str, shape: tuple[int, ...]) -> bytes:
    """The header of an exact block of ``dtype`` and ``shape`` with its checksum field zero: what a writer that
    checksums the block where it lies (``kvstore.blocks.copying``) writes before the payload, then fills the field in.

    The checksum is then xxh3-64 (seed 0) of the whole block as it lies, this header first (see the module
    docstring): :func:`block_checksum` of the same header and payload.

    Raises:
        UnknownDtypeError: on an unknown dtype.
        ElementCountError: if the shape does not fit the layout.
    """
    name = dtype_name(dtype)
    layout = Layout(layout)
    shape = tuple(int(d) for d in shape)
    check_shape(layout, shape)
    return bytes(_blank_header(name, layout, shape, math.prod(shape) * DTYPES[name][1], None, 0))


def _blank_header(name: str, layout: Layout, shape: tuple[int, ...], payload_nbytes: int, lossy: Encoding | None,
                  group: int) -> bytearray:
    size = header_nbytes(len(shape), encoded=lossy is not None)
    header = bytearray(size)
    _FIXED.pack_into(header, 0, MAGIC, VERSION, DTYPES[name][0], layout.code, len(shape),
                     0 if lossy is None else FLAG_ENCODED, size, payload_nbytes, 0)
    struct.pack_into(f"<{len(shape)}Q", header, _FIXED.size, *shape)
    if lossy is not None:
        _ENCODING.pack_into(header, _FIXED.size + 8 * len(shape), lossy.code, 0, group)
    return header


def block_checksum(header: bytes | bytearray | memoryview, payload: bytes | bytearray | memoryview) -> int:
    """The checksum of a block: xxh3-64 (seed 0) of ``header`` with its checksum field read as zeros, then ``payload``.

    Args:
        header: the block's ``header_nbytes`` header bytes (whatever its checksum field holds).
        payload: the payload bytes.

    Returns:
        The unsigned 64-bit digest stored at offset 20 of the header.
    """
    head = memoryview(header).cast("B")
    digest = xxhash.xxh3_64()
    digest.update(head[:_CHECKSUM_AT])
    digest.update(_NO_CHECKSUM)
    digest.update(head[_CHECKSUM_AT + _CHECKSUM_BYTES:])
    digest.update(payload)
    return digest.intdigest()


def decode_header(buf: bytes | bytearray | memoryview) -> BlockHeader:
    """Parse and validate the header of an encoded block, without touching the payload.

    Raises:
        TruncatedBlockError: if ``buf`` is shorter than the header or header plus payload.
        BadMagicError: on a wrong magic; :class:`~kvstore.errors.UnsupportedVersionError`
            on a version other than :data:`VERSION` (naming it).
        UnknownDtypeError: on an unknown dtype code.
        UnknownEncodingError: on a lossy block of an encoding code this build does not know.
        ElementCountError: if the payload size, shape, layout and encoding disagree, bytes
            trail the payload, or unknown flags or the padding are not zero.
    """
    view = memoryview(buf).cast("B")
    if view.nbytes < _FIXED.size:
        raise TruncatedBlockError(f"block of {view.nbytes} bytes is shorter than the {_FIXED.size}-byte header")
    magic, version, dtype_code, layout_code, ndim, _flags, hdr_nbytes, payload_nbytes, checksum = (
        _FIXED.unpack_from(view, 0)
    )
    if magic != MAGIC:
        raise BadMagicError(f"not a kvstore block (magic {bytes(magic)!r})")
    if version != VERSION:
        raise UnsupportedVersionError(f"kvstore block format version {version} is not read by this build, which reads version "
                            f"{VERSION} (its checksum covers the header too); encode the block with this kvstore")
    if _flags & ~FLAG_ENCODED:
        raise ElementCountError(f"bad header: flags {_flags:#04x}, only {FLAG_ENCODED:#04x} is known")
    encoded = bool(_flags & FLAG_ENCODED)
    if dtype_code not in _CODE_TO_NAME:
        raise UnknownDtypeError(f"unknown dtype code {dtype_code}")
    if layout_code not in _CODE_TO_LAYOUT:
        raise ElementCountError(f"unknown layout code {layout_code}")
    if not 0 < ndim <= MAX_NDIM or hdr_nbytes != header_nbytes(ndim, encoded=encoded):
        raise ElementCountError(f"bad header: ndim {ndim}, header of {hdr_nbytes} bytes")
    if view.nbytes < hdr_nbytes:
        raise TruncatedBlockError(f"block of {view.nbytes} bytes is shorter than its {hdr_nbytes}-byte header")
    shape = struct.unpack_from(f"<{ndim}Q", view, _FIXED.size)
    padding = _FIXED.size + 8 * ndim
    encoding, group, reserved = None, 0, 0
    if encoded:
        code, reserved, group = _ENCODING.unpack_from(view, padding)
        encoding = encoding_of_code(code)
        padding += _ENCODING.size
    if reserved or any(view[padding: hdr_nbytes]):
        raise ElementCountError("bad header: its padding is not zero")
    name = _CODE_TO_NAME[dtype_code]
    layout = _CODE_TO_LAYOUT[layout_code]
    check_shape(layout, shape)
    expected = (math.prod(shape) * DTYPES[name][1] if encoding is None
                else payload_plan(encoding, layout.value, shape, group).payload_nbytes)
    if expected != payload_nbytes:
        raise ElementCountError(f"header shape {list(shape)} of {name}"
                                + ("" if encoding is None else f" encoded as {encoding.value}")
                                + f" does not match payload of {payload_nbytes} bytes")
    if view.nbytes < hdr_nbytes + payload_nbytes:
        raise TruncatedBlockError(
            f"block is truncated: {view.nbytes} bytes, header says {hdr_nbytes + payload_nbytes}"
        )
    if view.nbytes > hdr_nbytes + payload_nbytes:
        raise ElementCountError(
            f"{view.nbytes - hdr_nbytes - payload_nbytes} bytes trail the payload the header describes"
        )
    return BlockHeader(name, layout, shape, hdr_nbytes, payload_nbytes, checksum,
                       "" if encoding is None else encoding.value, group)


def verify_block(buf: bytes | bytearray | memoryview) -> BlockHeader:
    """Validate an encoded block completely: header, sizes and the checksum of every byte.

    Returns:
        The parsed header.

    Raises:
        CodecError: a subclass naming the cause (see :func:`decode_header`), or
            :class:`ChecksumError` if any byte of the header or payload is not what was written.
    """
    header = decode_header(buf)
    view = memoryview(buf).cast("B")
    if block_checksum(view[: header.header_nbytes], view[header.header_nbytes :]) != header.checksum:
        raise ChecksumError("checksum mismatch: the block (header or payload) is corrupt")
    return header


class LikeBlocks:
    """Verifies blocks like one already verified (its header byte for byte, but for the checksum) without parsing
    their headers: what a batch of one dtype and shape, such as a Put's, needs checked per block.

    A block whose length and header bytes (all but the checksum field) are the
    reference's decodes to the reference's header exactly (the same dtype,
    layout, shape, flags, sizes and padding), so only its checksum is left to
    check: xxh3-64 of those header bytes is taken once, and each block's payload
    continues a copy of it.

    Args:
        header: the reference block's header, from :func:`verify_block`.
        block: the reference block.
    """

    __slots__ = ("header", "_nbytes", "_lead", "_rest", "_digest")

    def __init__(self, header: BlockHeader, block: bytes | bytearray | memoryview) -> None:
        view = memoryview(block).cast("B")
        self.header = header
        self._nbytes = view.nbytes
        self._lead = bytes(view[:_CHECKSUM_AT])
        self._rest = bytes(view[_CHECKSUM_AT + _CHECKSUM_BYTES:header.header_nbytes])
        digest = xxhash.xxh3_64()
        digest.update(self._lead)
        digest.update(_NO_CHECKSUM)
        digest.update(self._rest)
        self._digest = digest

    def matches(self, block: bytes | bytearray | memoryview) -> bool:
        """Whether a block has the reference's length and header bytes (all but the checksum field), so that its
        header is the reference's :attr:`header`; nothing of its payload is read."""
        view = memoryview(block).cast("B")
        return (view.nbytes == self._nbytes and view[:_CHECKSUM_AT] == self._lead
                and view[_CHECKSUM_AT + _CHECKSUM_BYTES:self.header.header_nbytes] == self._rest)

    def verify(self, block: bytes | bytearray | memoryview) -> bool:
        """Check a block like the reference: ``True`` if it is one and intact, ``False`` if it is not like it
        (its length or a header byte differs: check it with :func:`verify_block`).

        Raises:
            ChecksumError: if it is like the reference but a byte of its header or payload is not what was written.
        """
        view = memoryview(block).cast("B")
        if not self.matches(view):
            return False
        head = self.header.header_nbytes
        digest = self._digest.copy()
        digest.update(view[head:])
        if digest.intdigest() != int.from_bytes(view[_CHECKSUM_AT:_CHECKSUM_AT + _CHECKSUM_BYTES], "little"):
            raise ChecksumError("checksum mismatch: the block (header or payload) is corrupt")
        return True


def check_one_shape(blocks: Sequence[bytes | bytearray | memoryview | torch.Tensor],
                    layout: Layout | str = Layout.KV) -> None:
    """Check that the blocks of one call have one model's shape, as the blocks of one namespace must.

    A namespace names one model's KV, so its blocks share the layout and every
    dimension but the tokens' (layers, K/V, KV heads, head size); a batch that
    mixes, say, 32-layer and 16-layer blocks was put under the wrong namespace.
    Only headers are compared (a few bytes each), or the shapes of tensors not
    yet encoded (which ``layout`` is theirs). The dtype and the tokens per
    block are checked against the namespace itself by the store, and malformed
    blocks by :func:`verify_block`.

    Raises:
        ElementCountError: naming the first block whose shape differs from block 0's, and both shapes.
    """
    if len(blocks) < 2:
        return
    layout = Layout(layout)
    first = _shape_bytes(blocks[0], layout)
    if first is None:
        return
    for index in range(1, len(blocks)):
        other = _shape_bytes(blocks[index], layout)
        if other is not None and other != first:
            raise ElementCountError(
                f"block {index} has shape {_shape_of(blocks[index])} but block 0 has {_shape_of(blocks[0])}: the "
                "blocks of one namespace have one shape (one model's KV); put another model's blocks under its "
                "own namespace")


def _shape_of(block: bytes | bytearray | memoryview | torch.Tensor) -> list[int]:
    if isinstance(block, (bytes, bytearray, memoryview)):
        return list(decode_header(block).shape)
    return list(block.shape)


_TOKEN_DIM = {1: 3, 2: 2}
"""Layout code -> the dimension that counts tokens (``kv``: 3, ``mla``: 2), which the namespace checks."""


def _shape_bytes(block: bytes | bytearray | memoryview | torch.Tensor, layout: Layout) -> bytes | None:
    """Layout, ndim and the shape but the token dimension of an encoded block's header (or of a tensor of
    ``layout``, as its header would have them); ``None`` without a header."""
    if not isinstance(block, (bytes, bytearray, memoryview)):
        shape = tuple(block.shape)
        token_dim = _TOKEN_DIM[layout.code]
        if len(shape) <= token_dim:
            return None
        return bytes((layout.code, len(shape))) + struct.pack(f"<{len(shape) - 1}Q", *shape[:token_dim],
                                                              *shape[token_dim + 1:])
    view = memoryview(block).cast("B")
    if view.nbytes < _FIXED.size or view[:4] != MAGIC:
        return None
    layout_code, ndim = view[7], view[8]
    header_token_dim = _TOKEN_DIM.get(layout_code)
    if header_token_dim is None or ndim <= header_token_dim or view.nbytes < _FIXED.size + 8 * ndim:
        return None
    dims = bytes(view[_FIXED.size: _FIXED.size + 8 * ndim])
    return bytes(view[7:9]) + dims[: 8 * header_token_dim] + dims[8 * header_token_dim + 8:]
