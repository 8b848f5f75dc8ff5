"""Argument checks shared by the store and the clients: a put's hashes, blocks, priority and retention; durations."""

from __future__ import annotations

import logging
import math
import numbers
import operator
from typing import Sequence

from kvstore.api import Block, Buffer
from kvstore.blocks.copying import TensorBlock, block_mismatch
from kvstore.blocks.tensors import BlockHeader, Layout, LikeBlocks, decode_header, verify_block
from kvstore.blocks.encoding.scales import check_scales
from kvstore.errors import CodecError, InvalidArgumentError, ResourceExhaustedError
from kvstore.keys import BlockHash, BlockKey, Namespace, check_block_hashes
from kvstore.policy import MAX_PRIORITY, MIN_PRIORITY

logger = logging.getLogger(__name__)

_PLAIN_HASH_TYPES = frozenset((bytes, bytearray))
"""Hash types whose ``len`` is their byte length (a ``memoryview``'s need not be)."""


def check_put(
    namespace: Namespace,
    block_hashes: Sequence[BlockHash],
    blocks: Sequence[Block],
    priority: int | None,
    retention_s: float | None,
) -> tuple[int | None, float | None]:
    """Check the arguments of a client's put before any call starts, as the node's store would.

    A bad argument must raise here: the Put messages are built lazily on
    gRPC's side of the call, where an error is lost (sync: UNKNOWN; asyncio: a
    cancellation). The blocks themselves are checked by
    :func:`kvstore.blocks.copying.blocks_for_put` (tensors) and the node (bytes).

    Args:
        namespace: namespace of the blocks.
        block_hashes: one hash per block, each bytes-like of ``namespace.hash_bytes`` bytes.
        blocks: the blocks, as many as hashes.
        priority: as :func:`check_priority`.
        retention_s: as :func:`check_retention_s`.

    Returns:
        ``(priority, retention_s)`` as ``int`` and ``float`` (``None`` stays ``None``).

    Raises:
        InvalidArgumentError: on a namespace that is not a :class:`Namespace`, hashes that are not a
            sequence, a count mismatch, a hash that is not bytes-like or of the wrong length, or a bad
            priority or retention_s.
    """
    check_block_hashes(namespace, block_hashes)
    check_hash_widths(namespace, block_hashes)
    check_counts(len(block_hashes), len(blocks))
    return check_priority(priority), check_retention_s(retention_s)


def check_hash_widths(namespace: Namespace, block_hashes: Sequence[BlockHash]) -> None:
    """Check that every hash is exactly ``namespace.hash_bytes`` long (not only that their total is right).

    :func:`kvstore.keys.check_block_hashes` checks the joined length in one C
    call; hashes of different lengths can add up to the right total, which this
    refuses. Plain ``bytes`` hashes are checked by C loops (1,024 in ~0.1 ms).

    Raises:
        InvalidArgumentError: naming the first hash that is not bytes-like or not of the namespace's width.
    """
    width = namespace.hash_bytes
    if set(map(type, block_hashes)) <= _PLAIN_HASH_TYPES and set(map(len, block_hashes)) <= {width}:
        return
    for index, block_hash in enumerate(block_hashes):
        try:
            nbytes = memoryview(block_hash).nbytes
        except TypeError:
            raise InvalidArgumentError(
                f"block hash {index}: expected bytes, bytearray or memoryview, got {type(block_hash).__name__}"
            ) from None
        if nbytes != width:
            raise InvalidArgumentError(f"block hash {index}: must be {width} bytes for "
                                       f"{namespace.hash_algorithm.value}, got {nbytes}")


def check_counts(num_hashes: int, num_blocks: int) -> None:
    """Check that a put has one block per hash.

    Raises:
        InvalidArgumentError: otherwise.
    """
    if num_hashes != num_blocks:
        raise InvalidArgumentError(f"{num_hashes} hashes but {num_blocks} blocks")


def check_priority(priority: int | None) -> int | None:
    """``priority`` as an ``int`` if it is an integer in ``[0, 100]`` (numpy integers too, not ``bool``).

    The range is TensorRT-LLM's retention priorities (:data:`kvstore.policy.MIN_PRIORITY`,
    :data:`~kvstore.policy.MAX_PRIORITY`). ``None`` (the store's default) stays ``None``.

    Raises:
        InvalidArgumentError: otherwise.
    """
    if priority is None:
        return None
    try:
        value = None if isinstance(priority, bool) else operator.index(priority)
    except TypeError:
        value = None
    if value is None or not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise InvalidArgumentError(f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority!r}")
    return value


def check_retention_s(retention_s: float | None) -> float | None:
    """``retention_s`` as a ``float`` if it is a real number of seconds ``>= 0`` (``inf`` too: for good; not NaN).

    ``None`` (no retention) stays ``None``.

    Raises:
        InvalidArgumentError: otherwise (also on a string).
    """
    if retention_s is None:
        return None
    try:
        seconds = float(retention_s) if not isinstance(retention_s, (str, bytes, bytearray)) else math.nan
    except (TypeError, ValueError, OverflowError):
        seconds = math.nan
    if not seconds >= 0:  # also NaN; inf is kept for good
        raise InvalidArgumentError(f"retention_s must be a number of seconds >= 0, got {retention_s!r}")
    return seconds


MAX_SESSION_ID_BYTES = 256
"""The longest session id taken, UTF-8 bytes (vLLM's and SGLang's ids are UUIDs or short names)."""


def check_ttl_s(ttl_s: float | None) -> float:
    """A cache-control TTL as a ``float`` of seconds: a finite number ``>= 0``; ``None`` and 0 mean none (0.0).

    Raises:
        InvalidArgumentError: otherwise (also on a string, NaN or infinity).
    """
    if ttl_s is None:
        return 0.0
    try:
        seconds = float(ttl_s) if not isinstance(ttl_s, (str, bytes, bytearray, bool)) else math.nan
    except (TypeError, ValueError, OverflowError):
        seconds = math.nan
    if not 0 <= seconds < math.inf:
        raise InvalidArgumentError(f"ttl_s must be a finite number of seconds >= 0, got {ttl_s!r}")
    return seconds


def check_session_id(session_id: str | None) -> str:
    """A session id as a ``str`` (``""`` for none): at most :data:`MAX_SESSION_ID_BYTES` UTF-8 bytes.

    Raises:
        InvalidArgumentError: on a non-string or an id over the limit.
    """
    if session_id is None:
        return ""
    if not isinstance(session_id, str):
        raise InvalidArgumentError(f"session_id must be a string, got {type(session_id).__name__}")
    if len(session_id) > MAX_SESSION_ID_BYTES or len(session_id.encode("utf-8")) > MAX_SESSION_ID_BYTES:
        raise InvalidArgumentError(f"session_id is over {MAX_SESSION_ID_BYTES} bytes")
    return session_id


def check_block(namespace: Namespace, position: int, block: object, max_block_bytes: int) -> BlockHeader:
    """Check one encoded block of a put: bytes-like, within ``max_block_bytes``, intact, of the namespace, and (a
    lossy block) with its scales in range (``kvstore.blocks.encoding.scales``: finite, non-negative, never decoding
    beyond the dtype).

    Args:
        namespace: the put's namespace.
        position: the block's index in the put, for the message.
        block: the encoded block (:mod:`kvstore.blocks.tensors`).
        max_block_bytes: the largest block accepted, bytes (``store.max_block_bytes``).

    Returns:
        Its decoded header.

    Raises:
        InvalidArgumentError: on a block that is not bytes-like, or whose header contradicts the namespace.
        ResourceExhaustedError: on a block over ``max_block_bytes``.
        CodecError: on a malformed or corrupt block, naming the position and the cause
            (:class:`~kvstore.errors.BadScalesError`: a scales field out of range, named).
    """
    if not isinstance(block, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError(f"block {position}: expected encoded bytes, got {type(block).__name__}")
    if len(block) > max_block_bytes:
        raise ResourceExhaustedError(f"block {position}: {len(block)} bytes is over max_block_bytes={max_block_bytes}")
    try:
        header = verify_block(block)
    except CodecError as exc:
        raise type(exc)(f"block {position}: {exc}") from None
    mismatch = namespace_mismatch(namespace, header)
    if mismatch:
        raise InvalidArgumentError(f"block {position}: {mismatch}")
    if header.encoding:
        _check_scales(position, header, block)
    return header


def _check_scales(position: int, header: BlockHeader, block: bytes | bytearray | memoryview) -> None:
    try:
        check_scales(header, block)
    except CodecError as exc:
        raise type(exc)(f"block {position}: {exc}") from None


class BlockChecker:
    """Checks the blocks of one put one at a time, as :func:`check_block` does, parsing a header only where it
    differs from the last one parsed (``kvstore.blocks.tensors.LikeBlocks``): a batch of one dtype and shape parses one.

    Args:
        namespace: the put's namespace.
        max_block_bytes: the largest block accepted, bytes (``store.max_block_bytes``).
    """

    __slots__ = ("namespace", "max_block_bytes", "_like", "_tensor_header")

    def __init__(self, namespace: Namespace, max_block_bytes: int) -> None:
        self.namespace = namespace
        self.max_block_bytes = max_block_bytes
        self._like: LikeBlocks | None = None
        self._tensor_header: BlockHeader | None = None

    def check(self, position: int, block: object) -> None:
        """Check block ``position`` of the put; a :class:`~kvstore.blocks.copying.TensorBlock` (a tensor the store
        encodes where it stores it) by its length and its header against the namespace.

        Raises:
            InvalidArgumentError, ResourceExhaustedError, CodecError: as :func:`check_block`.
        """
        if type(block) is TensorBlock:
            self._check_tensor(position, block)
            return
        like = self._like
        if like is not None and isinstance(block, (bytes, bytearray, memoryview)):
            try:
                verified = like.verify(block)  # its length and header are the checked block's: the checksum left
            except CodecError as exc:
                raise type(exc)(f"block {position}: {exc}") from None
            if verified:
                if like.header.encoding:  # and its own scales (the header is shared, the scales are not)
                    _check_scales(position, like.header, block)
                return
        header = check_block(self.namespace, position, block, self.max_block_bytes)
        assert isinstance(block, (bytes, bytearray, memoryview))  # check_block refuses any other
        self._like = LikeBlocks(header, block)

    def _check_tensor(self, position: int, block: TensorBlock) -> None:
        if len(block) > self.max_block_bytes:
            raise ResourceExhaustedError(f"block {position}: {len(block)} bytes is over "
                                         f"max_block_bytes={self.max_block_bytes}")
        if block.header is not self._tensor_header:  # the blocks of one batch share one header
            mismatch = namespace_mismatch(self.namespace, block.header)
            if mismatch:
                raise InvalidArgumentError(f"block {position}: {mismatch}")
            self._tensor_header = block.header


class CheckedBlocks(list[Buffer]):
    """A put's blocks that a :class:`BlockChecker` of ``namespace`` checked one by one as they were made: the
    node's own copies, which no other process can write (views of ranges of the shared pool, sealed against
    every writer but the node, or of memory of the node's own), so checking them again would find the same,
    and the store takes them as they are, with no copy of its own.

    The same-host Put checks each copy right after copying it out of the client's segment, while it is in
    cache (``kvstore.shm.node.plane.SharedMemoryNode.copy_in``); the store's admission then skips the blocks
    (:func:`check_blocks`).

    Args:
        blocks: the checked blocks, in put order.
        checker: the checker that checked them.
    """

    def __init__(self, blocks: Sequence[Buffer], checker: BlockChecker) -> None:
        super().__init__(blocks)
        self.namespace = checker.namespace
        self.max_block_bytes = checker.max_block_bytes


def check_blocks(namespace: Namespace, blocks: Sequence[object], max_block_bytes: int) -> None:
    """Check every encoded block of a put as :func:`check_block` does (a :class:`BlockChecker`), but for
    :class:`CheckedBlocks` of ``namespace`` checked within ``max_block_bytes``: those were checked already.

    Raises:
        InvalidArgumentError, ResourceExhaustedError, CodecError: as :func:`check_block`, for the first bad block.
    """
    if (type(blocks) is CheckedBlocks and blocks.namespace == namespace
            and blocks.max_block_bytes <= max_block_bytes):
        return
    checker = BlockChecker(namespace, max_block_bytes)
    for position, block in enumerate(blocks):
        checker.check(position, block)


def namespace_mismatch(namespace: Namespace, header: BlockHeader) -> str:
    """How a block's header contradicts its namespace (dtype, layout, tokens per block); ``""`` if it does not."""
    if block_mismatch(header, namespace.dtype, layout=namespace.layout):
        return (f"{header.dtype}/{header.layout.value} does not match the namespace's "
                f"{namespace.dtype}/{namespace.layout}")
    if header.encoding != namespace.kv_encoding:  # exact and lossy blocks never mix (docs/encodings.md)
        return f"KV encoding {header.encoding or 'none'!r} is not the namespace's {namespace.kv_encoding or 'none'!r}"
    tokens = header.shape[3] if header.layout is Layout.KV else header.shape[2]
    if tokens != namespace.block_size:
        return f"holds {tokens} tokens, the namespace's block size is {namespace.block_size}"
    return ""


def fits_namespace(namespace: Namespace, key: BlockKey, block: Buffer, tier_name: str) -> bool:
    """Whether a block read from a tier that outlives this process (disk, Redis) has the namespace's dtype,
    layout and block size, and (a lossy block) its scales in range; a block that does not is logged (a
    warning), for the store to count as a miss.

    Such a tier verifies only the block's checksum, and Redis is shared with
    other nodes (maybe of another version) and anything that can reach it: a
    block a put would have refused here is a miss, never served.
    """
    try:
        header = decode_header(block)
        mismatch = namespace_mismatch(namespace, header)
        if not mismatch and header.encoding:
            check_scales(header, block)  # a block written before scales were checked, or into Redis by anyone
    except CodecError as exc:
        mismatch = str(exc)
    if mismatch:
        logger.warning("tier %s: block %s does not fit its namespace (%s); a miss", tier_name, key.hex(), mismatch)
    return not mismatch


def check_seconds(name: str, value: float, *, minimum_s: float = 0.0, open_minimum: bool = False,
                  maximum_s: float = math.inf) -> float:
    """``value`` as a float if it is a finite number of seconds in ``[minimum_s, maximum_s]``.

    Args:
        name: the argument's name, for the error message.
        value: the argument.
        minimum_s: least value, seconds.
        open_minimum: ``minimum_s`` itself is out of range (``> minimum_s``).
        maximum_s: greatest value, seconds.

    Raises:
        InvalidArgumentError: otherwise (also on a ``bool`` or a string), naming the argument.
    """
    try:
        seconds = math.nan if isinstance(value, (bool, str, bytes)) else float(value)
    except (TypeError, ValueError, OverflowError):
        seconds = math.nan
    above = seconds > minimum_s if open_minimum else seconds >= minimum_s
    if not (math.isfinite(seconds) and above and seconds <= maximum_s):
        bound = f"{'>' if open_minimum else '>='} {minimum_s:g}" + (
            f" and <= {maximum_s:g}" if math.isfinite(maximum_s) else "")
        raise InvalidArgumentError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    return seconds


def check_count(name: str, value: int, minimum: int) -> int:
    """``value`` as an ``int`` if it is an integer (not ``bool``) ``>= minimum``.

    Raises:
        InvalidArgumentError: otherwise, naming the argument ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)
