"""The block codec: KV tensors to blocks of the block format (``kvstore.blocks.format``) and back, never pickle.

Tensors (and numpy arrays) become ``header || payload`` bytes, exact
(:func:`encode_block`), and blocks become tensors again, exact or of a lossy
encoding (:func:`decode_block`, which hands a lossy block to
``kvstore.blocks.encoding``). The format itself (dtypes, layouts, the header and its
checksum) is ``kvstore.blocks.format``'s, and its names are this module's too.
"""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING, Sequence, cast

if TYPE_CHECKING:  # torch is imported on first use, so parsing a header (the server, `kvstore health`) never loads it
    import torch

from kvstore.blocks.format import (
    ALIGNMENT,
    CHECKSUM_SPAN,
    DTYPES,
    FLAG_ENCODED,
    MAGIC,
    MAX_NDIM,
    VERSION,
    BlockHeader,
    Layout,
    LikeBlocks,
    blank_header,
    block_checksum,
    check_one_shape,
    check_shape,
    decode_header,
    dtype_name,
    encode_header,
    header_nbytes,
    torch_dtype,
    verify_block,
)
from kvstore.errors import InvalidArgumentError

__all__ = ["ALIGNMENT", "CHECKSUM_SPAN", "DTYPES", "FLAG_ENCODED", "MAGIC", "MAX_NDIM", "VERSION", "BlockHeader",
           "Layout", "LikeBlocks", "as_block", "blank_header", "block_checksum", "check_one_shape", "check_shape",
           "decode_block", "decode_header", "dtype_name", "encode_any", "encode_block", "encode_blocks",
           "encode_header", "header_nbytes", "torch_dtype", "verify_block"]


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
    import torch

    name = dtype_name(tensor.dtype)
    host = tensor.detach().to("cpu").contiguous()
    payload = host.reshape(-1).view(torch.uint8).numpy().data
    return b"".join((encode_header(name, layout, tuple(host.shape), payload), payload))


def encode_blocks(blocks: Sequence[object], layout: Layout | str = Layout.KV) -> list[bytes]:
    """The blocks of one put as the block API takes them, encoded in ``layout`` (:func:`encode_any` each).

    What the clients and the embedded store do with the blocks a put is given:
    tensors and numpy arrays of the namespace's layout are encoded, encoded
    bytes pass through; then the batch must have one shape (:func:`check_one_shape`).

    Raises:
        InvalidArgumentError: on one block instead of a sequence of them, or a block of another type (named,
            with its index).
        ElementCountError: on blocks of different shapes, or a tensor's shape that does not fit the layout.
        UnknownDtypeError: if a tensor's dtype has no codec code.
    """
    if isinstance(blocks, (bytes, bytearray, memoryview, str)):
        raise InvalidArgumentError(f"expected a sequence of blocks, got {type(blocks).__name__} (one block? pass [block])")
    encoded = [b if type(b) is bytes else encode_any(b, layout, index=i) for i, b in enumerate(blocks)]
    check_one_shape(encoded)
    # Bytes-like blocks given pass through as they are (bytearray, memoryview), which every reader of the list
    # takes alike: it is typed as the bytes that the encoded ones are.
    return cast(list[bytes], encoded)


def decode_block(buf: bytes | bytearray | memoryview, *, verify: bool = True, copy: bool | None = None) -> torch.Tensor:
    """Decode an encoded block into a CPU tensor; read-only bytes are copied, so no tensor writes into them.

    torch has no read-only tensors: ``torch.frombuffer`` over ``bytes`` or a
    read-only ``memoryview`` returns a tensor whose writes land in that memory
    (a stored block, a tier's page pool), which its owner never expected to
    change. So by default a read-only ``buf`` is copied into a tensor of its
    own, and only a writable one (``bytearray``, a writable ``memoryview``) is
    viewed without a copy, its writes landing in ``buf``.

    Args:
        buf: ``header || payload`` as produced by :func:`encode_block`.
        verify: check the checksum (skip only for bytes verified already).
        copy: ``None`` (default): copy exactly when ``buf`` is read-only;
            ``True``: always copy; ``False``: always view ``buf``, even
            read-only, for a caller whose bytes no one else holds (a client's
            own received message), so that a write reaches nothing shared.

    Returns:
        A tensor of the header's dtype and shape, e.g. ``[num_layers, 2,
        num_kv_heads, block_size, head_dim]`` for the ``kv`` layout. A lossy
        block (flag 1) is decoded into a new tensor of its dtype and shape
        (``kvstore.blocks.encoding.decode_payload``), whatever ``copy`` says.

    Raises:
        CodecError: a subclass naming the cause (see :func:`verify_block`).
    """
    import torch

    header = verify_block(buf) if verify else decode_header(buf)
    if header.encoding:
        from kvstore.blocks.encoding.blocks import decode_payload

        return decode_payload(buf, header)
    dtype = torch_dtype(header.dtype)
    if header.payload_nbytes == 0:
        return torch.empty(header.shape, dtype=dtype)
    if copy is None:
        copy = memoryview(buf).readonly
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only buffer is only viewed when the caller said so
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=header.payload_nbytes, offset=header.header_nbytes)
    if copy:
        flat = flat.clone()
    return flat.view(dtype).view(header.shape)


_NUMPY_DTYPES = ("float16", "float32", "float64", "int8", "uint8")
"""numpy dtypes that map one to one onto codec dtypes (numpy has no bfloat16 or float8)."""


def encode_any(block: object, layout: Layout | str = Layout.KV, *, index: int = 0) -> bytes | bytearray | memoryview:
    """One block as the block API takes it, encoded: bytes pass through, tensors and numpy arrays are encoded.

    Args:
        block: encoded bytes (``bytes``, ``bytearray`` or ``memoryview``), a ``torch.Tensor``,
            or a ``numpy.ndarray`` of ``float16``, ``float32``, ``float64``, ``int8`` or ``uint8``,
            shaped as ``layout`` needs (see the module docstring).
        layout: layout tag of the namespace.
        index: position of the block in its call, for the error message.

    Raises:
        InvalidArgumentError: naming ``index``, on any other type, or a numpy dtype without a codec code
            (e.g. ``int64``; bfloat16 KV must come as a torch tensor).
        CodecError: if a tensor's dtype or shape does not fit the codec.
    """
    block = as_block(block, index=index)
    if isinstance(block, (bytes, bytearray, memoryview)):
        return block
    return encode_block(block, layout)


def as_block(block: object, *, index: int = 0) -> bytes | bytearray | memoryview | torch.Tensor:
    """One block as the block API takes it, not encoded: bytes and tensors pass through, a numpy array becomes a
    tensor over its memory (copied only when it is not contiguous).

    What the same-host data plane stages straight into shared memory, with the
    one copy encoding would make (:func:`encode_any` is this, then encoding).

    Raises:
        InvalidArgumentError: as :func:`encode_any`.
    """
    if isinstance(block, (bytes, bytearray, memoryview)):
        return block
    loaded_torch = sys.modules.get("torch")  # a tensor was made with torch loaded: never load it to ask
    if loaded_torch is not None and isinstance(block, loaded_torch.Tensor):
        tensor: torch.Tensor = block
        return tensor
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(block, numpy.ndarray):
        if block.dtype.name not in _NUMPY_DTYPES:
            raise InvalidArgumentError(f"block {index}: a numpy array of {block.dtype} has no kvstore dtype; "
                                       f"use one of {', '.join(_NUMPY_DTYPES)}, or a torch.Tensor")
        import torch

        return torch.from_numpy(numpy.ascontiguousarray(block))
    raise InvalidArgumentError(f"block {index}: expected a torch.Tensor, a numpy.ndarray or encoded bytes, "
                               f"got {type(block).__module__}.{type(block).__qualname__}".replace("builtins.", ""))
