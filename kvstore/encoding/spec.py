"""The lossy KV encodings' names, header codes and payload sizes: pure arithmetic, no torch (the node parses headers).

An encoded block's payload is a *scales section* then a *data section*, each
starting at a multiple of 64 bytes from the payload's start::

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
        """Whether the encoding is KIVI-style (min and scale per channel / per token group)."""
        return self in (Encoding.INT4, Encoding.INT2)


_CODES = {Encoding.FP8_E4M3: 1, Encoding.INT8: 2, Encoding.INT4: 3, Encoding.INT2: 4}
_BITS = {Encoding.FP8_E4M3: 8, Encoding.INT8: 8, Encoding.INT4: 4, Encoding.INT2: 2}
_BY_CODE = {code: encoding for encoding, code in _CODES.items()}

MAX_VALUE_GROUP = 128
"""The widest value group of int4 and int2, channels: a head of up to 128 channels is one group."""


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


def value_group(head_dim: int) -> int:
    """The value group of int4/int2 for heads of ``head_dim`` channels: the largest divisor up to 128."""
    for group in range(min(head_dim, MAX_VALUE_GROUP), 0, -1):
        if head_dim % group == 0:
            return group
    return 1


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
    group = value_group(shape[-1]) if encoding.grouped and layout == "kv" else 0
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
    group = value_group(shape[-1]) if encoding.grouped and layout == "kv" else 0
    return header_bytes + payload_plan(encoding, layout, shape, group).payload_nbytes


REFERENCE_HEAD_DIM = 128
"""The head size :func:`encoded_fraction` assumes for int4/int2's value groups (Llama, Qwen, Mistral)."""


def encoded_fraction(encoding: Encoding | None, block_tokens: int, itemsize: int = 2,
                     head_dim: int = REFERENCE_HEAD_DIM) -> float:
    """Stored bytes of a ``kv`` block's payload under ``encoding``, as a fraction of the exact payload.

    What a capacity plan needs without a model at hand (``kvstore simulate --kv-encoding``): bits per
    element of the codes plus the scales' share (fp8/int8: one float32 per row of a head's tokens, about
    nothing; int4/int2: keys' float16 minimum and scale per channel over ``block_tokens`` tokens, values'
    per token and group of ``head_dim`` channels), against ``8 * itemsize`` bits.
    """
    if encoding is None:
        return 1.0
    if not encoding.grouped:
        return (8 + 32 / (block_tokens * head_dim)) / (8 * itemsize)
    group = value_group(head_dim)
    keys = encoding.bits + 32 / block_tokens
    values = encoding.bits + 32 / group
    return (keys + values) / 2 / (8 * itemsize)
