"""Lossless compression of stored blocks for the LMDB and Redis tiers: a byte-plane shuffle and a fast codec.

A tier with compression on stores each block as a *frame* when that is
smaller, and as the block itself otherwise; a read returns the block's exact
bytes either way, whatever the setting was when it was written (so turning
compression on or off never loses what is stored). Frame (little-endian)::

    offset  size  field
    0       4     magic b"KVZ\\x01" (never a block's, which is b"KVB\\x01")
    4       1     codec: 1 zstd, 2 lz4, 3 blosc2
    5       1     shuffle width, bytes (1: none)
    6       2     0
    8       8     the block's length, bytes
    16      8     xxh3-64 of the compressed bytes
    24      ...   the compressed bytes

The shuffle groups the i-th byte of every ``width``-byte element together (for
bfloat16 KV, the sign-and-exponent bytes apart from the mantissa bytes), which
is what makes floating-point data compress; ``width`` is the block's dtype size
(1 for a lossy encoding's codes). ``blosc2`` (its Zstd codec, level 1 by default) shuffles inside its own frame.
The compressed bytes' own checksum is checked before they reach a decompressor,
so damaged bytes on disk or in Redis never feed one; the tier then verifies
the block's checksum too (``kvstore.blocks.tensors.verify_block``, which covers every
byte). A frame that fails either is a :class:`CodecError`: a corrupt record.
"""

from __future__ import annotations

import asyncio
import enum
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Any, Sequence, overload

import numpy as np
import xxhash

from kvstore.blocks.format import DTYPES, MAGIC
from kvstore.errors import CodecError, InvalidArgumentError

FRAME_MAGIC = b"KVZ\x01"
_FRAME = struct.Struct("<4sBBHQQ")  # 24 bytes
_DTYPE_CODE_AT = 6
_ITEMSIZE_OF_CODE = {code: size for code, size in DTYPES.values()}
MIN_SAVING = 0.97
"""A frame is stored only when it is at most this fraction of the block (else the block itself)."""


class Codec(str, enum.Enum):
    """A tier's compression codec; ``none`` stores blocks as they are."""

    NONE = "none"
    ZSTD = "zstd"
    LZ4 = "lz4"
    BLOSC2 = "blosc2"


_CODES = {Codec.ZSTD: 1, Codec.LZ4: 2, Codec.BLOSC2: 3}
_BY_CODE = {code: codec for codec, code in _CODES.items()}


def shuffle_width(block: bytes | memoryview) -> int:
    """The shuffle width of a block: its dtype's size from the header (1 for a lossy block or anything else)."""
    view = memoryview(block)
    if view.nbytes < 10 or view[:4] != MAGIC or view[9] & 1:  # flag 1: a lossy encoding's one-byte codes
        return 1
    return _ITEMSIZE_OF_CODE.get(view[_DTYPE_CODE_AT], 1)


def _shuffle(data: memoryview, width: int) -> bytes:
    whole = data.nbytes - data.nbytes % width
    planes = np.frombuffer(data, dtype=np.uint8, count=whole).reshape(-1, width).T.tobytes()
    return planes + bytes(data[whole:])


_WIDE = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _unshuffle(data: bytes, width: int, nbytes: int) -> bytes:
    """The inverse of :func:`_shuffle`: the planes OR-ed into ``width``-byte integers (little-endian), which numpy
    does about 25x faster than the transposed copy."""
    whole = nbytes - nbytes % width
    planes = np.frombuffer(data, dtype=np.uint8, count=whole).reshape(width, -1)
    wide = _WIDE.get(width)
    if wide is None or sys.byteorder != "little":
        return planes.T.tobytes() + data[whole:nbytes]
    out = planes[0].astype(wide)
    for i in range(1, width):
        out |= planes[i].astype(wide) << (8 * i)
    unshuffled: bytes = out.tobytes()
    return unshuffled + data[whole:nbytes]


_LOCAL = threading.local()


def _zstd_decompressor() -> Any:
    """This thread's ``ZstdDecompressor`` (its objects are not shared between threads; making one costs ~15 us)."""
    decompressor = getattr(_LOCAL, "zstd", None)
    if decompressor is None:
        import zstandard

        decompressor = _LOCAL.zstd = zstandard.ZstdDecompressor()
    return decompressor


@dataclass(frozen=True, slots=True)
class Compressor:
    """What a tier does to each block it stores and reads back.

    Attributes:
        codec: the codec, ``none`` to store blocks as they are (frames already stored are still read).
        level: the codec's level (zstd: 1..22; lz4: 0..16; blosc2: 0..9).

    Raises:
        InvalidArgumentError: on an unknown codec or a level out of its range.
    """

    codec: Codec = Codec.NONE
    level: int = 1

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "codec", Codec(self.codec))
        except ValueError:
            raise InvalidArgumentError(f"compression codec must be one of {[c.value for c in Codec]}, "
                                       f"got {self.codec!r}") from None
        top = {Codec.NONE: 22, Codec.ZSTD: 22, Codec.LZ4: 16, Codec.BLOSC2: 9}[self.codec]
        if not 0 <= self.level <= top:
            raise InvalidArgumentError(f"compression level of {self.codec.value} must be in [0, {top}], got {self.level}")

    @property
    def enabled(self) -> bool:
        """Whether blocks are compressed on the way in."""
        return self.codec is not Codec.NONE

    @overload
    def pack(self, block: bytes) -> bytes: ...

    @overload
    def pack(self, block: bytes | memoryview) -> bytes | memoryview: ...

    def pack(self, block: bytes | memoryview) -> bytes | memoryview:
        """The value to store for ``block``: a frame when compression is on and saves enough, else ``block``.

        A frame (a value this method returned already, e.g. packed ahead by :func:`pack_all` so that the
        store's accounting counts its length) is returned as it is.
        """
        if not self.enabled:
            return block
        view = memoryview(block).cast("B")
        if view[:4] == FRAME_MAGIC:
            return block
        width = shuffle_width(view)
        if self.codec is Codec.BLOSC2:
            import blosc2

            body = blosc2.compress(view, typesize=width, clevel=self.level, filter=blosc2.Filter.SHUFFLE,
                                   codec=blosc2.Codec.ZSTD)
        else:
            data = _shuffle(view, width) if width > 1 else view
            if self.codec is Codec.ZSTD:
                import zstandard

                body = zstandard.ZstdCompressor(level=self.level).compress(data)
            else:
                import lz4.block

                body = lz4.block.compress(data, mode="fast", acceleration=max(1, self.level), store_size=False)
        if _FRAME.size + len(body) > MIN_SAVING * view.nbytes:
            return block
        header = _FRAME.pack(FRAME_MAGIC, _CODES[self.codec], width, 0, view.nbytes, xxhash.xxh3_64_intdigest(body))
        return b"".join((header, body))


def is_frame(value: bytes | memoryview) -> bool:
    """Whether a stored value is a compressed frame (not a block)."""
    return memoryview(value)[:4] == FRAME_MAGIC


def block_nbytes(value: bytes | memoryview) -> int:
    """The length of the block a stored value holds: a frame's header's (read only, not checked), else the
    value's own length. Reads the first 16 bytes of a frame."""
    view = memoryview(value)
    if view.nbytes >= _FRAME.size and view[:4] == FRAME_MAGIC:
        return int.from_bytes(view[8:16], "little")
    return view.nbytes


@overload
def unpack(value: bytes) -> bytes: ...


@overload
def unpack(value: bytes | memoryview) -> bytes | memoryview: ...


def unpack(value: bytes | memoryview) -> bytes | memoryview:
    """The block a stored value holds: a frame decompressed, anything else as it is.

    Raises:
        CodecError: on a frame of an unknown codec, or one that does not decompress to the length it names.
    """
    view = memoryview(value)
    if view[:4] != FRAME_MAGIC:
        return value
    if view.nbytes < _FRAME.size:
        raise CodecError(f"a compressed frame of {view.nbytes} bytes is shorter than its header")
    _, code, width, reserved, nbytes, checksum = _FRAME.unpack_from(view, 0)
    codec = _BY_CODE.get(code)
    if codec is None or reserved or not 1 <= width <= 8:
        raise CodecError(f"bad compressed frame: codec {code}, shuffle width {width}")
    body = view[_FRAME.size:]
    if xxhash.xxh3_64_intdigest(body) != checksum:
        raise CodecError("checksum mismatch: the compressed frame is corrupt")
    try:
        if codec is Codec.BLOSC2:
            import blosc2

            block = blosc2.decompress(bytes(body))
        elif codec is Codec.ZSTD:
            block = _zstd_decompressor().decompress(body, max_output_size=nbytes)
        else:
            import lz4.block

            block = lz4.block.decompress(body, uncompressed_size=nbytes)
    except Exception as exc:  # noqa: BLE001 - each codec raises its own type on damaged input
        raise CodecError(f"a compressed frame does not decompress ({type(exc).__name__}: {exc})") from None
    if len(block) != nbytes:
        raise CodecError(f"a compressed frame decompressed to {len(block)} bytes, its header says {nbytes}")
    if codec is not Codec.BLOSC2 and width > 1:
        block = _unshuffle(block, width, nbytes)
    return bytes(block) if not isinstance(block, bytes) else block


def stored_nbytes(value: bytes | memoryview) -> int:
    """The bytes a stored value takes (frame or block)."""
    return memoryview(value).nbytes


def logical_nbytes(value: bytes | memoryview) -> int:
    """The length of the block a stored value holds, read from a frame's header without decompressing.

    Raises:
        CodecError: on a frame shorter than its header.
    """
    view = memoryview(value)
    if view[:4] != FRAME_MAGIC:
        return view.nbytes
    if view.nbytes < _FRAME.size:
        raise CodecError(f"a compressed frame of {view.nbytes} bytes is shorter than its header")
    return int(_FRAME.unpack_from(view, 0)[4])


def unpack_or_keep(value: bytes) -> bytes:
    """:func:`unpack`, or the value as it is when it is a frame that does not decompress: its verification then
    fails (a frame is not a block), so a tier counts and drops it as any corrupt value."""
    try:
        return unpack(value)
    except CodecError:
        return value


OFFLOAD_BYTES = 1 << 20
"""A put batch of at least this many bytes is compressed in a worker thread, off the event loop."""


async def pack_all(compressor: Compressor, values: Sequence[bytes]) -> Sequence[bytes]:
    """Each value as :meth:`Compressor.pack` stores it; ``values`` itself when compression is off."""
    if not compressor.enabled:
        return values
    if sum(len(v) for v in values) < OFFLOAD_BYTES:
        return [compressor.pack(v) for v in values]
    return await asyncio.to_thread(lambda: [compressor.pack(v) for v in values])
