"""Which kernels encode and decode a payload: numba's one-pass CPU kernels (``fast.py``) where they apply, torch's
(``kernels.py``, ``kernels_v2.py``) elsewhere (GPUs, the first int8/int4/int2 layouts, a host without numba).

Both give the same bytes and values (``tests/encoding/test_fast.py``), so which
one ran never shows in a block. ``KVSTORE_ENCODING_KERNELS=torch`` in the
environment makes a process use torch's everywhere.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import numpy as np
import torch

import kvstore.blocks.encoding.kernels as kernels
import kvstore.blocks.encoding.kernels_v2 as kernels_v2
from kvstore.blocks.encoding.scales import max_row_scale
from kvstore.blocks.encoding.spec import Encoding, PayloadPlan, key_group, scales_plan, value_group
from kvstore.errors import InvalidArgumentError

FAST_ENCODINGS = (Encoding.FP8_E4M3, Encoding.INT8_V2, Encoding.INT4_V2)
"""The encodings ``fast.py`` runs on CPUs."""
_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


@functools.cache
def fast_kernels() -> ModuleType | None:
    """``kvstore.blocks.encoding.fast`` if numba imports and ``KVSTORE_ENCODING_KERNELS`` is not ``torch``, else ``None``."""
    if os.environ.get("KVSTORE_ENCODING_KERNELS", "") == "torch":
        return None
    try:
        import kvstore.blocks.encoding.fast as fast
    except ImportError:  # numba is a dependency; a host without it gets the torch kernels
        return None
    return fast


def _words(tensor: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """A CPU tensor's words as numpy arrays (uint16 and float32; the one that fits its dtype is a view)."""
    if tensor.dtype == torch.float32:
        return np.empty(0, np.uint16), tensor.detach().reshape(-1).numpy()
    return tensor.detach().reshape(-1).view(torch.int16).numpy().view(np.uint16), np.empty(0, np.float32)


def _shape_args(layout: str, encoding: Encoding, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``(num_layers, num_heads, kv, num_tokens, width, key_group, value_group)`` of a block."""
    if layout == "kv":
        num_layers, _, num_heads, num_tokens, width = shape
        return (num_layers, num_heads, True, num_tokens, width, key_group(num_tokens),
                value_group(width, encoding.max_value_group))
    num_layers, _, num_tokens, width = shape
    return num_layers, 1, False, num_tokens, width, key_group(num_tokens), width


def _rows(layout: str, shape: tuple[int, ...]) -> tuple[int, int]:
    leading = 3 if layout == "kv" else 2
    rows = int(np.prod(shape[:leading]))
    return rows, int(np.prod(shape)) // max(rows, 1)


def encode_payload(block: torch.Tensor, layout: str, encoding: Encoding, group: int, plan: PayloadPlan,
                   payload: torch.Tensor, dtype: str) -> None:
    """Write ``block`` (contiguous, float16/bfloat16/float32) encoded into ``payload`` (``uint8``, its device).

    Raises:
        InvalidArgumentError: if a value is not finite, or does not fit the encoding (the first int4/int2
            layout: float16's range).
    """
    if plan.data_offset > plan.scales_nbytes:
        payload[plan.scales_nbytes:plan.data_offset].zero_()
    cap = max_row_scale(encoding, dtype) if encoding in FAST_ENCODINGS or encoding is Encoding.INT8 else 0.0
    fast = fast_kernels() if block.device.type == "cpu" and encoding in FAST_ENCODINGS else None
    if fast is None:
        if encoding.version == 2:
            kernels_v2.encode_v2(block, layout, encoding, cap, plan, payload)
        else:
            kernels.encode_payload(block, layout, encoding, group, plan, payload, cap)
        return
    words16, words32 = _words(block)
    out = payload.numpy()
    data = out[plan.data_offset:plan.payload_nbytes]
    if encoding is Encoding.FP8_E4M3:
        rows, per_row = _rows(layout, tuple(block.shape))
        ok = fast.encode_fp8(words16, words32, _KINDS[block.dtype], rows, per_row, np.float32(cap),
                             out[:plan.scales_nbytes].view(np.float32), data)
    else:
        sp = scales_plan(encoding, layout, tuple(block.shape))
        ok = fast.encode_v2(words16, words32, _KINDS[block.dtype], *_shape_args(layout, encoding, tuple(block.shape)),
                            encoding.asymmetric, np.float32(cap), _TABLE,
                            out[:sp.steps_offset].view(np.float32), out[sp.steps_offset:sp.zeros_offset],
                            out[sp.zeros_offset:sp.nbytes].view(np.int8) if encoding.asymmetric
                            else np.empty(0, np.int8), data)
    if not ok:
        raise InvalidArgumentError(f"a KV value is not finite (NaN or Inf): {encoding.value} cannot encode it")


def decode_payload_into(payload: torch.Tensor, layout: str, encoding: Encoding, group: int, plan: PayloadPlan,
                        out: torch.Tensor) -> None:
    """Decode ``payload`` (``uint8`` on ``out``'s device, its scales checked) into ``out`` (contiguous)."""
    fast = fast_kernels() if out.device.type == "cpu" and encoding in FAST_ENCODINGS else None
    if fast is None:
        if encoding.version == 2:
            kernels_v2.decode_v2(payload, layout, encoding, plan, out)
        else:
            kernels.decode_payload_into(payload, layout, encoding, group, plan, out)
        return
    words16, words32 = _words(out)
    source = payload.numpy()
    data = source[plan.data_offset:plan.payload_nbytes]
    if encoding is Encoding.FP8_E4M3:
        rows, per_row = _rows(layout, tuple(out.shape))
        fast.decode_fp8(source[:plan.scales_nbytes].view(np.float32), data, _KINDS[out.dtype], rows, per_row,
                        words16, words32)
        return
    sp = scales_plan(encoding, layout, tuple(out.shape))
    fast.decode_v2(source[:sp.steps_offset].view(np.float32), source[sp.steps_offset:sp.zeros_offset],
                   source[sp.zeros_offset:sp.nbytes].view(np.int8) if encoding.asymmetric else np.empty(0, np.int8),
                   data, _KINDS[out.dtype], *_shape_args(layout, encoding, tuple(out.shape)), encoding.asymmetric,
                   _TABLE, words16, words32)


_TABLE = kernels_v2.STEP_TABLE.numpy()
