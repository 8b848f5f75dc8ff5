"""Lossy KV encodings (int8_v2, int4_v2, fp8_e4m3; int8, int4, int2) of blocks, opted into per namespace
(``Namespace.kv_encoding``).

``spec`` (names, codes, sizes) imports no torch and is what the block format and the
node use; ``blocks`` and ``kernels`` (torch) are imported on first use of the
names below, so that parsing a header never loads torch. See ``docs/encodings.md``.
"""

from __future__ import annotations

from typing import Any

from kvstore.blocks.encoding.spec import Encoding, encoded_nbytes_of, encoding_of

__all__ = ["Encoding", "decode_block_into", "decode_payload", "encode_for_put", "encode_lossy",
           "encoded_nbytes_of", "encoding_of", "read_scales", "warm_up"]

_LAZY = {"decode_block_into", "decode_payload", "encode_for_put", "encode_lossy", "read_scales", "warm_up"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from kvstore.blocks.encoding import blocks

        return getattr(blocks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
