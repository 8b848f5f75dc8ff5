"""The scales section of a lossy block, checked: finite, non-negative, and small enough that no byte of the data
section can decode to a value beyond the block's dtype (numpy only: the node runs it on every put).

A checksum says the bytes are the writer's; it does not say the writer was
honest. A scale of NaN, Inf or 3e38 would decode into NaN or Inf tensors of the
right shape, and a negative one into sign-flipped values, which an engine would
take into its KV cache. So a node refuses such a block at put
(``kvstore.validation.check_block``, every put path), treats one read from a
disk or Redis tier as a miss (``validation.fits_namespace``), and a client refuses
one before decoding it (``kvstore.blocks.encoding.blocks``): no non-finite value is ever
decoded from a stored block.

The bound: a decoded value is at most ``code_span * scale`` (``Encoding.code_span``:
the largest ``|code|`` any byte can hold, e.g. 128 for int8, whose writer uses
only +-127; 480 for e4m3, whose NaN bytes decode as +-480), or ``|min| + code_max *
scale`` for the first int4/int2 layout, and it must not exceed the dtype's largest
finite value. Encoders cap their scales the same way (:func:`max_row_scale`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvstore.blocks.encoding.spec import Encoding, payload_plan, scales_plan
from kvstore.errors import BadScalesError

if TYPE_CHECKING:
    from kvstore.blocks.format import BlockHeader

DTYPE_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38}
"""The largest finite value of each dtype a lossy block may have (``torch.finfo(dtype).max``)."""


def max_row_scale(encoding: Encoding, dtype: str) -> float:
    """The largest row scale a block of ``dtype`` may hold under ``encoding`` (fp8, int8 and layout 2: ``dtype
    max / code_span``); an encoder caps its scales here, so a value within 1 % of float16's largest saturates."""
    return float(np.float32(DTYPE_MAX[dtype] / encoding.code_span * (1 - 2.0 ** -20)))


def check_scales(header: BlockHeader, block: bytes | bytearray | memoryview) -> None:
    """Check the scales section of a lossy block (``header.encoding`` set) against the module's bounds.

    Args:
        header: the block's parsed :class:`~kvstore.blocks.format.BlockHeader`.
        block: the whole block (header and payload).

    Raises:
        BadScalesError: (an ``InvalidArgumentError``: gRPC INVALID_ARGUMENT) naming the first bad field, its
            index and value, and the bound.
    """
    encoding = Encoding(header.encoding)
    dtype = header.dtype
    layout = header.layout.value
    shape = header.shape
    start = header.header_nbytes
    limit = DTYPE_MAX[dtype]
    view = memoryview(block).cast("B")
    if encoding.version == 2 or not encoding.grouped:
        rows = (scales_plan(encoding, layout, shape).rows if encoding.version == 2
                else (shape[0] * shape[1] * shape[2] if layout == "kv" else shape[0]))
        scales = np.frombuffer(view, dtype="<f4", count=rows, offset=start).astype(np.float64)
        _check("row scale", scales, 0.0, limit / encoding.code_span, encoding, dtype)
        return
    plan = payload_plan(encoding, layout, shape, header.group)
    wide = np.frombuffer(view, dtype="<f2", count=plan.scales_nbytes // 2, offset=start).astype(np.float64)
    code_max = (1 << encoding.bits) - 1
    parts: tuple[tuple[str, np.ndarray], ...]
    if layout == "kv":
        num_layers, _, num_heads, num_tokens, head_dim = shape
        per = num_layers * num_heads * head_dim
        parts = (("K scale", wide[:per]), ("K min", wide[per:2 * per]))
        rest = (len(wide) - 2 * per) // 2
        parts += (("V scale", wide[2 * per:2 * per + rest]), ("V min", wide[2 * per + rest:]))
    else:
        count = len(wide) // 2
        parts = (("scale", wide[:count]), ("min", wide[count:]))
    for (scale_name, scale), (min_name, minimum) in (parts[i:i + 2] for i in range(0, len(parts), 2)):
        _check(scale_name, scale, 0.0, limit / code_max, encoding, dtype)
        _check(min_name, minimum, -limit, limit, encoding, dtype)
        reach = np.abs(minimum) + code_max * scale
        bad = np.flatnonzero(reach > limit)
        if bad.size:
            i = int(bad[0])
            raise BadScalesError(f"scales section: {min_name} {float(minimum[i])!r} and {scale_name} "
                                 f"{float(scale[i])!r} at index {i} reach {reach[i]:.4g}, beyond {dtype}'s largest value ({limit:.4g}) "
                                 f"({encoding.value} block)")


def _check(name: str, values: np.ndarray, low: float, high: float, encoding: Encoding, dtype: str) -> None:
    """Raise :class:`BadScalesError` naming the first of ``values`` that is not finite or not in ``[low, high]``."""
    bad = np.flatnonzero(~((values >= low) & (values <= high)))  # NaN compares false: caught
    if bad.size:
        i = int(bad[0])
        raise BadScalesError(f"scales section: {name} {i} is {float(values[i])!r}; it must be finite and in "
                             f"[{low:.4g}, {high:.4g}] for {dtype} {encoding.value} blocks")
