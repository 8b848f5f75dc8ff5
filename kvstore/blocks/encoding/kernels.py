"""The lossy KV encodings' torch kernels: quantize a block into a payload and back, on the tensors' own device.

Every function works on whatever device its tensors are on (the GPU in
production) with plain torch ops, vectorised over the whole block, and writes
into the caller's memory where it can (``out=``), so that a decode makes no
temporary the size of the block in the output dtype. Layouts, sections and
granularities are ``kvstore/blocks/encoding/spec.py``'s.

Quantization arithmetic runs in float32 whatever the block's dtype, so a
bfloat16 block's scaled values are not rounded to bfloat16's 8 bits before
they are rounded to the code.
"""

from __future__ import annotations

import math

import torch

from kvstore.blocks.encoding.spec import Encoding, PayloadPlan
from kvstore.errors import InvalidArgumentError

FP8_MAX = 448.0
"""The largest finite float8_e4m3fn value (OCP FP8 spec, as ``torch.finfo(torch.float8_e4m3fn).max``)."""
INT8_MAX = 127.0
"""Symmetric int8 codes lie in ``[-127, 127]`` (-128 unused, so that the code is symmetric)."""
TINY_ROW = 2.0 ** -60
"""Rows below this magnitude are quantized as ``BOOST`` times themselves (``fast.TINY_ROW``, the same rule)."""
BOOST = 2.0 ** 64
UNBOOST = 2.0 ** -64



def rows_of(block: torch.Tensor, layout: str) -> torch.Tensor:
    """The block as ``[rows, elements]``: a row per (layer, K or V, KV head) (``kv``) or per layer (``mla``)."""
    leading = 3 if layout == "kv" else 2
    return block.view(math.prod(block.shape[:leading]), -1)


_MAGNITUDE_BITS = {torch.bfloat16: (torch.int16, 0x7FFF), torch.float16: (torch.int16, 0x7FFF),
                   torch.float32: (torch.int32, 0x7FFFFFFF)}
"""Per float dtype: the int of its width and the mask that clears its sign bit."""


def abs_max_rows(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` of each row of ``x`` ``[rows, n]`` (float16, bfloat16 or float32, contiguous), as float32 ``[rows]``.

    Computed on the bits: with the sign bit cleared, an IEEE float's magnitude orders as its bits do as an
    integer, so one integer mask and an integer max replace ``abs()`` and a float reduction (on CPU about 10x
    faster for bfloat16). A NaN has larger bits than any number, so a row with one gets a NaN, as ``abs().amax``.
    """
    wide, mask = _MAGNITUDE_BITS[x.dtype]
    return torch.bitwise_and(x.view(wide), mask).amax(dim=1).view(x.dtype).float()


def quantize_rows(x: torch.Tensor, encoding: Encoding, scales: torch.Tensor, data: torch.Tensor,
                  cap: float = math.inf) -> None:
    """fp8_e4m3 or int8, one scale per row: ``code = x / scale`` with ``scale = min(max|row| / code_max, cap)``.

    Args:
        x: ``[rows, n]``, float16, bfloat16 or float32, contiguous.
        encoding: :attr:`Encoding.FP8_E4M3` or :attr:`Encoding.INT8`.
        scales: ``[rows]`` float32, written.
        data: ``[rows, n]`` ``uint8`` on ``x``'s device, written (the codes' bytes).
        cap: the largest scale (``scales.max_row_scale``); values beyond ``cap * code_max`` saturate.

    Raises:
        InvalidArgumentError: if a value is not finite.
    """
    code_max = FP8_MAX if encoding is Encoding.FP8_E4M3 else INT8_MAX
    amax = abs_max_rows(x)
    if not bool(torch.isfinite(amax).all()):
        raise InvalidArgumentError(f"a KV value is not finite (NaN or Inf): {encoding.value} cannot encode it")
    tiny = amax < TINY_ROW
    boosted = bool(tiny.any())
    if boosted:  # rows below 2^-60: quantized as 2^64 times themselves, so that no inverse overflows (fast.py too)
        boost = torch.where(tiny, BOOST, 1.0)
        amax = amax * boost
    torch.div(amax, code_max, out=scales)
    # torch.div, not ``code_max / amax`` (which torch computes as ``reciprocal(amax) * code_max``): the one IEEE
    # division fast.py makes, so that both give the same codes
    inverse = torch.where(amax > 0, torch.div(torch.full_like(amax, code_max), amax), torch.zeros_like(amax))
    if cap < math.inf and bool((scales > cap).any()):
        capped = scales > cap
        scales.clamp_(max=cap)
        inverse = torch.where(capped, 1.0 / scales, inverse)
    inverse = inverse.unsqueeze(1)
    # float32 [rows, n]: the one temporary. Converted first, then scaled in place: a float32 multiply of a
    # 16-bit tensor by a float32 one is a mixed-dtype kernel, about 8x slower on CPU than the two passes.
    if boosted:
        scales.mul_(torch.where(tiny, UNBOOST, 1.0))
        scaled = (x.float() * boost.unsqueeze(1)).mul_(inverse)
    else:
        scaled = x.float().mul_(inverse) if x.dtype != torch.float32 else torch.mul(x, inverse)
    if encoding is Encoding.FP8_E4M3:
        scaled.clamp_(-FP8_MAX, FP8_MAX)
        data.view(torch.float8_e4m3fn).copy_(scaled)
    else:
        scaled.round_().clamp_(-INT8_MAX, INT8_MAX)  # |x| * 127 / max|row| <= 127 but where the cap saturates
        data.view(torch.int8).copy_(scaled)


def dequantize_rows(encoding: Encoding, scales: torch.Tensor, data: torch.Tensor, out: torch.Tensor) -> None:
    """The inverse of :func:`quantize_rows`, written into ``out``: each code times its row's scale in float32,
    rounded once to ``out``'s dtype (the scale is never rounded to bfloat16 first, so a tiny row does not
    decode to zeros). e4m3's NaN bytes, which no writer emits, decode as +-480 times the scale (``fast.py``
    does the same).

    Args:
        scales: ``[rows]`` float32 on ``out``'s device (checked: ``scales.check_scales``).
        data: ``[rows, n]`` ``uint8`` on ``out``'s device.
        out: ``[rows, n]`` float16, bfloat16 or float32 (may be a view).
    """
    scale = scales.unsqueeze(1)
    if encoding is Encoding.INT8:
        wide = data.view(torch.int8).float()
    else:  # e4m3's bits moved into float32's (sign; exponent and mantissa), its bias folded in as 2^120
        bits = data.view(torch.int8).to(torch.int32)  # sign-extended: bit 7 of the byte is every high bit
        sign = bits & torch.iinfo(torch.int32).min
        bits.bitwise_and_(0x7F).bitwise_left_shift_(20).bitwise_or_(sign)
        wide = bits.view(torch.float32).mul_(2.0 ** 120)
    if out.dtype == torch.float32:
        torch.mul(wide, scale, out=out)
    else:
        out.copy_(wide.mul_(scale))


def _min_and_scale(low: torch.Tensor, high: torch.Tensor, code_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 minimum and scale of ranges ``[low, high]`` (float32), such that ``min + code_max * scale`` covers
    ``high``; both as stored (float16), so that the codes are computed against what a decoder will read.

    Raises:
        InvalidArgumentError: if a minimum or scale does not fit float16 (values beyond +-65,504).
    """
    minimum = low.to(torch.float16)
    scale = ((high - minimum.float()) / code_max * (1 + 2.0 ** -10)).to(torch.float16)
    if not (torch.isfinite(minimum).all() and torch.isfinite(scale).all()):
        raise InvalidArgumentError("a KV value is beyond float16's range (+-65,504): int4/int2 keep their minima "
                                   "and scales in float16; use int8 or fp8_e4m3 for such a model")
    return minimum, scale


def _codes(x: torch.Tensor, minimum: torch.Tensor, scale: torch.Tensor, code_max: int) -> torch.Tensor:
    """``round((x - min) / scale)`` clamped to ``[0, code_max]``, as ``uint8`` (broadcast shapes)."""
    scale32 = scale.float()
    inverse = torch.where(scale32 > 0, 1.0 / scale32, torch.zeros_like(scale32))
    codes = torch.sub(x, minimum.float()).mul_(inverse).round_().clamp_(0, code_max)
    return codes.to(torch.uint8)


def _pack(codes: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Pack ``uint8`` codes ``[..., n]`` into ``out`` ``[..., n * bits / 8]``, element ``i`` of each byte in bits
    ``[i * bits, (i + 1) * bits)``: ``out = c_0 + 2^bits c_1 + ...`` (the codes are below ``2^bits``, so no carry)."""
    per_byte = 8 // bits
    grouped = codes.view(*codes.shape[:-1], -1, per_byte)
    torch.add(grouped[..., 0], grouped[..., 1], alpha=1 << bits, out=out)
    for i in range(2, per_byte):
        out.add_(grouped[..., i], alpha=1 << (bits * i))


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The ``uint8`` codes of ``packed`` ``[..., m]``, as ``[..., m, 8 / bits]`` (the inverse of :func:`_pack`)."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    codes = torch.empty(*packed.shape, per_byte, dtype=torch.uint8, device=packed.device)
    torch.bitwise_and(packed, mask, out=codes[..., 0])
    for j in range(1, per_byte - 1):
        torch.bitwise_right_shift(packed, bits * j, out=codes[..., j]).bitwise_and_(mask)
    torch.bitwise_right_shift(packed, bits * (per_byte - 1), out=codes[..., per_byte - 1])
    return codes


def _affine_into(codes: torch.Tensor, minimum: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """``out = codes * scale + min`` (broadcast), in ``out``'s dtype: the codes convert exactly (below 256), and
    the scale and minimum are the stored float16 values in ``out``'s dtype."""
    out.copy_(codes)
    out.mul_(scale.to(out.dtype)).add_(minimum.to(out.dtype))


def quantize_grouped(block: torch.Tensor, layout: str, encoding: Encoding, group: int, scales: torch.Tensor,
                     data: torch.Tensor) -> None:
    """int4 or int2, KIVI-style: keys (and an MLA latent) per channel over the block's tokens, values per token
    in groups of ``group`` channels; asymmetric (a minimum and a scale each, float16).

    Args:
        block: ``[L, 2, H, T, D]`` (``kv``) or ``[L, 1, T, C]`` (``mla``), float16, bfloat16 or float32.
        scales: float16, as many as ``spec.payload_plan`` counts, written in its order.
        data: ``uint8`` of the data section, written.

    Raises:
        InvalidArgumentError: if a value is beyond float16's range.
    """
    bits, code_max = encoding.bits, (1 << encoding.bits) - 1
    x = block.float() if block.dtype != torch.float32 else block
    if layout == "kv":
        num_layers, _, num_heads, num_tokens, head_dim = x.shape
        keys, values = x[:, 0], x[:, 1]
        k_min, k_scale = _min_and_scale(keys.amin(dim=2), keys.amax(dim=2), code_max)  # [L, H, D]
        grouped = values.reshape(num_layers, num_heads, num_tokens, head_dim // group, group)
        v_min, v_scale = _min_and_scale(grouped.amin(dim=4), grouped.amax(dim=4), code_max)  # [L, H, T, D/g]
        per = num_layers * num_heads * head_dim
        scales[:per].copy_(k_scale.reshape(-1))
        scales[per:2 * per].copy_(k_min.reshape(-1))
        rest = v_scale.numel()
        scales[2 * per:2 * per + rest].copy_(v_scale.reshape(-1))
        scales[2 * per + rest:2 * per + 2 * rest].copy_(v_min.reshape(-1))
        packed = data.view(num_layers, 2, num_heads, num_tokens, head_dim * bits // 8)
        _pack(_codes(keys, k_min.unsqueeze(2), k_scale.unsqueeze(2), code_max), bits, packed[:, 0])
        codes = _codes(grouped, v_min.unsqueeze(4), v_scale.unsqueeze(4), code_max)
        _pack(codes.view(num_layers, num_heads, num_tokens, head_dim), bits, packed[:, 1])
        return
    num_layers, _, num_tokens, latent = x.shape
    latents = x[:, 0]
    minimum, scale = _min_and_scale(latents.amin(dim=1), latents.amax(dim=1), code_max)  # [L, C]
    scales[:minimum.numel()].copy_(scale.reshape(-1))
    scales[minimum.numel():].copy_(minimum.reshape(-1))
    _pack(_codes(latents, minimum.unsqueeze(1), scale.unsqueeze(1), code_max), bits,
          data.view(num_layers, num_tokens, latent * bits // 8))


def dequantize_grouped(layout: str, encoding: Encoding, group: int, scales: torch.Tensor, data: torch.Tensor,
                       out: torch.Tensor) -> None:
    """The inverse of :func:`quantize_grouped`, written into ``out`` (the block's logical shape, contiguous).

    Args:
        scales: float16 of the scales section, on ``out``'s device.
        data: ``uint8`` of the data section, on ``out``'s device.
        out: ``[L, 2, H, T, D]`` or ``[L, 1, T, C]``, float16, bfloat16 or float32, contiguous.
    """
    bits = encoding.bits
    per_byte = 8 // bits
    if layout == "kv":
        num_layers, _, num_heads, num_tokens, head_dim = out.shape
        per = num_layers * num_heads * head_dim
        rest = num_layers * num_heads * num_tokens * (head_dim // group)
        k_scale = scales[:per].view(num_layers, num_heads, 1, head_dim)
        k_min = scales[per:2 * per].view(num_layers, num_heads, 1, head_dim)
        v_scale = scales[2 * per:2 * per + rest].view(num_layers, num_heads, num_tokens, head_dim // group, 1)
        v_min = scales[2 * per + rest:2 * per + 2 * rest].view(num_layers, num_heads, num_tokens,
                                                              head_dim // group, 1)
        codes = _unpack(data.view(num_layers, 2, num_heads, num_tokens, head_dim // per_byte), bits)
        codes = codes.view(num_layers, 2, num_heads, num_tokens, head_dim)
        _affine_into(codes[:, 0], k_min, k_scale, out[:, 0])
        v_out = out[:, 1].view(num_layers, num_heads, num_tokens, head_dim // group, group)
        _affine_into(codes[:, 1].view(v_out.shape), v_min, v_scale, v_out)
        return
    num_layers, _, num_tokens, latent = out.shape
    count = num_layers * latent
    codes = _unpack(data.view(num_layers, num_tokens, latent // per_byte), bits).view(num_layers, num_tokens, latent)
    _affine_into(codes, scales[count:2 * count].view(num_layers, 1, latent),
                 scales[:count].view(num_layers, 1, latent), out[:, 0])


def encode_payload(block: torch.Tensor, layout: str, encoding: Encoding, group: int, plan: PayloadPlan,
                   payload: torch.Tensor, cap: float = math.inf) -> None:
    """Write ``block`` encoded into ``payload`` (``uint8`` ``[plan.payload_nbytes]``, on ``block``'s device), in
    the first layouts (fp8_e4m3, int8, int4, int2); ``cap``: fp8 and int8's largest row scale.

    Raises:
        InvalidArgumentError: if a value does not fit the encoding's parameters (int4/int2: float16 range).
    """
    data = payload[plan.data_offset:plan.payload_nbytes]
    if plan.data_offset > plan.scales_nbytes:
        payload[plan.scales_nbytes:plan.data_offset].zero_()
    if encoding.grouped:
        quantize_grouped(block, layout, encoding, group, payload[:plan.scales_nbytes].view(torch.float16), data)
        return
    rows = rows_of(block, layout)
    quantize_rows(rows, encoding, payload[:plan.scales_nbytes].view(torch.float32), data.view(rows.shape), cap)


def decode_payload_into(payload: torch.Tensor, layout: str, encoding: Encoding, group: int, plan: PayloadPlan,
                        out: torch.Tensor) -> None:
    """Decode ``payload`` (``uint8``, on ``out``'s device) into ``out`` (the block's dtype and shape, contiguous)."""
    data = payload[plan.data_offset:plan.payload_nbytes]
    if encoding.grouped:
        dequantize_grouped(layout, encoding, group, payload[:plan.scales_nbytes].view(torch.float16), data, out)
        return
    rows = rows_of(out, layout)
    dequantize_rows(encoding, payload[:plan.scales_nbytes].view(torch.float32), data.view(rows.shape), rows)
