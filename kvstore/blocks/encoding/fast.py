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

TINY_ROW = np.float32(2.0 ** -60)
"""A row whose largest magnitude is below this is quantized as ``BOOST`` times itself (``kernels.py`` the same), so
that ``1 / scale`` cannot overflow float32; its stored scale is ``UNBOOST`` times the boosted one."""
BOOST = np.float32(2.0 ** 64)
UNBOOST = np.float32(2.0 ** -64)
_F16_UP = np.float32(2.0 ** 112)


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _load_row(words16, words32, kind, start, count, out, bits):
    """``count`` elements from ``start`` into ``out`` (float32; ``bits``: its view as uint32, made once by the
    caller: a view made here, in the loop over rows, stops LLVM vectorizing); returns False if one is not finite
    (a float16 Inf or NaN loads as a finite 65536 .. 131008: caught by the range)."""
    limit = np.uint32(0x7F7FFFFF)  # the largest finite float32's bits; float16: its largest value's (65504)
    if kind == KIND_FLOAT32:
        source32 = words32[start:start + count]  # slices, not words[start + i]: that indexing does not vectorize
        for i in range(count):
            out[i] = source32[i]
    elif kind == KIND_BFLOAT16:
        source = words16[start:start + count]
        for i in range(count):
            bits[i] = np.uint32(source[i]) << np.uint32(16)
    else:
        limit = np.uint32(0x477FE000)
        source = words16[start:start + count]
        for i in range(count):
            h = np.uint32(source[i])
            bits[i] = ((h & np.uint32(0x8000)) << np.uint32(16)) | ((h & np.uint32(0x7FFF)) << np.uint32(13))
        for i in range(count):
            out[i] *= _F16_UP
    bad = np.uint32(0)  # integer arithmetic on the bits: fastmath (no NaN, no Inf) cannot drop it, and it vectorizes
    for i in range(count):  # 1 where |x|'s bits exceed the limit's (NaN and Inf do): the borrow of limit - |x|
        bad |= (limit - (bits[i] & np.uint32(0x7FFFFFFF))) >> np.uint32(31)
    return bad == 0


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _store_row(values, bits, kind, words16, words32, start, count):
    """``values`` (float32, finite, within the dtype's range; ``bits``: their uint32 view) into the block's words,
    rounded half to even."""
    if kind == KIND_FLOAT32:
        out32 = words32[start:start + count]
        for i in range(count):
            out32[i] = values[i]
        return
    out = words16[start:start + count]
    if kind == KIND_BFLOAT16:
        for i in range(count):
            b = bits[i]
            out[i] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
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
        out[i] = sign | h


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _largest(values, bits, word, word_float):
    """The largest of ``values`` (float32, >= 0, finite; ``bits`` their uint32 view): an integer max on the bits,
    which orders them as their values, and vectorizes where a float max does not (``word``: a 1-element scratch,
    ``word_float`` its float32 view)."""
    top = np.uint32(0)
    for i in range(bits.shape[0]):
        b = bits[i] & np.uint32(0x7FFFFFFF)  # -0.0 is 0
        top = b if b > top else top
    word[0] = top
    return word_float[0]


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _steps_of(need, row_scale, table, ratio, ratio_bits, q, inverse):
    """Each group's step: ``q[g]``, the largest ``q`` in ``[0, 255]`` with ``table[q] = 2^(-q/16) >= need[g] /
    row_scale`` (what torch's ``searchsorted`` on the reversed table gives; 255 for a zero ratio), and
    ``inverse[g] = 1 / (row_scale * table[q])`` (0 for a zero step).

    Exact and without a search (a binary search per group cost more than the rest of the encode): with
    ``ratio = m 2^e``, ``m`` in ``[1, 2)``, ``q = 16 (-e - 1) + #{b < 16: table[b] >= m / 2} - 1`` (``16 (-e)``
    where ``m`` is 1), since ``table[16 a + b] = 2^-a table[b]`` exactly: 16 comparisons against constants.
    """
    count = need.shape[0]  # ratio, ratio_bits: one scratch as float32 and as uint32 (views made once, by the caller)
    positive = row_scale > 0
    for g in range(count):
        ratio[g] = need[g] / row_scale if positive else np.float32(0.0)
    for g in range(count):  # table[16 a + b] = 2^-a table[b] exactly (tests/encoding/test_layouts.py)
        bits = ratio_bits[g]
        exponent = np.int64(bits >> np.uint32(23)) - 127
        mantissa = bits & np.uint32(0x7FFFFF)
        half = (np.float32(1.0) + np.float32(mantissa) * np.float32(2.0 ** -23)) * np.float32(0.5)  # in [0.5, 1)
        count_b = np.int64(0)  # how many of the 16 steps of an octave reach half the ratio's mantissa
        for step in range(16):
            count_b += np.int64(table[step] >= half)
        k = 16 * (-exponent - 1) + count_b - 1 if mantissa else 16 * (-exponent)
        k = 255 if (k > 255) or (bits == 0) else (0 if k < 0 else k)
        q[g] = np.int32(k)
    for g in range(count):
        s = row_scale * table[q[g]]
        inverse[g] = np.float32(1.0) / s if s > 0 else np.float32(0.0)


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _row_groups(r, kv, num_layers, num_heads, num_tokens, width, key_group, value_group):
    """Row ``r``'s ``(is_value, groups, first group's index in the steps)``."""
    key_groups = (num_tokens // key_group) * width
    value_groups = num_tokens * (width // value_group)
    if not kv:
        return False, key_groups, r * key_groups
    layer, head = r // (2 * num_heads), r % num_heads
    if (r // num_heads) % 2 == 1:
        return True, value_groups, num_layers * num_heads * key_groups + (layer * num_heads + head) * value_groups
    return False, key_groups, (layer * num_heads + head) * key_groups


_FASTMATH = {"nnan", "ninf", "nsz"}
"""What the encoders let LLVM assume: no NaN, no Inf (their input was checked finite by :func:`_load_row`, on the
bits), no signed zeros; no flag that changes a finite result (no reassociation, no contraction)."""


@njit(cache=True, nogil=True, boundscheck=False, fastmath=_FASTMATH, error_model="numpy")
def encode_v2(words16, words32, kind, num_layers, num_heads, kv, num_tokens, width, key_group, value_group,
              asymmetric, cap, table, row_scales, steps, zeros, data):
    """``int8_v2`` / ``int4_v2`` encode of a block (``spec.py``'s layout 2); returns False on a non-finite value.

    Args:
        words16, words32: the block's words (one of them is used, by ``kind``), C order.
        kv: ``kv`` layout (rows alternate K and V per layer) or ``mla`` (every row is keys).
        width: channels per token (head size, or latent size).
        cap: the largest row scale ``S`` (``scales.max_row_scale``): a larger one saturates.
        table: ``kernels_v2.STEP_TABLE`` (``2^(-q/16)``, float32, 256 entries).
        row_scales, steps, zeros, data: the payload's parts (float32, uint8, int8, uint8), written.
    """
    per_row = num_tokens * width
    rows = num_layers * (2 * num_heads if kv else 1)
    most = max((num_tokens // key_group) * width, num_tokens * (width // value_group))
    buf = np.empty(per_row, np.float32)
    bits = buf.view(np.uint32)
    signed = buf.view(np.int32)
    keys = np.empty(per_row, np.int32)
    low = np.empty(most, np.float32)
    high = np.empty(most, np.float32)
    low_keys = low.view(np.int32)
    high_keys = high.view(np.int32)
    need = np.empty(most, np.float32)
    inverse = np.empty(most, np.float32)
    zero = np.zeros(most, np.float32)
    ratio_bits = np.empty(most, np.uint32)
    ratio = ratio_bits.view(np.float32)
    q_of = np.empty(most, np.int32)
    need_bits = need.view(np.uint32)
    peak_word = np.empty(1, np.uint32)
    peak_float = peak_word.view(np.float32)
    codes = data.view(np.int8)
    for r in range(rows):
        is_value, groups, group_base = _row_groups(r, kv, num_layers, num_heads, num_tokens, width, key_group,
                                                   value_group)
        if not _load_row(words16, words32, kind, r * per_row, per_row, buf, bits):
            return False
        if is_value:  # per token, groups of value_group channels: integer reductions on order-keeping keys
            for i in range(per_row):
                b = signed[i]
                keys[i] = b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF))
            for g in range(groups):
                segment = keys[g * value_group:(g + 1) * value_group]
                lo, hi = segment[0], segment[0]
                for i in range(value_group):
                    k = segment[i]
                    lo = k if k < lo else lo
                    hi = k if k > hi else hi
                low_keys[g] = lo ^ ((lo >> np.int32(31)) & np.int32(0x7FFFFFFF))
                high_keys[g] = hi ^ ((hi >> np.int32(31)) & np.int32(0x7FFFFFFF))
        else:  # per channel, over groups of key_group tokens
            for tg in range(num_tokens // key_group):
                lo = low[tg * width:(tg + 1) * width]
                hi = high[tg * width:(tg + 1) * width]
                first = buf[tg * key_group * width:(tg * key_group + 1) * width]
                for d in range(width):
                    lo[d] = first[d]
                    hi[d] = first[d]
                for t in range(tg * key_group + 1, (tg + 1) * key_group):
                    row = buf[t * width:(t + 1) * width]
                    for d in range(width):
                        v = row[d]
                        lo[d] = v if v < lo[d] else lo[d]
                        hi[d] = v if v > hi[d] else hi[d]
        for g in range(groups):  # each group's largest magnitude (need, as scratch), then their max on the bits
            a, b = -low[g], high[g]
            need[g] = a if a > b else b
        peak = _largest(need[:groups], need_bits[:groups], peak_word, peak_float)
        boosted = peak < TINY_ROW
        if boosted:  # a tiny row: quantized as 2^64 times itself, so that no inverse overflows float32
            for i in range(per_row):
                buf[i] *= BOOST
            for g in range(groups):
                low[g] *= BOOST
                high[g] *= BOOST
        if asymmetric:
            for g in range(groups):
                a = (high[g] - low[g]) / np.float32(15.0)
                b = abs((low[g] + high[g]) * np.float32(0.5)) / np.float32(119.0)
                need[g] = a if a > b else b
        else:
            for g in range(groups):
                a, b = -low[g], high[g]
                need[g] = (a if a > b else b) / np.float32(127.0)
        row_scale = _largest(need[:groups], need_bits[:groups], peak_word, peak_float)
        row_scale = cap if row_scale > cap else row_scale
        row_scales[r] = row_scale * UNBOOST if boosted else row_scale
        _steps_of(need[:groups], row_scale, table, ratio[:groups], ratio_bits[:groups], q_of[:groups],
                  inverse[:groups])
        out_steps = steps[group_base:group_base + groups]
        for g in range(groups):
            out_steps[g] = np.uint8(q_of[g])
        if asymmetric:
            out_zeros = zeros[group_base:group_base + groups]
            for g in range(groups):
                z = np.floor(np.float32(8.0) - (low[g] + high[g]) * np.float32(0.5) * inverse[g])
                z = np.float32(-128.0) if z < np.float32(-128.0) else z
                z = np.float32(127.0) if z > np.float32(127.0) else z
                zero[g] = z
                out_zeros[g] = np.int8(z)
        if is_value:
            for g in range(groups):
                segment = buf[g * value_group:(g + 1) * value_group]
                iv, z = inverse[g], zero[g]
                for i in range(value_group):
                    segment[i] = segment[i] * iv + z
        else:
            for tg in range(num_tokens // key_group):
                iv = inverse[tg * width:(tg + 1) * width]
                zv = zero[tg * width:(tg + 1) * width]
                span = buf[tg * key_group * width:(tg + 1) * key_group * width]
                for t in range(key_group):
                    start = t * width
                    for d in range(width):
                        span[start + d] = span[start + d] * iv[d] + zv[d]
        base = r * per_row
        if asymmetric:
            packed = data[base // 2:(base + per_row) // 2]
            for j in range(per_row // 2):
                a = np.rint(buf[2 * j])
                b = np.rint(buf[2 * j + 1])
                a = np.float32(0.0) if a < np.float32(0.0) else (np.float32(15.0) if a > np.float32(15.0) else a)
                b = np.float32(0.0) if b < np.float32(0.0) else (np.float32(15.0) if b > np.float32(15.0) else b)
                packed[j] = np.uint8(a) | (np.uint8(b) << np.uint8(4))
        else:
            out = codes[base:base + per_row]
            for i in range(per_row):
                c = np.rint(buf[i])
                c = np.float32(-127.0) if c < np.float32(-127.0) else (np.float32(127.0) if c > np.float32(127.0) else c)
                out[i] = np.int8(c)
    return True


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
def decode_v2(row_scales, steps, zeros, data, kind, num_layers, num_heads, kv, num_tokens, width, key_group,
              value_group, asymmetric, table, words16, words32):
    """The inverse of :func:`encode_v2`, into the block's words (``x = c * s``, or ``(c - z) * s``, in float32,
    rounded once to the dtype). The row scales must have been checked (``scales.check_scales``)."""
    per_row = num_tokens * width
    rows = num_layers * (2 * num_heads if kv else 1)
    most = max((num_tokens // key_group) * width, num_tokens * (width // value_group))
    buf = np.empty(per_row, np.float32)
    bits = buf.view(np.uint32)
    scale = np.empty(most, np.float32)
    zero = np.zeros(most, np.float32)
    codes = data.view(np.int8)
    for r in range(rows):
        is_value, groups, group_base = _row_groups(r, kv, num_layers, num_heads, num_tokens, width, key_group,
                                                   value_group)
        row_scale = row_scales[r]
        for g in range(groups):
            scale[g] = row_scale * table[steps[group_base + g]]
        if asymmetric:
            for g in range(groups):
                zero[g] = np.float32(zeros[group_base + g])
        base = r * per_row
        if asymmetric:
            packed = data[base // 2:(base + per_row) // 2]
            for j in range(per_row // 2):
                byte = packed[j]
                buf[2 * j] = np.float32(byte & np.uint8(15))
                buf[2 * j + 1] = np.float32(byte >> np.uint8(4))
        else:
            source = codes[base:base + per_row]
            for i in range(per_row):
                buf[i] = np.float32(source[i])
        if is_value:
            for g in range(groups):
                segment = buf[g * value_group:(g + 1) * value_group]
                s, z = scale[g], zero[g]
                for i in range(value_group):
                    segment[i] = (segment[i] - z) * s
        else:
            for t in range(num_tokens):
                tg = t // key_group
                row = buf[t * width:(t + 1) * width]
                sv = scale[tg * width:(tg + 1) * width]
                zv = zero[tg * width:(tg + 1) * width]
                for d in range(width):
                    row[d] = (row[d] - zv[d]) * sv[d]
        _store_row(buf, bits, kind, words16, words32, base, per_row)


@njit(cache=True, nogil=True, boundscheck=False, fastmath=_FASTMATH, error_model="numpy")
def encode_fp8(words16, words32, kind, rows, per_row, cap, row_scales, data):
    """``fp8_e4m3`` encode (the first layout: one float32 scale per row, ``max|row| / 448``); False on a
    non-finite value. e4m3 codes are rounded half to even from float32, saturating at +-448, as torch's."""
    buf = np.empty(per_row, np.float32)
    bits = buf.view(np.uint32)
    signs = np.empty(per_row, np.uint8)
    peak_word = np.empty(1, np.uint32)
    peak_float = peak_word.view(np.float32)
    for r in range(rows):
        if not _load_row(words16, words32, kind, r * per_row, per_row, buf, bits):
            return False
        peak_bits = np.uint32(0)  # |x| orders as its bits do: an integer max vectorizes, a float one does not
        for i in range(per_row):
            m = bits[i] & np.uint32(0x7FFFFFFF)
            peak_bits = m if m > peak_bits else peak_bits
        peak_word[0] = peak_bits
        peak = peak_float[0]
        s = peak / np.float32(448.0)
        inverse = np.float32(448.0) / peak if peak > 0 else np.float32(0.0)
        if s > cap:  # capped: the scale, not the peak, sets the codes
            s = cap
            inverse = np.float32(1.0) / s
        if peak < TINY_ROW:  # a tiny row: quantized as 2^64 times itself, so that the inverse does not overflow
            s = (peak * BOOST) / np.float32(448.0) * UNBOOST
            inverse = np.float32(448.0) / (peak * BOOST) if peak > 0 else np.float32(0.0)
            for i in range(per_row):
                buf[i] *= BOOST
        row_scales[r] = s
        for i in range(per_row):
            signs[i] = np.uint8((bits[i] >> np.uint32(24)) & np.uint32(0x80))
        for i in range(per_row):
            y = abs(buf[i] * inverse)
            buf[i] = np.float32(448.0) if y > np.float32(448.0) else y
        out = data[r * per_row:(r + 1) * per_row]
        for i in range(per_row):
            magnitude = buf[i]
            m = bits[i] - np.uint32(120 << 23)  # an e4m3 normal: rebias the exponent, round the bits
            normal = np.uint8((m + np.uint32(0x7FFFF) + ((m >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20))
            subnormal = np.uint8(np.rint(magnitude * np.float32(512.0)))  # below 2^-6: 2^-9 steps, exact to scale
            out[i] = signs[i] | (normal if magnitude >= np.float32(2.0 ** -6) else subnormal)
    return True


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
def decode_fp8(row_scales, data, kind, rows, per_row, words16, words32):
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
        _store_row(buf, bits, kind, words16, words32, base, per_row)
