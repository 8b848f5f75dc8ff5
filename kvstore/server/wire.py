"""Conversions between kvstore's domain objects and the ``kvstore.v1`` wire messages, and block chunking.

Shared by the server and the clients, so both sides agree on one definition of
the wire. Blocks move as encoded codec bytes split into chunks of at most
:func:`chunk_bytes_for` bytes, so that no gRPC message exceeds
``max_message_bytes``; a receiver reassembles them with :class:`BlockAssembler`.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from kvstore.api import LookupResult, StoreStats, TierStats
from kvstore.codec import Layout, dtype_name
from kvstore.errors import InvalidArgumentError, ResourceExhaustedError
from kvstore.keys import HashAlgorithm, Namespace
from kvstore.v1 import kvstore_pb2 as pb

MESSAGE_OVERHEAD_BYTES = 4096
"""Room left in every data message for its other fields (namespace, hash, offsets), bytes."""


def chunk_bytes_for(max_message_bytes: int) -> int:
    """The largest block chunk that fits a message of ``max_message_bytes`` with its other fields, bytes."""
    return max(1, max_message_bytes - MESSAGE_OVERHEAD_BYTES)


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC options shared by the server and the clients: both message-size limits.

    Args:
        max_message_bytes: largest message sent or received, bytes.
    """
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def namespace_to_pb(namespace: Namespace) -> pb.Namespace:
    """The wire message of ``namespace``; every field is set explicitly."""
    return pb.Namespace(
        model=namespace.model,
        revision=namespace.revision,
        dtype=namespace.dtype,
        layout=namespace.layout,
        block_size=namespace.block_size,
        tp_size=namespace.tp_size,
        tp_rank=namespace.tp_rank,
        adapter=namespace.adapter,
        cache_salt=namespace.cache_salt,
        hash_algorithm=HashAlgorithm(namespace.hash_algorithm).value,
    )


def namespace_from_pb(message: pb.Namespace) -> Namespace:
    """Rebuild and validate a :class:`~kvstore.keys.Namespace` from its wire message.

    The wire has no defaults: a missing field arrives as ``""`` or ``0`` and is
    rejected where that value is invalid (model, dtype, layout, block_size,
    tp_size, hash_algorithm).

    Raises:
        InvalidArgumentError: on an empty model, a bad block size or rank, an
            unknown dtype (``UnknownDtypeError``), layout or hash algorithm.
    """
    try:
        algorithm = HashAlgorithm(message.hash_algorithm)
    except ValueError:
        raise InvalidArgumentError(
            f"namespace.hash_algorithm must be one of {[a.value for a in HashAlgorithm]}, "
            f"got {message.hash_algorithm!r}"
        ) from None
    try:
        layout = Layout(message.layout).value
    except ValueError:
        raise InvalidArgumentError(
            f"namespace.layout must be one of {[l.value for l in Layout]}, got {message.layout!r}"
        ) from None
    return Namespace(
        model=message.model,
        revision=message.revision,
        dtype=dtype_name(message.dtype),
        layout=layout,
        block_size=message.block_size,
        tp_size=message.tp_size,
        tp_rank=message.tp_rank,
        adapter=message.adapter,
        cache_salt=message.cache_salt,
        hash_algorithm=algorithm,
    )


def lookup_to_pb(result: LookupResult) -> pb.LookupResponse:
    """The wire reply of a lookup."""
    return pb.LookupResponse(num_blocks=result.num_blocks, tiers=result.tiers)


def lookup_from_pb(message: pb.LookupResponse) -> LookupResult:
    """A :class:`LookupResult` from its wire reply."""
    return LookupResult(message.num_blocks, tuple(message.tiers))


def stats_to_pb(stats: StoreStats) -> pb.StatsResponse:
    """The wire reply of the store's stats."""
    return pb.StatsResponse(
        tiers=[
            pb.TierStats(
                name=t.name, blocks=t.blocks, bytes=t.bytes, capacity_bytes=t.capacity_bytes, hits=t.hits,
                misses=t.misses, evictions=t.evictions, demotions=t.demotions, promotions=t.promotions,
                corrupt_records=t.corrupt_records, counters=t.counters,
            )
            for t in stats.tiers
        ]
    )


def stats_from_pb(message: pb.StatsResponse) -> StoreStats:
    """A :class:`StoreStats` from its wire reply."""
    return StoreStats(
        tuple(
            TierStats(
                name=t.name, blocks=t.blocks, bytes=t.bytes, capacity_bytes=t.capacity_bytes, hits=t.hits,
                misses=t.misses, evictions=t.evictions, demotions=t.demotions, promotions=t.promotions,
                corrupt_records=t.corrupt_records, counters=dict(t.counters),
            )
            for t in message.tiers
        )
    )


def iter_chunks(block: bytes, chunk_bytes: int) -> Iterator[tuple[int, bytes, bool]]:
    """Split one encoded block into ``(offset, data, last)`` chunks of at most ``chunk_bytes`` bytes.

    A block that fits one chunk is yielded as is, without a copy; an empty
    block is one empty chunk.
    """
    total = len(block)
    if total <= chunk_bytes:
        yield 0, block, True
        return
    for offset in range(0, total, chunk_bytes):
        end = min(offset + chunk_bytes, total)
        yield offset, block[offset:end], end == total


def put_requests(
    namespace: Namespace,
    block_hashes: Sequence[bytes],
    blocks: Sequence[bytes],
    chunk_bytes: int,
    *,
    priority: int | None = None,
    retention_s: float | None = None,
) -> Iterator[pb.PutRequest]:
    """The client-streaming messages of one Put, lazily: namespace first, then every block's chunks.

    Args:
        namespace: namespace of every block.
        block_hashes: one hash per block.
        blocks: encoded blocks, ``len == len(block_hashes)``.
        chunk_bytes: largest data field of one message, bytes.
        priority: retention priority, or ``None`` for the server's default.
        retention_s: seconds the priority holds, or ``None``.
    """
    first = True
    for index, (block_hash, block) in enumerate(zip(block_hashes, blocks)):
        for offset, data, _ in iter_chunks(block, chunk_bytes):
            message = pb.PutRequest(block_index=index, offset=offset, data=data)
            if offset == 0:
                message.block_hash = bytes(block_hash)
                message.total_bytes = len(block)
            if first:
                message.namespace.CopyFrom(namespace_to_pb(namespace))
                if priority is not None:
                    message.priority = priority
                if retention_s is not None:
                    message.retention_s = retention_s
                first = False
            yield message


class BlockAssembler:
    """Reassembles blocks from in-order chunks and checks that the stream is whole.

    Used by the server for Put streams and by the clients for Get streams.
    Chunks of one block are kept as a list and joined once at the end (one
    copy, and none for a block that arrived as a single chunk), so the result
    is immutable ``bytes`` that the store keeps without copying again.

    Args:
        max_block_bytes: largest block accepted, bytes; a larger ``total_bytes``
            is refused before anything of it is buffered.
        max_blocks: most blocks one stream may carry.
    """

    def __init__(self, max_block_bytes: int, max_blocks: int) -> None:
        self.max_block_bytes = max_block_bytes
        self.max_blocks = max_blocks
        self.blocks: list[bytes] = []
        self._parts: list[bytes] = []
        self._received = 0
        self._total = -1  # no block open

    @property
    def num_buffered_bytes(self) -> int:
        """Bytes buffered so far, in finished blocks and the open one."""
        return sum(len(b) for b in self.blocks) + self._received

    def begin(self, block_index: int, total_bytes: int) -> None:
        """Open block ``block_index`` of ``total_bytes`` bytes.

        Raises:
            InvalidArgumentError: if the previous block is incomplete, the index
                is not the next one, or there are more than ``max_blocks`` blocks.
            ResourceExhaustedError: if ``total_bytes > max_block_bytes``.
        """
        self._close_open_block()
        if block_index != len(self.blocks):
            raise InvalidArgumentError(f"block {block_index} arrived where block {len(self.blocks)} was expected")
        if block_index >= self.max_blocks:
            raise InvalidArgumentError(
                f"more than max_hashes_per_request={self.max_blocks} blocks in one request"
            )
        if total_bytes > self.max_block_bytes:
            raise ResourceExhaustedError(
                f"block {block_index}: {total_bytes} bytes is over max_block_bytes={self.max_block_bytes}"
            )
        self._total = total_bytes
        self._received = 0
        self._parts = []

    def add(self, block_index: int, offset: int, data: bytes) -> None:
        """Append one chunk of the open block.

        Raises:
            InvalidArgumentError: if no block is open, the chunk belongs to another
                block, its offset is not where the previous one ended, or it runs
                past the block's ``total_bytes``.
        """
        if self._total < 0 or block_index != len(self.blocks):
            raise InvalidArgumentError(f"chunk of block {block_index} arrived before that block's first chunk")
        if offset != self._received:
            raise InvalidArgumentError(
                f"block {block_index}: chunk at offset {offset}, expected offset {self._received}"
            )
        if self._received + len(data) > self._total:
            raise InvalidArgumentError(
                f"block {block_index}: chunks run past its total_bytes={self._total}"
            )
        self._parts.append(data)
        self._received += len(data)

    @property
    def block_complete(self) -> bool:
        """Whether the open block has received all of its bytes."""
        return self._total >= 0 and self._received == self._total

    def finish(self) -> list[bytes]:
        """Close the stream and return every block, in order.

        Raises:
            InvalidArgumentError: if the last block is incomplete (a truncated block).
        """
        self._close_open_block()
        return self.blocks

    def _close_open_block(self) -> None:
        if self._total < 0:
            return
        if self._received != self._total:
            raise InvalidArgumentError(
                f"block {len(self.blocks)} is truncated: {self._received} of {self._total} bytes arrived"
            )
        parts = self._parts
        self.blocks.append(parts[0] if len(parts) == 1 else b"".join(parts))
        self._parts = []
        self._total = -1
        self._received = 0
