"""The lossy KV encodings' names, header codes and payload sizes: pure arithmetic, no torch (the node parses headers).

An encoded block's payload is a *scales section* then a *data section*, each
starting at a multiple of 64 bytes from the payload's start. The first layouts::

    fp8_e4m3, int8   scales: float32 [rows]                         (one per row)
                     data:   1 byte per element, rows in C order
    int4, int2       scales: float16, back to back:
                       kv:  K scale [L, H, D], K min [L, H, D],      (keys: per channel over the block's tokens)
                            V scale [L, H, T, D / g], V min [...]     (values: per token, groups of g channels)
                       mla: scale [L, C], min [L, C]                  (per channel over the block's tokens)
                     data:   ``bits`` per element, 8 / bits elements per byte, the first in the low bits

A *row* is one (layer, K or V, KV head) of a ``kv`` block ``[L, 2, H, T, D]``
(``L * 2 * H`` rows of ``T * D`` elements), or one layer of an ``mla`` block
``[L, 1, T, C]``. The keys-per-channel, values-per-token split of int4 and
int2 is KIVI's (Liu et al. 2024, arXiv 2402.02750; ``jy-yuan/KIVI``): keys have
outlier channels, values do not.

The second layouts (``int8_v2``, ``int4_v2``) give int8 KIVI's split too, and
make every scale an 8-bit step below one float32 scale per row::

    scales:  float32 [rows]                      S, one per row, >= 0 (the row's largest step)
             uint8   keys   [L, H, T / Gk, D]    q: step s = S * 2^(-q / 16) per channel and token group
             uint8   values [L, H, T, D / Gv]    q: per token and channel group       (kv only)
             int4_v2 only, int8, the same order:  z: zero point per group (x = (c - z) * s)
    data:    int8_v2: int8 codes c in [-127, 127], x = c * s
             int4_v2: 4-bit codes c in [0, 15], two a byte, the first in the low bits

``Gk`` (tokens per key group) is the largest divisor of the block's tokens up to
:data:`MAX_KEY_GROUP`, ``Gv`` (channels per value group) the largest divisor of the
head size up to the encoding's :attr:`Encoding.max_value_group`; an ``mla`` block's
latents are keys (``[L, T / Gk, C]``) and its rows are its layers. The 8-bit steps
``2^(-q / 16)`` are 4.4 % apart and span 2^-16 below ``S``: a scale costs 8 bits, not
16 or 32, which is what keeps a 16-token block's per-channel key scales within
half the bytes of bfloat16 (``docs/encodings.md``). Only ``S`` can be out of range (every
``q`` and ``z`` byte is a valid value), so a node checks one float per row
(``kvstore.blocks.encoding.scales``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from kvstore.errors import ElementCountError, InvalidArgumentError, UnknownEncodingError

SECTION_ALIGNMENT = 64
"""Each payload section starts at a multiple of this many bytes."""


class Encoding(str, enum.Enum):
    """A lossy KV encoding; the value is the namespace's ``kv_encoding``, the code the header's byte."""

    FP8_E4M3 = "fp8_e4m3"
    INT8 = "int8"
    INT4 = "int4"
    INT2 = "int2"
    INT8_V2 = "int8_v2"
    INT4_V2 = "int4_v2"

    @property
    def code(self) -> int:
        """The header's one-byte code (frozen)."""
        return _CODES[self]

    @property
    def bits(self) -> int:
        """Bits per element of the data section."""
        return _BITS[self]

    @property
    def grouped(self) -> bool:
        """Whether the encoding is of the first KIVI-style layout (float16 min and scale per channel / token group)."""
        return self in (Encoding.INT4, Encoding.INT2)

    @property
    def version(self) -> int:
        """The layout: 1 (``fp8_e4m3``, ``int8``, ``int4``, ``int2``) or 2 (``int8_v2``, ``int4_v2``)."""
        return 2 if self in (Encoding.INT8_V2, Encoding.INT4_V2) else 1

    @property
    def asymmetric(self) -> bool:
        """Whether a layout-2 encoding stores a zero point per group (``int4_v2``)."""
        return self is Encoding.INT4_V2

    @property
    def max_value_group(self) -> int:
        """The widest value group, channels: 128 for the first layouts and ``int8_v2``, 64 for ``int4_v2``."""
        return 64 if self is Encoding.INT4_V2 else MAX_VALUE_GROUP

    @property
    def code_span(self) -> int:
        """The largest ``|code|`` (or ``|c - z|``) a payload's bytes can hold, whatever they are: what bounds a
        decoded value by ``code_span * scale`` (``kvstore.blocks.encoding.scales``). e4m3's NaN bytes count as 480."""
        return _CODE_SPANS[self]


_CODES = {Encoding.FP8_E4M3: 1, Encoding.INT8: 2, Encoding.INT4: 3, Encoding.INT2: 4, Encoding.INT8_V2: 5,
          Encoding.INT4_V2: 6}
_BITS = {Encoding.FP8_E4M3: 8, Encoding.INT8: 8, Encoding.INT4: 4, Encoding.INT2: 2, Encoding.INT8_V2: 8,
         Encoding.INT4_V2: 4}
_CODE_SPANS = {Encoding.FP8_E4M3: 480, Encoding.INT8: 128, Encoding.INT4: 15, Encoding.INT2: 3,
               Encoding.INT8_V2: 128, Encoding.INT4_V2: 143}
_BY_CODE = {code: encoding for encoding, code in _CODES.items()}

MAX_VALUE_GROUP = 128
"""The widest value group of int4 and int2, channels: a head of up to 128 channels is one group."""
MAX_KEY_GROUP = 32
"""The most tokens a layout-2 key group spans (a block of 16 tokens is one group; of 64, two)."""
LOG_STEPS = 16
"""Layout 2's 8-bit scales are ``S * 2^(-q / LOG_STEPS)``, ``q`` in ``[0, 255]``."""


def encoding_of(name: object) -> Encoding | None:
    """The encoding a namespace's ``kv_encoding`` names: ``None`` for ``""`` (exact blocks).

    Raises:
        UnknownEncodingError: on any other name, naming the valid ones.
    """
    if name in ("", None):
        return None
    try:
        return Encoding(name)
    except ValueError:
        raise UnknownEncodingError(f"unknown KV encoding {name!r}; known: "
                                   f"{', '.join(e.value for e in Encoding)} (or '' for exact blocks)") from None


def encoding_of_code(code: int) -> Encoding:
    """The encoding of a header's code byte.

    Raises:
        UnknownEncodingError: on a code this build does not know (a newer writer's encoding, or a corrupt byte).
    """
    try:
        return _BY_CODE[code]
    except KeyError:
        raise UnknownEncodingError(f"unknown KV encoding code {code} in a block header; this build knows "
                                   + ", ".join(f"{c} ({e.value})" for c, e in sorted(_BY_CODE.items()))) from None


def value_group(head_dim: int, limit: int = MAX_VALUE_GROUP) -> int:
    """The value group for heads of ``head_dim`` channels: the largest divisor up to ``limit`` (int4/int2: 128;
    layout 2: :attr:`Encoding.max_value_group`)."""
    return _largest_divisor(head_dim, limit)


def key_group(num_tokens: int) -> int:
    """Layout 2's key group for blocks of ``num_tokens`` tokens: the largest divisor up to :data:`MAX_KEY_GROUP`."""
    return _largest_divisor(num_tokens, MAX_KEY_GROUP)


def _largest_divisor(n: int, limit: int) -> int:
    for group in range(min(n, limit), 0, -1):
        if n % group == 0:
            return group
    return 1


def group_of(encoding: Encoding, layout: str, shape: tuple[int, ...]) -> int:
    """The value group a block of ``shape`` gets under ``encoding`` (the header's group field; 0 where none)."""
    if layout != "kv" or not (encoding.grouped or encoding.version == 2):
        return 0
    return value_group(shape[-1], encoding.max_value_group)


@dataclass(frozen=True, slots=True)
class ScalesPlan:
    """Where a layout-2 scales section's parts are, counts of elements from the payload's start (each part's
    dtype is in the module docstring).

    Attributes:
        rows: float32 row scales ``S`` at byte 0.
        key_groups: uint8 key steps, at byte ``4 * rows``.
        value_groups: uint8 value steps, after the key steps (0 for ``mla``).
        zero_points: whether int8 zero points follow, one per key and value group (``int4_v2``).
    """

    rows: int
    key_groups: int
    value_groups: int
    zero_points: bool

    @property
    def steps_offset(self) -> int:
        """Byte offset of the uint8 steps."""
        return 4 * self.rows

    @property
    def num_groups(self) -> int:
        """Key and value groups together."""
        return self.key_groups + self.value_groups

    @property
    def zeros_offset(self) -> int:
        """Byte offset of the zero points (``int4_v2``)."""
        return self.steps_offset + self.num_groups

    @property
    def nbytes(self) -> int:
        """Bytes of the scales section (unpadded)."""
        return self.zeros_offset + (self.num_groups if self.zero_points else 0)


def scales_plan(encoding: Encoding, layout: str, shape: tuple[int, ...]) -> ScalesPlan:
    """The parts of a layout-2 scales section for a block of ``shape`` (see the module docstring)."""
    if layout == "kv":
        num_layers, _, num_heads, num_tokens, head_dim = shape
        keys = num_layers * num_heads * (num_tokens // key_group(num_tokens)) * head_dim
        values = num_layers * num_heads * num_tokens * (head_dim // value_group(head_dim, encoding.max_value_group))
        return ScalesPlan(2 * num_layers * num_heads, keys, values, encoding.asymmetric)
    num_layers, _, num_tokens, latent = shape
    return ScalesPlan(num_layers, num_layers * (num_tokens // key_group(num_tokens)) * latent, 0, encoding.asymmetric)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SECTION_ALIGNMENT) * SECTION_ALIGNMENT


@dataclass(frozen=True, slots=True)
class PayloadPlan:
    """Where an encoded payload's sections are, bytes from the payload's start.

    Attributes:
        scales_nbytes: bytes of the scales (unpadded).
        data_offset: where the data section starts (a multiple of 64).
        data_nbytes: bytes of the data section.
    """

    scales_nbytes: int
    data_offset: int
    data_nbytes: int

    @property
    def payload_nbytes(self) -> int:
        """The whole payload, bytes."""
        return self.data_offset + self.data_nbytes


def payload_plan(encoding: Encoding, layout: str, shape: tuple[int, ...], group: int) -> PayloadPlan:
    """The sections of a payload of ``encoding`` for a block of ``shape`` (see the module docstring).

    Args:
        encoding: the encoding.
        layout: ``"kv"`` or ``"mla"``.
        shape: the block's logical shape, ``[L, 2, H, T, D]`` or ``[L, 1, T, C]``.
        group: value group of int4/int2 (channels); 0 for fp8 and int8.

    Raises:
        ElementCountError: if the shape does not fit the encoding (the last dimension not a multiple of
            the elements per byte, or of the value group), or the group is not the one this build writes.
    """
    num_elements = math.prod(shape)
    if encoding.version == 2:
        expected = group_of(encoding, layout, shape)
        if group != expected:
            raise ElementCountError(f"encoding {encoding.value}: value group {group} for a block of shape "
                                    f"{list(shape)}, this build uses {expected}")
        per_byte = 8 // encoding.bits
        if shape[-1] % per_byte:
            raise ElementCountError(f"encoding {encoding.value} packs {per_byte} elements a byte: the last "
                                    f"dimension ({shape[-1]}) must be a multiple of {per_byte}")
        scales = scales_plan(encoding, layout, shape).nbytes
        return PayloadPlan(scales, _aligned(scales), num_elements // per_byte)
    if not encoding.grouped:
        if group:
            raise ElementCountError(f"encoding {encoding.value} has no value group, the header says {group}")
        rows = math.prod(shape[:3]) if layout == "kv" else math.prod(shape[:2])
        scales = 4 * rows
        return PayloadPlan(scales, _aligned(scales), num_elements)
    per_byte = 8 // encoding.bits
    last = shape[-1]
    if last % per_byte:
        raise ElementCountError(f"encoding {encoding.value} packs {per_byte} elements a byte: the last dimension "
                                f"({last}) must be a multiple of {per_byte}")
    if layout == "kv":
        num_layers, _, num_heads, num_tokens, head_dim = shape
        if group != value_group(head_dim):
            raise ElementCountError(f"encoding {encoding.value}: value group {group} for heads of {head_dim} "
                                    f"channels, this build uses {value_group(head_dim)}")
        num_scales = 2 * num_layers * num_heads * head_dim + 2 * num_layers * num_heads * num_tokens * (head_dim // group)
    else:
        if group:
            raise ElementCountError(f"encoding {encoding.value} on 'mla' has no value group, the header says {group}")
        num_scales = 2 * shape[0] * shape[3]
    scales = 2 * num_scales
    return PayloadPlan(scales, _aligned(scales), num_elements // per_byte)


def check_encodable(encoding: Encoding, layout: str, shape: tuple[int, ...]) -> int:
    """The value group a block of ``shape`` gets under ``encoding`` (0 where there is none), if it can be encoded.

    Raises:
        InvalidArgumentError: if the shape cannot be encoded (see :func:`payload_plan`).
    """
    group = group_of(encoding, layout, shape)
    try:
        payload_plan(encoding, layout, shape, group)
    except ElementCountError as exc:
        raise InvalidArgumentError(str(exc)) from None
    return group


def encoded_nbytes_of(encoding: Encoding | None, layout: str, shape: tuple[int, ...], itemsize: int,
                      header_bytes: int) -> int:
    """The stored bytes of one block of ``shape`` under ``encoding`` (``None``: exact), header included.

    What a capacity plan needs (``kvstore simulate --kv-encoding``): e.g. a Llama-3-8B block of 16 tokens,
    ``[32, 2, 8, 16, 128]`` bf16, is 2,097,280 bytes exact and 1,049,728 under int8.
    """
    if encoding is None:
        return header_bytes + math.prod(shape) * itemsize
    return header_bytes + payload_plan(encoding, layout, shape, group_of(encoding, layout, shape)).payload_nbytes


REFERENCE_HEAD_DIM = 128
"""The head size :func:`encoded_fraction` assumes for int4/int2's value groups (Llama, Qwen, Mistral)."""


def encoded_fraction(encoding: Encoding | None, block_tokens: int, itemsize: int = 2,
                     head_dim: int = REFERENCE_HEAD_DIM) -> float:
    """Stored bytes of a ``kv`` block's payload under ``encoding``, as a fraction of the exact payload.

    What a capacity plan needs without a model at hand (``kvstore simulate --kv-encoding``): bits per
    element of the codes plus the scales' share (fp8/int8: one float32 per row of a head's tokens, about
    nothing; int4/int2: keys' float16 minimum and scale per channel over ``block_tokens`` tokens, values'
    per token and group of ``head_dim`` channels; layout 2: an 8-bit step, and for ``int4_v2`` an 8-bit zero
    point, per key and value group; the float32 per row is left out), against ``8 * itemsize`` bits.
    """
    if encoding is None:
        return 1.0
    if encoding.version == 2:
        per_group = 16 if encoding.asymmetric else 8  # an 8-bit step, and an 8-bit zero point where asymmetric
        keys = encoding.bits + per_group / key_group(block_tokens)
        values = encoding.bits + per_group / value_group(head_dim, encoding.max_value_group)
        return (keys + values) / 2 / (8 * itemsize)
    if not encoding.grouped:
        return (8 + 32 / (block_tokens * head_dim)) / (8 * itemsize)
    group = value_group(head_dim)
    keys = encoding.bits + 32 / block_tokens
    values = encoding.bits + 32 / group
    return (keys + values) / 2 / (8 * itemsize)
