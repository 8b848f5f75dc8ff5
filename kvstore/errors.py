"""Typed exceptions raised at kvstore's boundaries; the server maps them to gRPC status codes in one place."""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class of every error kvstore raises on purpose."""


class InvalidArgumentError(KVStoreError, ValueError):
    """The caller sent something malformed: a hash, namespace, dtype, shape or header (gRPC INVALID_ARGUMENT)."""


class ResourceExhaustedError(KVStoreError):
    """A block is over the configured maximum, a quota is spent, or no room can be made (gRPC RESOURCE_EXHAUSTED)."""


class UnavailableError(KVStoreError):
    """The store or service is closing, or a remote peer cannot be reached (gRPC UNAVAILABLE)."""


class ConfigError(KVStoreError, ValueError):
    """A configuration value is invalid.

    Attributes:
        field: dotted name of the offending field, e.g. ``tiers.memory.capacity_bytes``.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class CodecError(InvalidArgumentError):
    """Encoded block bytes cannot be decoded; the subclass names the cause."""


class TruncatedBlockError(CodecError):
    """The buffer is shorter than its header says."""


class BadMagicError(CodecError):
    """The buffer does not start with the block magic, or has an unsupported version."""


class UnsupportedVersionError(BadMagicError):
    """The buffer is a kvstore block of a format version this build does not read (e.g. version 1)."""


class UnknownDtypeError(CodecError):
    """The header names a dtype code, or the caller a dtype, that kvstore does not know."""


class UnknownEncodingError(CodecError):
    """A block header, or a namespace's ``kv_encoding``, names a lossy KV encoding this build does not know."""


class ElementCountError(CodecError):
    """The payload size does not equal ``prod(shape) * itemsize``, or the shape does not fit the layout."""


class BadScalesError(CodecError):
    """A lossy block's scales section holds a value that is not finite, negative, or large enough to decode beyond
    the block's dtype (``kvstore.blocks.encoding.scales``); the message names the field."""


class ChecksumError(CodecError):
    """The xxh3-64 checksum of the payload does not match the header: the bytes are corrupt."""


class DestinationMismatchError(ElementCountError):
    """A fetched block's dtype or shape is not its destination's, in a Get into caller tensors (``get_into``).

    The blocks before it were copied into their destinations; it and the blocks after it were not.

    Attributes:
        num_blocks: blocks copied, in prefix order, before the one that did not fit.
        num_found: blocks of the cached prefix that were fetched.
    """

    def __init__(self, message: str, num_blocks: int, num_found: int) -> None:
        super().__init__(message)
        self.num_blocks = num_blocks
        self.num_found = num_found
