"""Blocks in chunks: splitting, the ``BlockChunk`` and ``PutRequest`` messages that carry them, and reassembly."""

from __future__ import annotations

from typing import Iterator, NamedTuple, Sequence

from kvstore.errors import InvalidArgumentError, ResourceExhaustedError
from kvstore.keys import Namespace
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.messages import cached_namespace_pb
from kvstore.wire.protobuf import (
    encode_varint,
    encode_with_data,
    field_tag,
    iter_fields,
    parse_request,
    split_data_field,
)

_CHUNK_DATA_FIELD = pb.BlockChunk.DESCRIPTOR.fields_by_name["data"].number
_PUT_DATA_FIELD = pb.PutRequest.DESCRIPTOR.fields_by_name["data"].number


def iter_chunks(block: bytes | memoryview, chunk_bytes: int) -> Iterator[tuple[int, bytes | memoryview, bool]]:
    """Split one encoded block into ``(offset, data, last)`` chunks of at most ``chunk_bytes`` bytes.

    A block that fits one chunk is yielded as is; otherwise chunks are slices
    of ``block`` (views, without a copy, when ``block`` is a ``memoryview``).
    An empty block is one empty chunk.
    """
    total = len(block)
    if total <= chunk_bytes:
        yield 0, block, True
        return
    for offset in range(0, total, chunk_bytes):
        end = min(offset + chunk_bytes, total)
        yield offset, block[offset:end], end == total


class Chunk(NamedTuple):
    """A received ``PutRequest``: its other fields parsed by protobuf, its ``data`` as a view.

    Attributes:
        message: the ``PutRequest`` without its ``data`` field.
        data: the block bytes it carried, a view of the received message.
    """

    message: pb.PutRequest
    data: memoryview


class ChunkHead(NamedTuple):
    """The small fields of a received ``BlockChunk`` (see the ``.proto``)."""

    offset: int
    total_bytes: int
    last: bool


_BLOCK_CHUNK = pb.BlockChunk.DESCRIPTOR.fields_by_name
_CHUNK_OFFSET, _CHUNK_TOTAL, _CHUNK_LAST = (_BLOCK_CHUNK[name].number for name in ("offset", "total_bytes", "last"))
_CHUNK_OFFSET_TAG, _CHUNK_TOTAL_TAG, _CHUNK_LAST_TAG = (
    field_tag(number, 0) for number in (_CHUNK_OFFSET, _CHUNK_TOTAL, _CHUNK_LAST)
)
_CHUNK_DATA_TAG = field_tag(_CHUNK_DATA_FIELD, 2)
_UINT64_MASK = (1 << 64) - 1
_TOTAL_TAG_BYTE = _CHUNK_TOTAL_TAG[0]
_LAST_THEN_DATA = _CHUNK_LAST_TAG + b"\x01" + _CHUNK_DATA_TAG


def encode_block_chunk(offset: int, total_bytes: int, data: bytes | memoryview, last: bool) -> bytes:
    """A serialized ``BlockChunk`` (the Get reply message) carrying ``data``, copied once.

    Written by hand rather than through protobuf: this runs for every chunk of
    every Get, and the fields are three integers. Zero-valued fields are left
    out, as proto3 serializers do. A whole block in one chunk is
    ``reply_head(len(data)) + data`` (:func:`reply_head`).
    """
    parts: list[bytes | memoryview] = []
    if offset:
        parts += (_CHUNK_OFFSET_TAG, encode_varint(offset))
    if total_bytes:
        parts += (_CHUNK_TOTAL_TAG, encode_varint(total_bytes))
    if last:
        parts += (_CHUNK_LAST_TAG, b"\x01")
    parts += (_CHUNK_DATA_TAG, encode_varint(len(data)), data)
    return b"".join(parts)


def reply_head(nbytes: int, chunk_bytes: int) -> bytes | None:
    """The bytes before a block of ``nbytes`` in the one ``BlockChunk`` that carries all of it; ``None`` if it needs more.

    ``reply_head(n, c) + block`` is exactly ``encode_block_chunk(0, n, block, True)``,
    so a tier that stores each block behind its head (the heap tier,
    ``kvstore.tiers.heap``) holds a ready Get reply, and the node sends it with
    no copy of its own. A block over ``chunk_bytes`` goes out in several chunks.

    Args:
        nbytes: the encoded block's length, bytes.
        chunk_bytes: the node's chunk size (:func:`chunk_bytes_for`), bytes.
    """
    if nbytes > chunk_bytes:
        return None
    return _one_chunk_head(nbytes)


def _one_chunk_head(nbytes: int) -> bytes:
    """:func:`reply_head` of a block of ``nbytes`` that fits its chunk."""
    total = _CHUNK_TOTAL_TAG + encode_varint(nbytes) if nbytes else b""
    return b"".join((total, _CHUNK_LAST_TAG, b"\x01", _CHUNK_DATA_TAG, encode_varint(nbytes)))


_READY_HEADS: dict[int, tuple[int, bytes]] = {}
"""Message length -> ``(block length, head)`` of a one-chunk reply of that length, as :func:`reply_head` writes it."""


def _ready_reply(message: bytes | memoryview) -> tuple[int, int] | None:
    """``(total_bytes, data start)`` of a message laid out as :func:`reply_head` writes it; ``None`` for any other.

    Such a message of ``L`` bytes carries exactly one block length ``n`` (``L``
    grows with ``n``), so its head is known from ``L`` alone, and blocks of one
    namespace share their length: the check is a dict lookup and a prefix compare.
    """
    size = len(message)
    known = _READY_HEADS.get(size)
    if known is None:
        for width in range(1, 11):  # the varint width of n, which the head holds twice
            nbytes = size - 4 - 2 * width
            if nbytes > 0 and len(encode_varint(nbytes)) == width:
                break
        else:
            return None
        if len(_READY_HEADS) >= 1024:
            _READY_HEADS.clear()
        known = _READY_HEADS[size] = (nbytes, _one_chunk_head(nbytes))
    nbytes, head = known
    if type(message) is bytes:
        found = message.startswith(head)
    else:  # another bytes-like object, e.g. a memoryview
        found = memoryview(message)[:len(head)] == head
    return (nbytes, len(head)) if found else None


def decode_block_chunk(message: bytes | memoryview) -> tuple[ChunkHead, memoryview]:
    """Parse a serialized ``BlockChunk``: its small fields, and its data as a view of ``message``.

    Follows protobuf's rules: fields in any order, the last occurrence wins,
    unknown fields (or a known number with another wire type) are skipped.

    Raises:
        InvalidArgumentError: on malformed protobuf.
    """
    view = memoryview(message)
    ready = _ready_reply(message)
    if ready:  # the shape of a whole block in one message, as reply_head writes it: read at fixed places
        total, start = ready
        return ChunkHead(0, total, True), view[start:]
    offset = total_bytes = last = 0
    data = view[0:0]
    for number, _, _, value in iter_fields(view):
        if isinstance(value, memoryview):
            if number == _CHUNK_DATA_FIELD:
                data = value
        elif value is None:
            continue
        elif number == _CHUNK_OFFSET:
            offset = value & _UINT64_MASK
        elif number == _CHUNK_TOTAL:
            total_bytes = value & _UINT64_MASK
        elif number == _CHUNK_LAST:
            last = value
    return ChunkHead(offset, total_bytes, bool(last)), data


def decode_put_request(message: bytes) -> Chunk:
    """Parse a serialized ``PutRequest``; the data stays in ``message``.

    Raises:
        InvalidArgumentError: on malformed protobuf.
    """
    rest, data = split_data_field(message, _PUT_DATA_FIELD)
    return Chunk(parse_request(pb.PutRequest, rest), data)


def iter_block_chunks(blocks: Sequence[bytes | memoryview], chunk_bytes: int,
                      framed: Sequence[bytes | None] | None = None) -> Iterator[bytes]:
    """Serialized ``BlockChunk`` messages of a Get reply: every block's chunks, in order.

    Args:
        blocks: the encoded blocks, in prefix order.
        chunk_bytes: the largest ``data`` of one message, bytes (:func:`chunk_bytes_for`).
        framed: per block, its whole reply message when a tier holds it framed so
            (``reply_head(len(block), chunk_bytes) + block``, see
            :attr:`kvstore.tiers.base.TierLoan.framed`), sent as is; ``None``
            (or a ``None`` entry) to encode that block here, one copy.
    """
    for index, block in enumerate(blocks):
        reply = framed[index] if framed is not None else None
        if reply is not None:
            yield reply
            continue
        total = len(block)
        view = memoryview(block) if total > chunk_bytes else block
        for offset, data, last in iter_chunks(view, chunk_bytes):
            yield encode_block_chunk(offset, total, data, last)


def put_requests(
    namespace: Namespace,
    block_hashes: Sequence[bytes],
    blocks: Sequence[bytes],
    chunk_bytes: int,
    *,
    priority: int | None = None,
    retention_s: float | None = None,
    session_id: str = "",
    ttl_s: float = 0.0,
) -> Iterator[bytes]:
    """The serialized client-streaming messages of one Put, lazily: namespace first, then every block's chunks.

    Args:
        namespace: namespace of every block.
        block_hashes: one hash per block.
        blocks: encoded blocks, ``len == len(block_hashes)``.
        chunk_bytes: largest data field of one message, bytes.
        priority: retention priority, or ``None`` for the server's default.
        retention_s: seconds the priority holds, or ``None``.
        session_id: the blocks' agentic session (``""``: none; ``docs/agentic.md``).
        ttl_s: their TTL, seconds (0.0: none).

    Yields:
        ``PutRequest`` messages, serialized (send them with :func:`identity`).
    """
    first = True
    for index, (block_hash, block) in enumerate(zip(block_hashes, blocks)):
        view = memoryview(block) if len(block) > chunk_bytes else block
        for offset, data, _ in iter_chunks(view, chunk_bytes):
            head = pb.PutRequest(block_index=index, offset=offset)
            if offset == 0:
                head.block_hash = bytes(block_hash)
                head.total_bytes = len(block)
            if first:
                head.namespace.CopyFrom(cached_namespace_pb(namespace))
                if priority is not None:
                    head.priority = priority
                if retention_s is not None:
                    head.retention_s = retention_s
                if session_id:
                    head.agent_session_id = session_id
                if ttl_s:
                    head.ttl_s = ttl_s
                first = False
            yield encode_with_data(head.SerializeToString(), _PUT_DATA_FIELD, data)


class BlockAssembler:
    """Reassembles blocks from in-order chunks and checks that the stream is whole.

    Used by the server for Put streams and by the clients for Get streams.
    Chunks of one block (views of the received messages) are kept as a list
    and joined once when the block is complete: one copy, whose result is
    immutable ``bytes`` that the store keeps without copying again (the store
    would copy a ``bytearray``, so preallocating one would cost a second copy).

    With ``copy=False`` a block that arrived in one chunk is kept as the
    ``memoryview`` of its message that it is, with no copy at all (the client's
    Get: a 2 MiB copy costs about a tenth of the call).

    Args:
        max_block_bytes: largest block accepted, bytes; a larger ``total_bytes``
            is refused before anything of it is buffered.
        max_blocks: most blocks one stream may carry.
        max_total_bytes: most bytes of all blocks one stream may carry; ``None`` for no limit.
        copy: make every block ``bytes``; ``False`` keeps one-chunk blocks as views.
    """

    __slots__ = ("max_block_bytes", "max_blocks", "max_total_bytes", "copy", "_declared", "blocks", "_parts",
                 "_received", "_total")

    def __init__(self, max_block_bytes: int, max_blocks: int, max_total_bytes: int | None = None,
                 *, copy: bool = True) -> None:
        self.max_block_bytes = max_block_bytes
        self.max_blocks = max_blocks
        self.max_total_bytes = max_total_bytes
        self.copy = copy
        self._declared = 0  # sum of total_bytes of the blocks begun so far
        self.blocks: list[bytes | memoryview] = []
        self._parts: list[bytes | memoryview] = []
        self._received = 0
        self._total = -1  # no block open

    def begin(self, block_index: int, total_bytes: int) -> None:
        """Open block ``block_index`` of ``total_bytes`` bytes.

        Raises:
            InvalidArgumentError: if the previous block is incomplete, the index
                is not the next one, or there are more than ``max_blocks`` blocks.
            ResourceExhaustedError: if ``total_bytes > max_block_bytes``, or the stream's
                blocks add up to more than ``max_total_bytes``.
        """
        self._close_open_block()
        self._admit(block_index, total_bytes)
        self._total = total_bytes
        self._received = 0
        self._parts = []

    def _admit(self, block_index: int, total_bytes: int) -> None:
        """Check that block ``block_index`` of ``total_bytes`` bytes may come next, and count its bytes (see :meth:`begin`)."""
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
        if self.max_total_bytes is not None and self._declared + total_bytes > self.max_total_bytes:
            raise ResourceExhaustedError(
                f"block {block_index}: the Put would carry over max_put_bytes={self.max_total_bytes} bytes; "
                "split it into several Puts"
            )
        self._declared += total_bytes

    def add(self, block_index: int, offset: int, data: bytes | memoryview) -> None:
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

    def add_reply_chunk(self, head: ChunkHead, data: bytes | memoryview) -> None:
        """Append one chunk of a Get reply, where a chunk at offset 0 begins the next block.

        A Get streams its blocks in request order (the ``BlockChunk`` of the
        ``.proto`` carries no block index).

        Raises:
            InvalidArgumentError: as :meth:`begin` and :meth:`add`.
            ResourceExhaustedError: as :meth:`begin`.
        """
        if head.offset == 0:
            self.begin(len(self.blocks) + (self._total >= 0), head.total_bytes)
        self.add(len(self.blocks), head.offset, data)

    def add_reply(self, message: bytes | memoryview) -> None:
        """Append one serialized ``BlockChunk`` of a Get reply: :meth:`add_reply_chunk` of the decoded message.

        The usual reply, a whole block in one message laid out as
        :func:`reply_head` writes it, is taken in one step: its block is a view
        of ``message`` (a copy with ``copy=True``), with no chunk to track. An
        empty message carries nothing (the reply of a Get that found no block)
        and is skipped.

        Raises:
            InvalidArgumentError: on malformed protobuf; as :meth:`begin` and :meth:`add`.
            ResourceExhaustedError: as :meth:`begin`.
        """
        if not message:
            return
        if self._total < 0:  # no block open: the message may hold the next one whole
            ready = _ready_reply(message)
            if ready is not None:
                total, start = ready
                self._admit(len(self.blocks), total)
                block = memoryview(message)[start:]
                self.blocks.append(block.tobytes() if self.copy else block)
                return
        self.add_reply_chunk(*decode_block_chunk(message))

    def finish(self) -> list[bytes | memoryview]:
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
        if len(parts) == 1:
            block = parts[0]
            if self.copy and isinstance(block, memoryview):
                block = block.tobytes()
        else:
            block = b"".join(parts)
        self.blocks.append(block)
        self._parts = []
        self._total = -1
        self._received = 0
