"""Trace block ids as kvstore block hashes, and the deterministic encoded blocks the load tester writes and checks.

Hashes. A trace names each block by a chained prefix-block id (``kvstore.tools.trace``).
:func:`trace_block_hashes` turns the ids of one request into kvstore block
hashes with ``kvstore.keys.hash_blocks``: block ``i`` is given the token ids

    [k, w_0, w_1, ..., w_{k-1}, 0, 0, ..., 0]        (``block_tokens`` tokens)

where ``w_0 .. w_{k-1}`` are the id's little-endian 32-bit words and ``k`` is
their count (2 for any id below 2^64, more for the hex ids of the generic
format). The hash of block ``i`` is the chained hash over these tokens, so it
depends on the whole prefix, and the same id at the same prefix always gives
the same hash, in every process. Every trace id is one whole block, including
the last, partial block of a Mooncake prompt (``input_length`` is not a multiple
of 512): the simulator (``kvstore.tools.sim``) counts it as a block too, and so do
these hashes.

Payloads. :class:`PayloadFactory` gives every block hash one encoded block
(``kvstore.blocks.tensors``): a ``uint8`` tensor ``[1, 2, 1, block_tokens, head_dim]`` of
``payload_bytes = 2 * block_tokens * head_dim`` bytes behind the codec's 128-byte
header. The payload is a window of a pool of xxh3-128 output, seeded by
``seed``, at an offset taken from the block hash, with the block hash written
over its first bytes: cheap to make, different for every block and every seed,
and the same in every process, so a get can be checked byte for byte.
"""

from __future__ import annotations

import logging

import numpy as np
import xxhash

from kvstore.blocks.tensors import Layout, encode_header, header_nbytes
from kvstore.errors import InvalidArgumentError
from kvstore.keys import BlockHash, HashAlgorithm, Namespace, hash_blocks
from kvstore.tools.trace import MOONCAKE_BLOCK_TOKENS

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "kvstore-loadtest"
"""``Namespace.model`` of the load tester's blocks, unless told otherwise."""

PAYLOAD_DTYPE = "uint8"
"""Codec dtype of the load tester's blocks: any byte count that is a multiple of ``2 * block_tokens`` fits."""

DEFAULT_PAYLOAD_BYTES = 63 * 1024
"""Default payload of one block, bytes: 63 KiB, so that with the 128-byte codec header an encoded
block is 64,640 bytes: exactly one 64 KiB page of a page-pool memory tier (``MemoryTierConfig.page_bytes``),
and 64,640 bytes of a node's shared pool too (``kvstore.shm.node.pool.footprint``)."""

BLOCK_NDIM = Layout.KV.ndim
_MIN_BLOCK_TOKENS = 3  # the word count and two words of an id below 2^64
_POOL_SEED_TAG = b"kvstore/tools/loadtest/payload/v1\x00"


def loadtest_namespace(
    block_tokens: int = MOONCAKE_BLOCK_TOKENS, *, model: str = DEFAULT_MODEL, cache_salt: str = "",
    hash_algorithm: HashAlgorithm | str = HashAlgorithm.XXH3_128,
) -> Namespace:
    """The namespace the load tester reads and writes: ``uint8`` blocks of the ``kv`` layout.

    Args:
        block_tokens: tokens per block (512 for Mooncake traces).
        model: ``Namespace.model``; runs with different models never share blocks.
        cache_salt: ``Namespace.cache_salt`` (tenant salt).
        hash_algorithm: ``H`` of the block hashes; ``sha256`` for a node with tokens
            (``security.require_sha256``).

    Raises:
        InvalidArgumentError: if ``block_tokens`` is below 3 (an id needs three tokens) or the
            namespace is invalid.
    """
    if block_tokens < _MIN_BLOCK_TOKENS:
        raise InvalidArgumentError(f"block_tokens must be >= {_MIN_BLOCK_TOKENS}, got {block_tokens}")
    return Namespace(model=model, dtype=PAYLOAD_DTYPE, layout=Layout.KV.value, block_size=block_tokens,
                     cache_salt=cache_salt, hash_algorithm=HashAlgorithm(hash_algorithm))


def _words(block_id: int) -> list[int]:
    words = []
    while True:
        words.append(block_id & 0xFFFFFFFF)
        block_id >>= 32
        if not block_id:
            break
    while len(words) < 2:
        words.append(0)
    return words


def check_payload_bytes(block_tokens: int, payload_bytes: int) -> None:
    """Check that ``payload_bytes`` fills a ``[1, 2, 1, block_tokens, head_dim]`` uint8 tensor.

    Raises:
        InvalidArgumentError: unless it is a positive multiple of ``2 * block_tokens``; the
            message suggests the nearest sizes that are.
    """
    unit = 2 * block_tokens
    if payload_bytes <= 0 or payload_bytes % unit:
        lower = max(unit, payload_bytes // unit * unit)
        raise InvalidArgumentError(
            f"block payload must be a positive multiple of 2 * block_tokens = {unit} bytes "
            f"(a [1, 2, 1, {block_tokens}, head_dim] uint8 tensor), got {payload_bytes}; "
            f"try {lower} or {lower + unit}"
        )


def trace_tokens(block_tokens: int, block_ids: tuple[int, ...] | list[int]) -> np.ndarray:
    """The token ids that stand for ``block_ids``: ``[len(block_ids) * block_tokens]`` uint32.

    Block ``i`` is ``[k, w_0, ..., w_{k-1}, 0, ...]`` (see the module docstring).

    Raises:
        InvalidArgumentError: on a negative id, or an id whose words do not fit in one block.
    """
    num_blocks = len(block_ids)
    tokens = np.zeros(num_blocks * block_tokens, dtype="<u4")
    if not num_blocks:
        return tokens
    if min(block_ids) < 0:
        raise InvalidArgumentError("trace block ids must be >= 0")
    if max(block_ids) < 1 << 64:
        ids = np.fromiter(block_ids, dtype=np.uint64, count=num_blocks)
        tokens[0::block_tokens] = 2
        tokens[1::block_tokens] = (ids & np.uint64(0xFFFFFFFF)).astype("<u4")
        tokens[2::block_tokens] = (ids >> np.uint64(32)).astype("<u4")
        return tokens
    for index, block_id in enumerate(block_ids):
        words = _words(block_id)
        if len(words) + 1 > block_tokens:
            raise InvalidArgumentError(
                f"block id {block_id:#x} needs {len(words) + 1} tokens, more than a block of {block_tokens}"
            )
        start = index * block_tokens
        tokens[start] = len(words)
        tokens[start + 1 : start + 1 + len(words)] = words
    return tokens


def trace_block_hashes(namespace: Namespace, block_ids: tuple[int, ...] | list[int]) -> list[BlockHash]:
    """Chained kvstore block hashes of one request's trace block ids, head first.

    Args:
        namespace: the namespace (its ``block_size`` is the tokens per block).
        block_ids: the request's chained prefix-block ids, ``(num_blocks,)``.

    Returns:
        ``num_blocks`` hashes; hash ``i`` depends on ids ``0..i`` and on nothing else.

    Raises:
        InvalidArgumentError: as :func:`trace_tokens`.
    """
    return hash_blocks(namespace, trace_tokens(namespace.block_size, block_ids))


class PayloadFactory:
    """Deterministic encoded blocks of one size, one per block hash (see the module docstring).

    Args:
        namespace: the blocks' namespace; its dtype must be ``uint8`` and its layout ``kv``.
        payload_bytes: tensor bytes of one block; a positive multiple of ``2 * block_size``.
        seed: payload seed; blocks of two seeds differ (a get checked against another
            seed's payloads counts every block as a mismatch).

    Raises:
        InvalidArgumentError: on a size that is not a positive multiple of ``2 * block_size``,
            or a namespace of another dtype or layout.
    """

    def __init__(self, namespace: Namespace, payload_bytes: int = DEFAULT_PAYLOAD_BYTES, *, seed: int = 0) -> None:
        if namespace.dtype != PAYLOAD_DTYPE or namespace.layout != Layout.KV.value:
            raise InvalidArgumentError(
                f"payload blocks are {PAYLOAD_DTYPE}/{Layout.KV.value}; "
                f"the namespace is {namespace.dtype}/{namespace.layout}"
            )
        check_payload_bytes(namespace.block_size, payload_bytes)
        unit = 2 * namespace.block_size
        self.namespace = namespace
        self.payload_bytes = payload_bytes
        self.seed = seed
        self.shape = (1, 2, 1, namespace.block_size, payload_bytes // unit)
        self.header_bytes = header_nbytes(BLOCK_NDIM)
        self._pool = self._make_pool(seed, 2 * payload_bytes)
        self._hash_bytes = min(namespace.hash_bytes, payload_bytes)

    @property
    def encoded_bytes(self) -> int:
        """Bytes of one encoded block: the 128-byte header plus the payload."""
        return self.header_bytes + self.payload_bytes

    @staticmethod
    def _make_pool(seed: int, nbytes: int) -> np.ndarray:
        prefix = _POOL_SEED_TAG + int(seed).to_bytes(16, "little", signed=True)
        count = -(-nbytes // 16)
        data = b"".join(xxhash.xxh3_128_digest(prefix + i.to_bytes(8, "little")) for i in range(count))
        return np.frombuffer(data, dtype=np.uint8, count=nbytes)

    def payload(self, block_hash: bytes) -> bytes:
        """The tensor bytes of ``block_hash``'s block: ``payload_bytes`` bytes."""
        offset = int.from_bytes(block_hash[:8], "little") % self.payload_bytes
        data = bytearray(self._pool[offset : offset + self.payload_bytes])
        data[: self._hash_bytes] = block_hash[: self._hash_bytes]
        return bytes(data)

    def encoded(self, block_hash: bytes) -> bytes:
        """The encoded block (``kvstore.blocks.tensors``) of ``block_hash``: header plus payload, :attr:`encoded_bytes` long."""
        payload = self.payload(block_hash)
        return encode_header(PAYLOAD_DTYPE, Layout.KV, self.shape, payload) + payload
