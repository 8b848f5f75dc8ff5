"""Lossy KV blocks: tensors encoded into the block format (flag 1) on their device, and decoded back.

What the clients call: a put in a namespace with a ``kv_encoding`` encodes its
tensors here (:func:`encode_for_put`), and every Get path that hands back
tensors (``get_tensors``, ``get_into``, the connectors) decodes here
(:func:`decode_payload`, :func:`decode_block_into`), so the wire and every tier
carry the smaller payload and the caller gets its dtype and shape back.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Sequence

from kvstore.blocks.format import (
    BlockHeader,
    Layout,
    check_shape,
    decode_header,
    dtype_name,
    encode_header,
    header_nbytes,
    torch_dtype,
)
from kvstore.blocks.encoding.spec import (
    Encoding,
    PayloadPlan,
    ScalesPlan,
    check_encodable,
    encoding_of,
    payload_plan,
    scales_plan,
)
from kvstore.errors import InvalidArgumentError, UnknownDtypeError

if TYPE_CHECKING:
    import torch

    from kvstore.keys import Namespace

ENCODABLE_DTYPES = ("float16", "bfloat16", "float32")
"""The dtypes a lossy encoding takes (a block of another dtype, e.g. an fp8 cache, is refused)."""


def plan_of(header: BlockHeader) -> PayloadPlan:
    """The payload sections of a lossy block's header."""
    return payload_plan(Encoding(header.encoding), header.layout.value, header.shape, header.group)


def encode_lossy(block: torch.Tensor, layout: Layout | str, encoding: Encoding | str) -> bytearray:
    """Encode one block tensor under a lossy encoding: header (flag 1) then payload, on the tensor's device.

    The payload is computed where the tensor is (a GPU tensor is quantized on
    the GPU, and only the smaller payload crosses to the host), into the
    returned buffer directly when the tensor is on the CPU.

    Args:
        block: ``[num_layers, 2, num_kv_heads, block_size, head_dim]`` (``kv``) or
            ``[num_layers, 1, block_size, latent_dim]`` (``mla``), float16, bfloat16 or float32, any device.
        layout: the namespace's layout.
        encoding: the encoding (an :class:`Encoding` or its name).

    Returns:
        The encoded block (``bytearray``, as the block API takes it).

    Raises:
        UnknownDtypeError: on a dtype other than float16, bfloat16 or float32.
        UnknownEncodingError: on an unknown encoding name.
        ElementCountError: if the shape does not fit the layout.
        InvalidArgumentError: if the shape does not fit the encoding (e.g. an odd head size under int4), or a
            value is not finite or does not fit its parameters (the first int4/int2 layout: float16's range).
    """
    import torch

    from kvstore.blocks.encoding.dispatch import encode_payload

    layout = Layout(layout)
    lossy = encoding if isinstance(encoding, Encoding) else encoding_of(encoding)
    if lossy is None:
        raise InvalidArgumentError("encode_lossy needs an encoding; exact blocks are kvstore.blocks.tensors.encode_block's")
    name = dtype_name(block.dtype)
    if name not in ENCODABLE_DTYPES:
        raise UnknownDtypeError(f"{lossy.value} encodes {', '.join(ENCODABLE_DTYPES)} blocks, got {name}")
    shape = tuple(int(d) for d in block.shape)
    check_shape(layout, shape)
    group = check_encodable(lossy, layout.value, shape)
    plan = payload_plan(lossy, layout.value, shape, group)
    head = header_nbytes(len(shape), encoded=True)
    out = bytearray(head + plan.payload_nbytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        host = torch.frombuffer(out, dtype=torch.uint8) if out else torch.empty(0, dtype=torch.uint8)
    source = block.detach()
    if not source.is_contiguous():
        source = source.contiguous()
    if source.device.type == "cpu":
        encode_payload(source, layout.value, lossy, group, plan, host[head:], name)
    else:
        payload = torch.empty(plan.payload_nbytes, dtype=torch.uint8, device=source.device)
        encode_payload(source, layout.value, lossy, group, plan, payload, name)
        host[head:].copy_(payload)
    out[:head] = encode_header(name, layout, shape, memoryview(out)[head:], encoding=lossy, group=group)
    return out


def decode_payload(buf: bytes | bytearray | memoryview, header: BlockHeader) -> torch.Tensor:
    """A lossy block (its header parsed, and checked if it should be) decoded into a new CPU tensor.

    Returns:
        A tensor of ``header.dtype`` and ``header.shape``.
    """
    import torch

    out = torch.empty(header.shape, dtype=torch_dtype(header.dtype))
    decode_block_into(buf, header, out)
    return out


def decode_block_into(buf: bytes | bytearray | memoryview, header: BlockHeader, destination: torch.Tensor,
                      source: torch.Tensor | None = None) -> None:
    """Decode a lossy block into ``destination`` (its dtype and shape; any device, any strides).

    The payload crosses to the destination's device once, as it is stored (the
    smaller bytes), and is decoded there; a non-contiguous destination (a
    slice of a cache) gets the decoded block with one more copy.

    Args:
        buf: the encoded block.
        header: its parsed header (``header.encoding`` set).
        destination: ``[num_layers, 2, num_kv_heads, block_size, head_dim]`` (``kv``) or the ``mla`` shape.
        source: a ``uint8`` tensor over exactly ``buf``'s bytes, if the caller has one.

    Raises:
        BadScalesError: if the scales section is out of range (``kvstore.blocks.encoding.scales``): nothing is
            written into ``destination``.
    """
    import torch

    from kvstore.blocks.encoding.dispatch import decode_payload_into
    from kvstore.blocks.encoding.scales import check_scales

    check_scales(header, buf)  # whoever wrote it, and wherever it was: never a non-finite value decoded
    if source is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only buffer is only read
            source = torch.frombuffer(buf, dtype=torch.uint8)
    payload = source[header.header_nbytes:header.nbytes]
    if payload.device != destination.device:
        payload = payload.to(destination.device, non_blocking=False)
    plan = plan_of(header)
    lossy = Encoding(header.encoding)
    if destination.is_contiguous():
        decode_payload_into(payload, header.layout.value, lossy, header.group, plan, destination)
        return
    staged = torch.empty(header.shape, dtype=destination.dtype, device=destination.device)
    decode_payload_into(payload, header.layout.value, lossy, header.group, plan, staged)
    destination.copy_(staged)


def read_scales(buf: bytes | bytearray | memoryview, header: BlockHeader) -> torch.Tensor:
    """A lossy block's scales as a decoder applies them: float32 ``[rows]`` (fp8, int8), float16 (int4, int2, in
    ``spec``'s order), or float32 per group for layout 2 (keys' groups then values', ``S * 2^(-q/16)``). What a
    test or a tool uses to compute the encoding's error bound."""
    import torch

    plan = plan_of(header)
    encoding = Encoding(header.encoding)
    raw = bytearray(memoryview(buf).cast("B")[header.header_nbytes:header.header_nbytes + plan.scales_nbytes])
    if encoding.version == 2:
        from kvstore.blocks.encoding.kernels_v2 import STEP_TABLE

        sp = scales_plan(encoding, header.layout.value, header.shape)
        rows = torch.frombuffer(raw, dtype=torch.float32, count=sp.rows)
        steps = torch.frombuffer(raw, dtype=torch.uint8, count=sp.num_groups, offset=sp.steps_offset).long()
        return _group_scales(rows, steps, sp, header) * STEP_TABLE[steps]
    dtype = torch.float16 if encoding.grouped else torch.float32
    return torch.frombuffer(raw, dtype=dtype)


def _group_scales(rows: torch.Tensor, steps: torch.Tensor, sp: ScalesPlan, header: BlockHeader) -> torch.Tensor:
    """Each layout-2 group's row scale ``S``, in the steps' order (keys' groups, then values')."""
    import torch

    if header.layout is Layout.KV:
        num_layers, _, num_heads = header.shape[:3]
        by_row = rows.view(num_layers, 2, num_heads)
        keys = by_row[:, 0].reshape(-1).repeat_interleave(sp.key_groups // (num_layers * num_heads))
        values = by_row[:, 1].reshape(-1).repeat_interleave(sp.value_groups // (num_layers * num_heads))
        return torch.cat((keys, values))
    return rows.repeat_interleave(sp.key_groups // header.shape[0])


def encode_for_put(blocks: Sequence[object], namespace: Namespace) -> Sequence[object]:
    """The blocks of a put, each tensor encoded under the namespace's ``kv_encoding``; without one, ``blocks``.

    Encoded bytes pass through (the node checks that their encoding is the
    namespace's). The exact path (no encoding) returns ``blocks`` itself.

    Raises:
        As :func:`encode_lossy`.
    """
    encoding = encoding_of(getattr(namespace, "kv_encoding", ""))
    if encoding is None:
        return blocks
    import torch

    return [encode_lossy(b, namespace.layout, encoding) if isinstance(b, torch.Tensor) else b for b in blocks]


def warm_up(encoding: Encoding | str, dtype: torch.dtype | None = None, layout: str = "kv") -> None:
    """Compile (or load from numba's cache) the CPU kernels ``encoding`` runs for blocks of ``dtype`` (``None``:
    bfloat16): an encode and decodes of a tiny block, from writable and read-only memory, as the put and get
    paths hold it.

    numba compiles a kernel on its first call in a process, which takes seconds on a cold cache: a connector
    calls this when it starts, so that the first load does not spend them inside its timeout. A no-op for
    encodings without CPU kernels, or without numba.
    """
    import torch

    from kvstore.blocks.encoding.dispatch import FAST_ENCODINGS, fast_kernels

    lossy = encoding if isinstance(encoding, Encoding) else encoding_of(encoding)
    if lossy not in FAST_ENCODINGS or fast_kernels() is None:
        return
    dtype = torch.bfloat16 if dtype is None else dtype
    shape = (1, 2, 1, 2, 8) if layout == "kv" else (1, 1, 2, 8)
    block = encode_lossy(torch.zeros(shape, dtype=dtype), layout, lossy)
    header = decode_header(block)
    for source in (block, bytes(block)):
        decode_block_into(source, header, torch.empty(shape, dtype=dtype))
