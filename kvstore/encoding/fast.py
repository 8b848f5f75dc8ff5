"""CPU kernels of the encodings that run at memory speed: each block is encoded or decoded in one pass, a row at a time.

A row (one layer, K or V, KV head of a ``kv`` block; one layer of an ``mla``
block: ``T * D`` elements, a few KiB) is read once from memory into a float32
scratch that stays in the L1 cache, reduced there to its scales, and quantized
from there; a decode reads the codes once and writes the output once. The loops
are numba-compiled (``numba.njit``: LLVM vectorizes them), so a CPU encode is not
the five whole-block passes of the torch ops in ``kernels.py`` / ``kernels_v2.py``.

What runs here must give, bit for bit, what those torch kernels give (they run
on GPUs, and where numba is missing): the same float32 operations in the same
order, the same round-half-to-even, and conversions between float32 and the
16-bit dtypes done on the bits with one round-half-to-even each, as torch does
(``tests/encoding/test_fast.py`` compares them). Covered: ``fp8_e4m3`` (the
first layout), ``int8_v2`` and ``int4_v2`` (``spec.py``), in and out of float16,
bfloat16 and float32.

numba compiles each kernel on its first call in a process (seconds), or loads it
from its cache (``cache=True``: beside this module, or numba's user-wide cache
where that is read-only).
"""

from __future__ import annotations

import numpy as np
from numba import njit

KIND_BFLOAT16 = 0
KIND_FLOAT16 = 1
KIND_FLOAT32 = 2
"""The ``kind`` argument of the kernels: how the 16- or 32-bit words of a block are numbers."""

_F16_UP = np.float32(2.0 ** 112)
_F16_DOWN = np.float32(2.0 ** -112)
_F16_MAX = np.float32(65504.0)


@njit(cache=True, nogil=True, boundscheck=False)
def _load_row(words16, words32, kind, start, count, out):  # type: ignore[no-untyped-def]
    """``count`` elements from ``start`` into ``out`` (float32); returns the largest magnitude (inf if any is
    not finite: a float16 Inf/NaN loads as a finite 65536.. 131008, caught by the range)."""
    bits = out.view(np.uint32)
    if kind == KIND_FLOAT32:
        for i in range(count):
            out[i] = words32[start + i]
    elif kind == KIND_BFLOAT16:
        for i in range(count):
            bits[i] = np.uint32(words16[start + i]) << np.uint32(16)
    else:
        for i in range(count):
            h = np.uint32(words16[start + i])
            bits[i] = ((h & np.uint32(0x8000)) << np.uint32(16)) | ((h & np.uint32(0x7FFF)) << np.uint32(13))
        for i in range(count):
            out[i] *= _F16_UP
    peak = np.float32(0.0)
    for i in range(count):
        peak = max(peak, abs(out[i]))
    if kind == KIND_FLOAT16 and peak > _F16_MAX:
        return np.float32(np.inf)
    for i in range(count):
        if out[i] != out[i]:
            return np.float32(np.inf)
    return peak


@njit(cache=True, nogil=True, boundscheck=False)
def _store_row(values, kind, words16, words32, start, count):  # type: ignore[no-untyped-def]
    """``values`` (float32, finite, within the dtype's range) into the block's words, rounded half to even."""
    if kind == KIND_FLOAT32:
        for i in range(count):
            words32[start + i] = values[i]
        return
    bits = values.view(np.uint32)
    if kind == KIND_BFLOAT16:
        for i in range(count):
            b = bits[i]
            words16[start + i] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
                                           >> np.uint32(16))
        return
    for i in range(count):
        b = bits[i]
        sign = np.uint16((b >> np.uint32(16)) & np.uint32(0x8000))
        magnitude = b & np.uint32(0x7FFFFFFF)
        if magnitude >= np.uint32(0x38800000):  # >= 2^-14: a float16 normal; rebias the exponent, round the bits
            m = magnitude - np.uint32(112 << 23)
            h = np.uint16((m + np.uint32(0xFFF) + ((m >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13))
        else:  # a float16 subnormal: 2^-24 steps, exact to scale
            h = np.uint16(np.rint(abs(values[i]) * np.float32(2.0 ** 24)))
        words16[start + i] = sign | h


@njit(cache=True, nogil=True, boundscheck=False)
def _step_index(ratio, ascending):  # type: ignore[no-untyped-def]
    """The largest ``q`` with ``2^(-q/16) >= ratio`` (``ascending`` is the table reversed): searchsorted, left."""
    lo, hi = 0, 256
    while lo < hi:
        mid = (lo + hi) >> 1
        if ascending[mid] < ratio:
            lo = mid + 1
        else:
            hi = mid
    return 255 - min(lo, 255)


@njit(cache=True, nogil=True, boundscheck=False)
def encode_v2(words16, words32, kind, num_layers, num_heads, kv, num_tokens, width, key_group, value_group,
              asymmetric, cap, table, ascending, row_scales, steps, zeros, data):  # type: ignore[no-untyped-def]
    """``int8_v2`` / ``int4_v2`` encode of a block (``spec.py``'s layout 2); returns False on a non-finite value.

    Args:
        words16, words32: the block's words (one of them is used, by ``kind``), C order.
        kv: ``kv`` layout (rows alternate K and V per layer) or ``mla`` (every row is keys).
        width: channels per token (head size, or latent size).
        cap: the largest row scale ``S`` (``scales.max_row_scale``): a larger one saturates.
        row_scales, steps, zeros, data: the payload's parts (float32, uint8, int8, uint8), written.
    """
    per_row = num_tokens * width
    rows = num_layers * (2 * num_heads if kv else 1)
    key_groups_per_row = (num_tokens // key_group) * width
    value_groups_per_row = num_tokens * (width // value_group)
    values_start = num_layers * num_heads * key_groups_per_row
    buf = np.empty(per_row, np.float32)
    low = np.empty(max(key_groups_per_row, value_groups_per_row), np.float32)
    high = np.empty_like(low)
    need = np.empty_like(low)
    scale = np.empty_like(low)
    inverse = np.empty_like(low)
    zero = np.zeros_like(low)
    codes = data.view(np.int8)
    for r in range(rows):
        is_value = kv and (r // num_heads) % 2 == 1
        if kv:
            layer, head = r // (2 * num_heads), r % num_heads
            group_base = (layer * num_heads + head) * (value_groups_per_row if is_value else key_groups_per_row)
            if is_value:
                group_base += values_start
        else:
            group_base = r * key_groups_per_row
        if _load_row(words16, words32, kind, r * per_row, per_row, buf) == np.inf:
            return False
        groups = value_groups_per_row if is_value else key_groups_per_row
        for g in range(groups):
            low[g] = np.inf
            high[g] = -np.inf
        if is_value:
            per_token = width // value_group
            for t in range(num_tokens):
                for c in range(per_token):
                    lo_, hi_ = np.float32(np.inf), np.float32(-np.inf)
                    base = t * width + c * value_group
                    for i in range(value_group):
                        lo_ = min(lo_, buf[base + i])
                        hi_ = max(hi_, buf[base + i])
                    low[t * per_token + c] = lo_
                    high[t * per_token + c] = hi_
        else:
            for t in range(num_tokens):
                g0 = (t // key_group) * width
                for d in range(width):
                    v = buf[t * width + d]
                    low[g0 + d] = min(low[g0 + d], v)
                    high[g0 + d] = max(high[g0 + d], v)
        row_scale = np.float32(0.0)
        for g in range(groups):
            if asymmetric:
                n = max((high[g] - low[g]) / np.float32(15.0),
                        abs((low[g] + high[g]) * np.float32(0.5)) / np.float32(119.0))
            else:
                n = max(-low[g], high[g]) / np.float32(127.0)
            need[g] = n
            row_scale = max(row_scale, n)
        row_scale = min(row_scale, cap)
        row_scales[r] = row_scale
        for g in range(groups):
            ratio = need[g] / row_scale if row_scale > 0 else np.float32(0.0)
            q = _step_index(ratio, ascending)
            steps[group_base + g] = q
            s = row_scale * table[q]
            scale[g] = s
            inverse[g] = np.float32(1.0) / s if s > 0 else np.float32(0.0)
            if asymmetric:
                mid = (low[g] + high[g]) * np.float32(0.5)
                z = np.floor(np.float32(8.0) - mid * inverse[g])
                z = min(max(z, np.float32(-128.0)), np.float32(127.0))
                zero[g] = z
                zeros[group_base + g] = np.int8(z)
        base = r * per_row
        if is_value:
            per_token = width // value_group
            for t in range(num_tokens):
                for c in range(per_token):
                    g = t * per_token + c
                    start = t * width + c * value_group
                    for i in range(value_group):
                        buf[start + i] = buf[start + i] * inverse[g] + zero[g]
        else:
            for t in range(num_tokens):
                g0 = (t // key_group) * width
                for d in range(width):
                    buf[t * width + d] = buf[t * width + d] * inverse[g0 + d] + zero[g0 + d]
        if asymmetric:
            for i in range(0, per_row, 2):
                a = min(max(np.rint(buf[i]), np.float32(0.0)), np.float32(15.0))
                b = min(max(np.rint(buf[i + 1]), np.float32(0.0)), np.float32(15.0))
                data[(base + i) // 2] = np.uint8(a) | (np.uint8(b) << np.uint8(4))
        else:
            for i in range(per_row):
                codes[base + i] = np.int8(min(max(np.rint(buf[i]), np.float32(-127.0)), np.float32(127.0)))
    return True


@njit(cache=True, nogil=True, boundscheck=False)
def decode_v2(row_scales, steps, zeros, data, kind, num_layers, num_heads, kv, num_tokens, width, key_group,
              value_group, asymmetric, table, words16, words32):  # type: ignore[no-untyped-def]
    """The inverse of :func:`encode_v2`, into the block's words (``x = c * s``, or ``(c - z) * s``, in float32,
    rounded once to the dtype). The row scales must have been checked (``scales.check_scales``)."""
    per_row = num_tokens * width
    rows = num_layers * (2 * num_heads if kv else 1)
    key_groups_per_row = (num_tokens // key_group) * width
    value_groups_per_row = num_tokens * (width // value_group)
    values_start = num_layers * num_heads * key_groups_per_row
    buf = np.empty(per_row, np.float32)
    scale = np.empty(max(key_groups_per_row, value_groups_per_row), np.float32)
    zero = np.zeros_like(scale)
    codes = data.view(np.int8)
    for r in range(rows):
        is_value = kv and (r // num_heads) % 2 == 1
        if kv:
            layer, head = r // (2 * num_heads), r % num_heads
            group_base = (layer * num_heads + head) * (value_groups_per_row if is_value else key_groups_per_row)
            if is_value:
                group_base += values_start
        else:
            group_base = r * key_groups_per_row
        groups = value_groups_per_row if is_value else key_groups_per_row
        row_scale = row_scales[r]
        for g in range(groups):
            scale[g] = row_scale * table[steps[group_base + g]]
            if asymmetric:
                zero[g] = np.float32(zeros[group_base + g])
        base = r * per_row
        if asymmetric:
            for i in range(0, per_row, 2):
                byte = data[(base + i) // 2]
                buf[i] = np.float32(byte & np.uint8(15))
                buf[i + 1] = np.float32(byte >> np.uint8(4))
        else:
            for i in range(per_row):
                buf[i] = np.float32(codes[base + i])
        if is_value:
            per_token = width // value_group
            for t in range(num_tokens):
                for c in range(per_token):
                    g = t * per_token + c
                    start = t * width + c * value_group
                    for i in range(value_group):
                        buf[start + i] = (buf[start + i] - zero[g]) * scale[g]
        else:
            for t in range(num_tokens):
                g0 = (t // key_group) * width
                for d in range(width):
                    buf[t * width + d] = (buf[t * width + d] - zero[g0 + d]) * scale[g0 + d]
        _store_row(buf, kind, words16, words32, r * per_row, per_row)


@njit(cache=True, nogil=True, boundscheck=False)
def encode_fp8(words16, words32, kind, rows, per_row, cap, row_scales, data):  # type: ignore[no-untyped-def]
    """``fp8_e4m3`` encode (the first layout: one float32 scale per row, ``max|row| / 448``); False on a
    non-finite value. e4m3 codes are rounded half to even from float32, saturating at +-448, as torch's."""
    buf = np.empty(per_row, np.float32)
    for r in range(rows):
        peak = _load_row(words16, words32, kind, r * per_row, per_row, buf)
        if peak == np.inf:
            return False
        s = min(peak / np.float32(448.0), cap)
        row_scales[r] = s
        inverse = np.float32(448.0) / peak if peak > 0 else np.float32(0.0)
        if s < peak / np.float32(448.0):  # capped: the scale, not the peak, sets the codes
            inverse = np.float32(1.0) / s
        bits = buf.view(np.uint32)
        base = r * per_row
        for i in range(per_row):
            y = min(max(buf[i] * inverse, np.float32(-448.0)), np.float32(448.0))
            sign = np.uint8((bits[i] >> np.uint32(24)) & np.uint32(0x80))
            magnitude = abs(y)
            if magnitude >= np.float32(2.0 ** -6):  # an e4m3 normal: rebias the exponent, round the bits
                buf[i] = magnitude
                m = bits[i] - np.uint32(120 << 23)
                code = np.uint8((m + np.uint32(0x7FFFF) + ((m >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20))
            else:
                code = np.uint8(np.rint(magnitude * np.float32(512.0)))
            data[base + i] = sign | code
    return True


@njit(cache=True, nogil=True, boundscheck=False)
def decode_fp8(row_scales, data, kind, rows, per_row, words16, words32):  # type: ignore[no-untyped-def]
    """``fp8_e4m3`` decode: each code's e4m3 value (its NaN bytes read as +-480) times its row's scale in
    float32, rounded once to the dtype. The row scales must have been checked."""
    buf = np.empty(per_row, np.float32)
    bits = buf.view(np.uint32)
    power = np.float32(2.0 ** 120)
    for r in range(rows):
        base = r * per_row
        for i in range(per_row):
            b = np.uint32(data[base + i])
            bits[i] = ((b & np.uint32(0x80)) << np.uint32(24)) | ((b & np.uint32(0x7F)) << np.uint32(20))
        s = row_scales[r]
        for i in range(per_row):
            buf[i] = (buf[i] * power) * s
        _store_row(buf, kind, words16, words32, base, per_row)
