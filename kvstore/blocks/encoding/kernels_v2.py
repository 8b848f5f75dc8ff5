"""Torch kernels of the second layout (``int8_v2``, ``int4_v2``; ``spec.py``): KIVI's per-channel key and per-token
value groups, each with an 8-bit step below one float32 scale per row, on the tensors' own device.

These run on GPUs (a few whole-block ops) and on CPUs without numba; a CPU
with numba runs ``fast.py``'s one-pass kernels instead, which give the same
bytes and the same decoded values bit for bit: every step below is the same
float32 operation, in the same order.

Encode, per group (``lo``, ``hi``: its least and largest value, float32)::

    need  = max(-lo, hi) / 127                                  int8_v2
            max((hi - lo) / 15, |(lo + hi) / 2| / 119)          int4_v2
    S     = min(max(need over the row), cap)                    (spec: the row scale)
    q     = the largest q in [0, 255] with 2^(-q/16) >= need / S (0 if S is 0)
    s     = S * 2^(-q/16);  inv = 1 / s (0 if s is 0)
    z     = clamp(floor(8 - (lo + hi) / 2 * inv), -128, 127)    int4_v2
    code  = clamp(rint(x * inv), -127, 127)                     int8_v2
            clamp(rint(x * inv + z), 0, 15)                     int4_v2

Decode: ``x = code * s`` (``(code - z) * s``) in float32, rounded once to the dtype.
"""

from __future__ import annotations

import math

import torch

from kvstore.blocks.encoding.kernels import BOOST, TINY_ROW, UNBOOST
from kvstore.blocks.encoding.spec import LOG_STEPS, Encoding, PayloadPlan, key_group, scales_plan, value_group
from kvstore.errors import InvalidArgumentError

_STEPS = torch.tensor([2.0 ** (-q / LOG_STEPS) for q in range(256)], dtype=torch.float64).float()
STEP_TABLE = _STEPS
"""``2^(-q/16)`` for ``q`` in ``[0, 255]``, float32 (each rounded once from float64)."""
ASCENDING_STEPS = _STEPS.flip(0).contiguous()
""":data:`STEP_TABLE` reversed, for ``searchsorted``."""


def _groups(x: torch.Tensor, layout: str, encoding: Encoding) -> tuple[torch.Tensor, ...]:
    """The block's key and value groups as views with the group on its own dimension:
    keys ``[L, H, T/Gk, Gk, D]`` (mla: ``[L, 1, T/Gk, Gk, C]``), reduced over dim 3; values
    ``[L, H, T, D/Gv, Gv]``, reduced over dim 4 (none for mla)."""
    if layout == "kv":
        num_layers, _, num_heads, num_tokens, head_dim = x.shape
        gk, gv = key_group(num_tokens), value_group(head_dim, encoding.max_value_group)
        keys = x[:, 0].reshape(num_layers, num_heads, num_tokens // gk, gk, head_dim)
        values = x[:, 1].reshape(num_layers, num_heads, num_tokens, head_dim // gv, gv)
        return keys, values
    num_layers, _, num_tokens, latent = x.shape
    gk = key_group(num_tokens)
    return (x.reshape(num_layers, 1, num_tokens // gk, gk, latent),)


def _need(low: torch.Tensor, high: torch.Tensor, asymmetric: bool) -> torch.Tensor:
    if asymmetric:
        return torch.maximum((high - low) / 15.0, ((low + high) * 0.5).abs() / 119.0)
    return torch.maximum(-low, high) / 127.0


def _steps(need: torch.Tensor, row_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)`` of groups of ``need`` under row scales ``row_scale`` (broadcast to ``need``)."""
    table = ASCENDING_STEPS.to(need.device)
    ratio = torch.where(row_scale > 0, need / torch.where(row_scale > 0, row_scale, 1.0), 0.0)
    q = 255 - torch.searchsorted(table, ratio.contiguous()).clamp_(max=255)
    return q, row_scale * STEP_TABLE.to(need.device)[q]


def encode_v2(block: torch.Tensor, layout: str, encoding: Encoding, cap: float, plan: PayloadPlan,
              payload: torch.Tensor) -> None:
    """Encode ``block`` (float16, bfloat16 or float32, contiguous) into ``payload`` (``uint8``, its device).

    Raises:
        InvalidArgumentError: if a value is not finite.
    """
    asymmetric = encoding.asymmetric
    x = block.float()
    parts = _groups(x, layout, encoding)
    lows = [p.amin(dim=-2 if i == 0 else -1) for i, p in enumerate(parts)]
    highs = [p.amax(dim=-2 if i == 0 else -1) for i, p in enumerate(parts)]
    # rows below 2^-60 are quantized as 2^64 times themselves, so that no inverse overflows (fast.py the same)
    boosts = [torch.where(torch.maximum(-lo, hi).flatten(2).amax(dim=2) < TINY_ROW, BOOST, 1.0)
              for lo, hi in zip(lows, highs)]  # [L, H] (mla: [L, 1]) per part
    boosted = any(bool((b > 1).any()) for b in boosts)
    if boosted:
        expand = [b.view(b.shape + (1,) * (lo.dim() - 2)) for b, lo in zip(boosts, lows)]
        lows = [lo * e for lo, e in zip(lows, expand)]
        highs = [hi * e for hi, e in zip(highs, expand)]
    needs = [_need(lo, hi, asymmetric) for lo, hi in zip(lows, highs)]
    rows = [n.flatten(2).amax(dim=2) for n in needs]  # [L, H] each (mla: [L, 1])
    row_scale = (torch.stack(rows, dim=1) if layout == "kv" else rows[0]).flatten()
    if not bool(torch.isfinite(row_scale).all()):
        raise InvalidArgumentError(f"a KV value is not finite (NaN or Inf): {encoding.value} cannot encode it")
    row_scale.clamp_(max=cap)
    shaped = row_scale.view(-1, 2, parts[0].shape[1]) if layout == "kv" else row_scale.view(-1, 1)
    sp = scales_plan(encoding, layout, tuple(block.shape))
    stored = row_scale
    if boosted:
        row_boost = (torch.stack(boosts, dim=1) if layout == "kv" else boosts[0]).flatten()
        stored = row_scale * torch.where(row_boost > 1, UNBOOST, 1.0)
    payload[:sp.steps_offset].view(torch.float32).copy_(stored)
    steps = payload[sp.steps_offset:sp.zeros_offset]
    zeros = payload[sp.zeros_offset:sp.nbytes].view(torch.int8) if asymmetric else None
    bits = encoding.bits
    data = payload[plan.data_offset:plan.payload_nbytes]
    codes = torch.empty(block.shape, dtype=torch.uint8 if asymmetric else torch.int8, device=block.device)
    code_parts = _groups(codes, layout, encoding)
    offset = 0
    for i, (part, lo, hi, need) in enumerate(zip(parts, lows, highs, needs)):
        rs = shaped[:, i] if layout == "kv" else shaped
        q, s = _steps(need, rs.view(rs.shape + (1,) * (need.dim() - 2)))
        inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)
        count = q.numel()
        steps[offset:offset + count].copy_(q.flatten())
        axis = -2 if i == 0 else -1
        if boosted:
            b = boosts[i]
            scaled = (part * b.view(b.shape + (1,) * (part.dim() - 2))).mul_(inv.unsqueeze(axis))
        else:
            scaled = part * inv.unsqueeze(axis)
        if zeros is not None:  # asymmetric
            z = torch.floor(8.0 - (lo + hi) * 0.5 * inv).clamp_(-128.0, 127.0)
            zeros[offset:offset + count].copy_(z.flatten())
            scaled.add_(z.unsqueeze(axis)).round_().clamp_(0.0, 15.0)
        else:
            scaled.round_().clamp_(-127.0, 127.0)
        code_parts[i].copy_(scaled)
        offset += count
    if bits == 8:
        data.view(codes.shape).view(torch.int8).copy_(codes)
        return
    flat = codes.view(-1, 2)
    torch.add(flat[:, 0], flat[:, 1], alpha=16, out=data.view(-1))


def decode_v2(payload: torch.Tensor, layout: str, encoding: Encoding, plan: PayloadPlan, out: torch.Tensor) -> None:
    """Decode ``payload`` (``uint8``, on ``out``'s device; its row scales checked) into ``out`` (contiguous)."""
    asymmetric = encoding.asymmetric
    shape = tuple(out.shape)
    sp = scales_plan(encoding, layout, shape)
    row_scale = payload[:sp.steps_offset].view(torch.float32)
    steps = payload[sp.steps_offset:sp.zeros_offset].long()
    zeros = payload[sp.zeros_offset:sp.nbytes].view(torch.int8).float() if asymmetric else None
    data = payload[plan.data_offset:plan.payload_nbytes]
    if asymmetric:
        wide = torch.empty(data.numel(), 2, dtype=torch.float32, device=out.device)
        wide[:, 0].copy_(data & 15)
        wide[:, 1].copy_(data >> 4)
        x = wide.view(shape)
    else:
        x = data.view(torch.int8).float().view(shape)
    parts = _groups(x, layout, encoding)
    table = STEP_TABLE.to(out.device)
    heads = parts[0].shape[1]
    shaped = row_scale.view(-1, 2, heads) if layout == "kv" else row_scale.view(-1, 1)
    offset = 0
    for i, part in enumerate(parts):
        count = math.prod(part.shape) // part.shape[3 if i == 0 else 4]
        group_shape = part.shape[:3] + part.shape[4:] if i == 0 else part.shape[:4]
        rs = shaped[:, i] if layout == "kv" else shaped
        s = rs.view(rs.shape + (1,) * (len(group_shape) - 2)) * table[steps[offset:offset + count]].view(group_shape)
        axis = -2 if i == 0 else -1
        if zeros is not None:  # asymmetric
            part.sub_(zeros[offset:offset + count].view(group_shape).unsqueeze(axis))
        part.mul_(s.unsqueeze(axis))
        offset += count
    out.copy_(x)
