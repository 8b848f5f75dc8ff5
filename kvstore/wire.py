"""Conversions between kvstore's domain objects and the ``kvstore.v1`` wire messages, and block chunking.

Shared by the server and the clients, so both sides agree on one definition of
the wire. Blocks move as encoded codec bytes split into chunks of at most
:func:`chunk_bytes_for` bytes, so that no gRPC message exceeds
``max_message_bytes``; a receiver reassembles them with :class:`BlockAssembler`.

The data path. The two messages that carry block bytes (``BlockChunk`` of Get,
``PutRequest`` of Put) are written and read here without copying the bytes
through protobuf: a sender serializes the small fields and appends the ``data``
field itself, one copy in all; a receiver walks the top-level fields and keeps
``data`` as a ``memoryview`` of the received message. Get's messages, sent once
per call or per chunk, are coded by hand end to end (:func:`encode_block_chunk`,
:func:`decode_block_chunk`, and :func:`encode_get_request` up to 32 hashes), and so is the
usual shape of every request that carries hashes (:func:`decode_hash_request`); Put's small fields go
through protobuf (:func:`encode_with_data`, :func:`split_data_field`). All are
plain protobuf on the wire (fields may come in any order), so any other
protobuf client interoperates. :data:`GET_METHOD` and :data:`PUT_METHOD` name
the methods that use them.
"""

from __future__ import annotations

import functools
from typing import Iterator, NamedTuple, Sequence, TypeVar

import grpc
import grpc.experimental
import numpy as np

from google.protobuf.message import Message

from kvstore.api import LookupResult, StoreStats, TierStats
from kvstore.codec import Layout, dtype_name
from kvstore.errors import InvalidArgumentError, ResourceExhaustedError
from kvstore.status import RemoteError
from kvstore.keys import NAMESPACE_FIELD_MAX_BYTES, HashAlgorithm, Namespace, PackedHashes
from kvstore.v1 import kvstore_pb2 as pb

GET_METHOD = "/kvstore.v1.KVStore/Get"
PUT_METHOD = "/kvstore.v1.KVStore/Put"
_CHUNK_DATA_FIELD = pb.BlockChunk.DESCRIPTOR.fields_by_name["data"].number
_PUT_DATA_FIELD = pb.PutRequest.DESCRIPTOR.fields_by_name["data"].number

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


def sync_client_channel_options(max_message_bytes: int) -> list[tuple[str, int | str]]:
    """Options of a synchronous client channel: :func:`channel_options` plus single-threaded streams.

    ``grpc.experimental.ChannelOptions.SingleThreadedUnaryStream`` makes a
    unary-stream call (Get) read its replies on the calling thread; without it
    gRPC's synchronous channel starts a helper thread per call, about 0.2 ms on
    this machine class (``benchmarks/bench_service.py``). The option is
    experimental in grpcio and ignored by ``grpc.aio`` channels.

    Args:
        max_message_bytes: largest message sent or received, bytes.
    """
    return [*channel_options(max_message_bytes), (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]


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
        kv_encoding=namespace.kv_encoding,
    )


MAX_NAMESPACE_WIRE_BYTES = sum(NAMESPACE_FIELD_MAX_BYTES.values()) + 64
"""The longest serialized ``Namespace`` a node parses, bytes: every text field at its limit
(:data:`kvstore.keys.NAMESPACE_FIELD_MAX_BYTES`) plus each field's tag and length, and the three integers."""


def namespace_from_pb(message: pb.Namespace) -> Namespace:
    """Rebuild and validate a :class:`~kvstore.keys.Namespace` from its wire message.

    The wire has no defaults: a missing field arrives as ``""`` or ``0`` and is
    rejected where that value is invalid (model, dtype, layout, block_size,
    tp_size, hash_algorithm).

    Raises:
        InvalidArgumentError: on an empty model, a text field over its limit
            (:data:`kvstore.keys.NAMESPACE_FIELD_MAX_BYTES`), a bad block size or rank, an
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
        kv_encoding=message.kv_encoding,
    )


def lookup_to_pb(block_tiers: bytes, tier_names: Sequence[str]) -> pb.LookupResponse:
    """The wire reply of a lookup.

    Args:
        block_tiers: one byte per block of the cached prefix, its tier's index
            in ``tier_names`` (``TieredStore.locate``).
        tier_names: the node's tiers, fastest first.
    """
    return pb.LookupResponse(num_blocks=len(block_tiers), tier_names=tier_names, block_tiers=block_tiers)


def lookup_from_pb(message: pb.LookupResponse) -> LookupResult:
    """A :class:`LookupResult` from its wire reply.

    Raises:
        RemoteError: if the reply is inconsistent (a tier index out of range, or
            ``num_blocks`` not the number of tier bytes): a server bug, not a miss.
    """
    block_tiers = message.block_tiers
    if len(block_tiers) == message.num_blocks:
        try:
            return LookupResult.from_block_tiers(block_tiers, message.tier_names)
        except IndexError:  # a tier index past tier_names
            pass
    raise RemoteError(
        grpc.StatusCode.INTERNAL,
        f"malformed LookupResponse: num_blocks={message.num_blocks}, {len(block_tiers)} tier bytes, "
        f"{len(message.tier_names)} tier names",
    )


def stats_to_pb(stats: StoreStats) -> pb.StatsResponse:
    """The wire reply of the store's stats."""
    return pb.StatsResponse(
        tiers=[
            pb.TierStats(
                name=t.name, blocks=t.blocks, bytes=t.bytes, capacity_bytes=t.capacity_bytes, hits=t.hits,
                misses=t.misses, evictions=t.evictions, demotions=t.demotions, promotions=t.promotions,
                corrupt_records=t.corrupt_records, counters=t.counters, state=t.state, last_error=t.last_error,
            )
            for t in stats.tiers
        ],
        lookup_hit_blocks=stats.lookup_hit_blocks,
        lookup_miss_blocks=stats.lookup_miss_blocks,
    )


def stats_from_pb(message: pb.StatsResponse) -> StoreStats:
    """A :class:`StoreStats` from its wire reply."""
    return StoreStats(
        tuple(
            TierStats(
                name=t.name, blocks=t.blocks, bytes=t.bytes, capacity_bytes=t.capacity_bytes, hits=t.hits,
                misses=t.misses, evictions=t.evictions, demotions=t.demotions, promotions=t.promotions,
                corrupt_records=t.corrupt_records, counters=dict(t.counters), state=t.state, last_error=t.last_error,
            )
            for t in message.tiers
        ),
        message.lookup_hit_blocks,
        message.lookup_miss_blocks,
    )


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


_ONE_BYTE_VARINTS = tuple(bytes((value,)) for value in range(0x80))


def _varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf base-128 varint."""
    if value < 0x80:
        return _ONE_BYTE_VARINTS[value]
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """The varint at ``buf[pos]`` and the position after it.

    Raises:
        InvalidArgumentError: if it runs past the end of ``buf`` or over 64 bits.
    """
    if pos < len(buf) and buf[pos] < 0x80:  # most tags and lengths: one byte
        return buf[pos], pos + 1
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise InvalidArgumentError("malformed message: a varint runs past its end")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def encode_with_data(head: bytes, field_number: int, data: bytes | memoryview) -> bytes:
    """A serialized message: ``head`` (its other fields, already serialized) plus the bytes field ``data``.

    Args:
        head: ``SerializeToString()`` of the message with ``data`` unset.
        field_number: number of the ``data`` field.
        data: the field's value; copied once, into the result.
    """
    return b"".join((head, _varint(field_number << 3 | 2), _varint(len(data)), data))


def _iter_fields(view: memoryview) -> Iterator[tuple[int, int, int, int | memoryview | None]]:
    """Each top-level field of a serialized message, in order: ``(number, start, end, value)``.

    ``view[start:end]`` is the whole field, tag included; ``value`` is the
    integer of a varint field, a view of a length-delimited field's bytes, and
    ``None`` for a fixed-width (32- or 64-bit) one.

    Raises:
        InvalidArgumentError: if the message is not well-formed protobuf.
    """
    pos, end = 0, len(view)
    while pos < end:
        start = pos
        tag, pos = _read_varint(view, pos)
        wire_type = tag & 7
        value: int | memoryview | None = None
        if wire_type == 0:
            value, pos = _read_varint(view, pos)
        elif wire_type == 2:
            length, pos = _read_varint(view, pos)
            value = view[pos: pos + length]
            pos += length
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            raise InvalidArgumentError(f"malformed message: unsupported wire type {wire_type}")
        if pos > end:
            raise InvalidArgumentError("malformed message: a field runs past its end")
        yield tag >> 3, start, pos, value


def split_data_field(message: bytes, field_number: int) -> tuple[bytes, memoryview]:
    """Split a serialized message into its other fields and the value of one bytes field, without copying it.

    Args:
        message: a serialized protobuf message.
        field_number: number of a length-delimited field (the last occurrence wins, as in protobuf).

    Returns:
        ``(rest, data)``: the message without that field (for protobuf to parse)
        and a view of the field's bytes inside ``message`` (empty if absent).

    Raises:
        InvalidArgumentError: if the message is not well-formed protobuf.
    """
    view = memoryview(message)
    kept: list[memoryview] = []
    data = view[0:0]
    for number, start, end, value in _iter_fields(view):
        if number == field_number and isinstance(value, memoryview):
            data = value
        else:
            kept.append(view[start:end])
    rest = kept[0].tobytes() if len(kept) == 1 else b"".join(kept)
    return rest, data


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
    _tag(number, 0) for number in (_CHUNK_OFFSET, _CHUNK_TOTAL, _CHUNK_LAST)
)
_CHUNK_DATA_TAG = _tag(_CHUNK_DATA_FIELD, 2)
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
    parts = []
    if offset:
        parts += (_CHUNK_OFFSET_TAG, _varint(offset))
    if total_bytes:
        parts += (_CHUNK_TOTAL_TAG, _varint(total_bytes))
    if last:
        parts += (_CHUNK_LAST_TAG, b"\x01")
    parts += (_CHUNK_DATA_TAG, _varint(len(data)), data)
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
    total = _CHUNK_TOTAL_TAG + _varint(nbytes) if nbytes else b""
    return b"".join((total, _CHUNK_LAST_TAG, b"\x01", _CHUNK_DATA_TAG, _varint(nbytes)))


_READY_HEADS: dict[int, tuple[int, bytes]] = {}
"""Message length -> ``(block length, head)`` of a one-chunk reply of that length, as :func:`reply_head` writes it."""


def _ready_reply(message: bytes) -> tuple[int, int] | None:
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
            if nbytes > 0 and len(_varint(nbytes)) == width:
                break
        else:
            return None
        if len(_READY_HEADS) >= 1024:
            _READY_HEADS.clear()
        known = _READY_HEADS[size] = (nbytes, reply_head(nbytes, nbytes))  # type: ignore[assignment]
    nbytes, head = known
    if type(message) is bytes:
        found = message.startswith(head)
    else:  # another bytes-like object, e.g. a memoryview
        found = memoryview(message)[:len(head)] == head
    return (nbytes, len(head)) if found else None


def decode_block_chunk(message: bytes) -> tuple[ChunkHead, memoryview]:
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
    for number, _, _, value in _iter_fields(view):
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
    return Chunk(_parse(pb.PutRequest, rest), data)


def _parse(message_type: type, data: bytes):  # type: ignore[no-untyped-def]
    try:
        return message_type.FromString(data)
    except Exception as exc:  # google.protobuf.message.DecodeError
        raise InvalidArgumentError(f"malformed {message_type.__name__}: {exc}") from None


_R = TypeVar("_R", pb.GetRequest, pb.LookupRequest, pb.DeleteRequest)


def request_with_hashes(message_type: type[_R], namespace: pb.Namespace, block_hashes: Sequence[bytes]) -> _R:
    """A ``message_type`` request for ``block_hashes`` in ``namespace``.

    A list of ``bytes`` goes to protobuf as it is (converting 1,024 hashes one
    by one costs a third of a millisecond); other bytes-like hashes are copied.

    Raises:
        TypeError: if a hash is not bytes-like.
    """
    try:
        return message_type(namespace=namespace, block_hashes=block_hashes)
    except TypeError:  # bytearray or memoryview hashes
        return message_type(namespace=namespace, block_hashes=[bytes(h) for h in block_hashes])


_REQUEST_FIELDS = pb.GetRequest.DESCRIPTOR.fields_by_name
_REQUEST_NAMESPACE_TAG = _tag(_REQUEST_FIELDS["namespace"].number, 2)
_REQUEST_HASH_TAG = _tag(_REQUEST_FIELDS["block_hashes"].number, 2)
_NAMESPACE_TAG_BYTE = _REQUEST_NAMESPACE_TAG[0]
_HASH_TAG_BYTE = _REQUEST_HASH_TAG[0]


class HashRequest(NamedTuple):
    """A received Lookup, Get or Delete request (they share their fields).

    Attributes:
        namespace: the serialized ``Namespace`` message, as it came (a cache key; parse it once).
        block_hashes: the block hashes: ``bytes`` each, a list or :class:`~kvstore.keys.PackedHashes`.
    """

    namespace: bytes
    block_hashes: Sequence[bytes]


_NUMPY_MIN_HASHES = 16
"""From this many hashes :func:`decode_hash_request` packs them with numpy; below it, it slices each out."""


def decode_hash_request(message_type: type[_R], message: bytes) -> HashRequest:
    """Parse a serialized ``LookupRequest``, ``GetRequest`` or ``DeleteRequest``: a namespace and block hashes.

    The shape kvstore's clients send, the namespace and then every hash with one
    length (1 to 127 bytes), is read directly, from 16 hashes on into
    :class:`~kvstore.keys.PackedHashes`: 1,024 hashes in a few µs, where
    protobuf makes a new ``bytes`` per hash on each pass over its repeated field
    (about 70 µs, then as long again for a list). Any other shape (fields in
    another order, mixed lengths, unknown fields) goes through protobuf, so the
    wire format stays plain protobuf.

    Args:
        message_type: the request's message class (for protobuf's parse and errors).
        message: the serialized request.

    Raises:
        InvalidArgumentError: if the message is not well-formed protobuf.
    """
    fast = _uniform_hash_request(message)
    if fast is not None:
        return fast
    request = _parse(message_type, message)
    return HashRequest(request.namespace.SerializeToString(), request.block_hashes)


def _uniform_hash_request(message: bytes) -> HashRequest | None:
    """:func:`decode_hash_request` of ``namespace, hash, hash, ...`` with hashes of one length; ``None`` otherwise."""
    size = len(message)
    if size < 2 or message[0] != _NAMESPACE_TAG_BYTE:
        return None
    if message[1] < 0x80:  # a namespace under 128 bytes: its length is one byte
        length, start = message[1], 2
    else:
        try:
            length, start = _read_varint(memoryview(message), 1)
        except InvalidArgumentError:
            return None
        if start > 6:  # a length over 5 bytes long: protobuf refuses it, and so must this
            return None
    end = start + length
    if end == size:
        return HashRequest(message[start:end], [])
    if end + 2 > size or message[end] != _HASH_TAG_BYTE or not 0 < message[end + 1] < 0x80:
        return None
    width = message[end + 1]
    stride = width + 2  # tag, one-byte length, hash
    count, rest = divmod(size - end, stride)
    # every field is a hash field of the same length, so the fields line up at ``stride``: checked, in C
    if rest or message[end::stride] != _REQUEST_HASH_TAG * count or message[end + 1::stride] != bytes((width,)) * count:
        return None
    hashes: Sequence[bytes]
    if count < _NUMPY_MIN_HASHES:
        hashes = [message[pos: pos + width] for pos in range(end + 2, size, stride)]
    else:  # no object per hash: block_keys makes the keys from the packed hashes in C
        fields = np.frombuffer(message, dtype=np.dtype([("head", "V2"), ("hash", f"V{width}")]), offset=end)
        hashes = PackedHashes(fields["hash"].tobytes(), width)
    return HashRequest(message[start:end], hashes)


_HAND_CODED_MAX_HASHES = 32
"""Above this many hashes protobuf's C loop serializes a request faster than checking lengths in Python."""


@functools.lru_cache(maxsize=256)
def cached_namespace_pb(namespace: Namespace) -> pb.Namespace:
    """:func:`namespace_to_pb`, cached per namespace (256 most recent); a client builds one per call.

    The message is shared: pass it to a request's constructor (which copies
    it), never modify it.
    """
    return namespace_to_pb(namespace)


@functools.lru_cache(maxsize=256)
def _namespace_field(namespace: Namespace) -> bytes:
    wire = cached_namespace_pb(namespace).SerializeToString()
    return b"".join((_REQUEST_NAMESPACE_TAG, _varint(len(wire)), wire))


def encode_get_request(namespace: Namespace, block_hashes: Sequence[bytes]) -> bytes:
    """A serialized ``GetRequest``, its namespace cached per namespace.

    A client sends one per Get. Up to :data:`_HAND_CODED_MAX_HASHES` hashes
    (the usual Get) it is written by hand, about 2 µs instead of 8 µs through
    protobuf; longer lists go through protobuf, whose C loop is then faster.

    Args:
        namespace: the namespace of every hash.
        block_hashes: bytes-like block hashes; lengths are checked by the server.

    Raises:
        TypeError: if a hash is not bytes-like.
    """
    if len(block_hashes) > _HAND_CODED_MAX_HASHES:
        return request_with_hashes(pb.GetRequest, cached_namespace_pb(namespace), block_hashes).SerializeToString()
    head = _namespace_field(namespace)
    lengths = set(map(len, block_hashes))
    if len(lengths) == 1:
        separator = _REQUEST_HASH_TAG + _varint(lengths.pop())
        return b"".join((head, separator, separator.join(block_hashes)))
    return b"".join([head, *(_REQUEST_HASH_TAG + _varint(len(h)) + bytes(h) for h in block_hashes)])


def identity(message: bytes) -> bytes:
    """The (de)serializer of messages that :func:`encode_with_data` already serialized."""
    return message


def iter_block_chunks(blocks: Sequence[bytes | memoryview], chunk_bytes: int,
                      framed: Sequence[bytes | None] | None = None) -> Iterator[bytes]:
    """Serialized ``BlockChunk`` messages of a Get reply: every block's chunks, in order.

    Args:
        blocks: the encoded blocks, in prefix order.
        chunk_bytes: the largest ``data`` of one message, bytes (:func:`chunk_bytes_for`).
        framed: per block, its whole reply message when a tier holds it framed so
            (``reply_head(len(block), chunk_bytes) + block``, see
            :attr:`kvstore.tiers.base.TierLease.framed`), sent as is; ``None``
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
) -> Iterator[bytes]:
    """The serialized client-streaming messages of one Put, lazily: namespace first, then every block's chunks.

    Args:
        namespace: namespace of every block.
        block_hashes: one hash per block.
        blocks: encoded blocks, ``len == len(block_hashes)``.
        chunk_bytes: largest data field of one message, bytes.
        priority: retention priority, or ``None`` for the server's default.
        retention_s: seconds the priority holds, or ``None``.

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

    @property
    def num_buffered_bytes(self) -> int:
        """Bytes buffered so far, in finished blocks and the open one."""
        return sum(len(b) for b in self.blocks) + self._received

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

    @property
    def block_complete(self) -> bool:
        """Whether the open block has received all of its bytes."""
        return self._total >= 0 and self._received == self._total

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
        if len(parts) == 1 and type(parts[0]) is bytes:
            block = parts[0]
        elif len(parts) == 1:
            block = parts[0].tobytes() if self.copy else parts[0]  # type: ignore[union-attr]
        else:
            block = b"".join(parts)
        self.blocks.append(block)
        self._parts = []
        self._total = -1
        self._received = 0


_M = TypeVar("_M", bound=Message)


def parse_request(message_type: type[_M], raw: bytes | _M) -> _M:
    """Parse a request received as bytes (a message passes through, for direct calls).

    Raises:
        InvalidArgumentError: if the bytes are not a well-formed ``message_type``.
    """
    if isinstance(raw, Message):
        return raw  # type: ignore[return-value]
    try:
        return message_type.FromString(raw)  # type: ignore[attr-defined,no-any-return]
    except Exception as exc:  # google.protobuf.message.DecodeError, or a non-bytes value
        raise InvalidArgumentError(f"malformed {message_type.__name__}: {exc}") from None
