"""A byte-level tokenizer: token id = UTF-8 byte, vocabulary 256; needs no download."""

from __future__ import annotations

from typing import Sequence

VOCAB_SIZE = 256
"""Token ids are the 256 byte values."""


class ByteTokenizer:
    """Maps text to its UTF-8 bytes and back (one token per byte, ASCII text: one per character)."""

    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: its UTF-8 bytes, ``[num_bytes]``."""
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``; invalid UTF-8 (random-weight output) becomes U+FFFD.

        Raises:
            ValueError: if an id is outside ``[0, 256)``.
        """
        return bytes(token_ids).decode("utf-8", errors="replace")
