"""Conversions between kvstore's domain objects and the ``kvstore.v1`` messages, and the requests that carry hashes."""

from __future__ import annotations

import functools
import struct
from typing import NamedTuple, Sequence, TypeVar

import grpc
import numpy as np

from kvstore.api import LookupResult, StoreStats, TierStats
from kvstore.blocks.format import Layout, dtype_name
from kvstore.errors import InvalidArgumentError
from kvstore.store.explain import BlockExplanation
from kvstore.keys import NAMESPACE_FIELD_MAX_BYTES, HashAlgorithm, Namespace, PackedHashes
from kvstore.error_codes import RemoteError
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.protobuf import encode_varint, field_tag, parse_request, read_varint

GET_METHOD = "/kvstore.v1.KVStore/Get"
PUT_METHOD = "/kvstore.v1.KVStore/Put"


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
                name=t.name, blocks=t.blocks, bytes=t.bytes, capacity_bytes=t.capacity_bytes,
                logical_bytes=t.logical_bytes, hits=t.hits, misses=t.misses, evictions=t.evictions,
                demotions=t.demotions, promotions=t.promotions,
                corrupt_records=t.corrupt_records, counters=t.counters, state=t.state, last_error=t.last_error,
                pinned_bytes=t.pinned_bytes,
            )
            for t in stats.tiers
        ],
        lookup_hit_blocks=stats.lookup_hit_blocks,
        lookup_miss_blocks=stats.lookup_miss_blocks,
        missed_blocks=stats.missed_blocks,
        reuse_gap_counts=stats.reuse_gap_counts,
        reuse_gap_sum_s=stats.reuse_gap_sum_s,
        counters=stats.counters,
    )


def stats_from_pb(message: pb.StatsResponse) -> StoreStats:
    """A :class:`StoreStats` from its wire reply."""
    return StoreStats(
        tuple(
            TierStats(
                name=t.name, blocks=t.blocks, bytes=t.bytes, capacity_bytes=t.capacity_bytes,
                logical_bytes=t.logical_bytes, hits=t.hits, misses=t.misses, evictions=t.evictions,
                demotions=t.demotions, promotions=t.promotions,
                corrupt_records=t.corrupt_records, counters=dict(t.counters), state=t.state, last_error=t.last_error,
                pinned_bytes=t.pinned_bytes,
            )
            for t in message.tiers
        ),
        message.lookup_hit_blocks,
        message.lookup_miss_blocks,
        missed_blocks=dict(message.missed_blocks),
        reuse_gap_counts=tuple(message.reuse_gap_counts),
        reuse_gap_sum_s=message.reuse_gap_sum_s,
        counters=dict(message.counters),
    )


def explanation_to_pb(blocks: Sequence[BlockExplanation], namespace: Namespace,
                      near: Namespace | None) -> pb.ExplainResponse:
    """The wire reply of an Explain (``kvstore.store.explain``)."""
    reply = pb.ExplainResponse(
        blocks=[pb.BlockExplanation(position=b.position, hit=b.hit, tier=b.tier, cause=b.cause, detail=b.detail,
                                    removed_s=b.removed_s, removed_from=b.removed_from, priority=b.priority,
                                    namespace_fields=list(b.other_namespace), block_hash=bytes.fromhex(b.block_hash))
                for b in blocks],
        namespace=namespace_to_pb(namespace))
    if near is not None:
        reply.near_namespace.CopyFrom(namespace_to_pb(near))
    return reply


def explanation_from_pb(message: pb.ExplainResponse) -> tuple[list[BlockExplanation], Namespace | None,
                                                                Namespace | None]:
    """The blocks, the namespace explained and the near namespace (if any) of an Explain reply.

    Raises:
        InvalidArgumentError: on a malformed namespace in the reply.
    """
    blocks = [BlockExplanation(b.position, b.block_hash.hex(), b.hit, b.tier, b.cause, b.detail, b.removed_s,
                               b.removed_from, b.priority, tuple(b.namespace_fields)) for b in message.blocks]
    namespace = namespace_from_pb(message.namespace) if message.HasField("namespace") else None
    near = namespace_from_pb(message.near_namespace) if message.HasField("near_namespace") else None
    return blocks, namespace, near


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
_REQUEST_NAMESPACE_TAG = field_tag(_REQUEST_FIELDS["namespace"].number, 2)
_REQUEST_HASH_TAG = field_tag(_REQUEST_FIELDS["block_hashes"].number, 2)
_NAMESPACE_TAG_BYTE = _REQUEST_NAMESPACE_TAG[0]
_HASH_TAG_BYTE = _REQUEST_HASH_TAG[0]


class HashRequest(NamedTuple):
    """A received Lookup, Get or Delete request (they share their fields).

    Attributes:
        namespace: the serialized ``Namespace`` message, as it came (a cache key; parse it once).
        block_hashes: the block hashes: ``bytes`` each, a list or :class:`~kvstore.keys.PackedHashes`.
        session_id: a Lookup's or Get's ``agent_session_id`` (``""``: none).
        ttl_s: a Lookup's or Get's ``ttl_s`` (0.0: none).
        request_id: a Lookup's ``request_id`` (``""``: none).
    """

    namespace: bytes
    block_hashes: Sequence[bytes]
    session_id: str = ""
    ttl_s: float = 0.0
    request_id: str = ""


_SESSION_TAG = field_tag(3, 2)  # LookupRequest / GetRequest agent_session_id
_TTL_TAG = field_tag(4, 1)  # ttl_s, a double
_REQUEST_ID_TAG = field_tag(5, 2)  # LookupRequest request_id
_DOUBLE = struct.Struct("<d")


def agentic_fields(session_id: str = "", ttl_s: float = 0.0, request_id: str = "") -> bytes:
    """The serialized ``agent_session_id``, ``ttl_s`` and ``request_id`` fields of a Lookup or Get (empty when
    none is set). kvstore's clients put them before the namespace, where :func:`decode_hash_request` reads them
    without protobuf (protobuf takes fields in any order)."""
    parts = []
    if session_id:
        data = session_id.encode("utf-8")
        parts += [_SESSION_TAG, encode_varint(len(data)), data]
    if ttl_s:
        parts += [_TTL_TAG, _DOUBLE.pack(ttl_s)]
    if request_id:
        data = request_id.encode("utf-8")
        parts += [_REQUEST_ID_TAG, encode_varint(len(data)), data]
    return b"".join(parts)


def _agentic(message: bytes, pos: int, end: int) -> tuple[str, float, str] | None:
    """The agentic fields serialized in ``message[pos:end]``, ``None`` if anything else is there."""
    session, ttl, request_id = "", 0.0, ""
    view = memoryview(message)
    try:
        while pos < end:
            tag = message[pos]
            if tag == _TTL_TAG[0]:
                if pos + 9 > end:
                    return None
                ttl = _DOUBLE.unpack_from(message, pos + 1)[0]
                pos += 9
                continue
            if tag not in (_SESSION_TAG[0], _REQUEST_ID_TAG[0]):
                return None
            length, start = read_varint(view, pos + 1)
            if start + length > end:
                return None
            text = bytes(view[start:start + length]).decode("utf-8")
            if tag == _SESSION_TAG[0]:
                session = text
            else:
                request_id = text
            pos = start + length
    except (InvalidArgumentError, UnicodeDecodeError):
        return None
    return session, ttl, request_id


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
    request = parse_request(message_type, message)
    return HashRequest(request.namespace.SerializeToString(), request.block_hashes,
                       getattr(request, "agent_session_id", ""), getattr(request, "ttl_s", 0.0),
                       getattr(request, "request_id", ""))


def _uniform_hash_request(message: bytes) -> HashRequest | None:
    """:func:`decode_hash_request` of ``[agentic fields], namespace, hash, hash, ..., [agentic fields]`` with
    hashes of one length; ``None`` otherwise."""
    size = len(message)
    head = 0
    agentic = ("", 0.0, "")
    if size and message[0] != _NAMESPACE_TAG_BYTE:  # the agentic fields first, as kvstore's clients send them
        ns_at = message.find(_NAMESPACE_TAG_BYTE.to_bytes(1, "little"))
        found = _agentic(message, 0, ns_at) if ns_at > 0 else None
        if found is None:
            return None
        agentic, head = found, ns_at
    if size < head + 2 or message[head] != _NAMESPACE_TAG_BYTE:
        return None
    if message[head + 1] < 0x80:  # a namespace under 128 bytes: its length is one byte
        length, start = message[head + 1], head + 2
    else:
        try:
            length, start = read_varint(memoryview(message), head + 1)
        except InvalidArgumentError:
            return None
        if start > head + 6:  # a length over 5 bytes long: protobuf refuses it, and so must this
            return None
    end = start + length
    if end == size:
        return HashRequest(message[start:end], [], *agentic)
    if end + 2 > size or message[end] != _HASH_TAG_BYTE or not 0 < message[end + 1] < 0x80:
        return None
    width = message[end + 1]
    stride = width + 2  # tag, one-byte length, hash
    count, rest = divmod(size - end, stride)
    # every field is a hash field of the same length, so the fields line up at ``stride``: checked, in C
    if rest or message[end::stride] != _REQUEST_HASH_TAG * count or message[end + 1::stride] != bytes((width,)) * count:
        tags = message[end::stride]  # protobuf's own order puts the agentic fields last: the hashes, then them
        count = len(tags) - len(tags.lstrip(_REQUEST_HASH_TAG))
        tail = end + count * stride
        if count == 0 or tail >= size or message[end + 1:tail:stride] != bytes((width,)) * count:
            return None  # not hashes, then agentic fields: protobuf decides
        found = _agentic(message, tail, size)
        if found is None:
            return None
        agentic, size = found, tail
    hashes: Sequence[bytes]
    if count < _NUMPY_MIN_HASHES:
        hashes = [message[pos: pos + width] for pos in range(end + 2, size, stride)]
    else:  # no object per hash: block_keys makes the keys from the packed hashes in C
        fields = np.frombuffer(message, dtype=np.dtype([("head", "V2"), ("hash", f"V{width}")]), offset=end,
                               count=count)
        hashes = PackedHashes(fields["hash"].tobytes(), width)
    return HashRequest(message[start:end], hashes, *agentic)


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
    return b"".join((_REQUEST_NAMESPACE_TAG, encode_varint(len(wire)), wire))


def encode_get_request(namespace: Namespace, block_hashes: Sequence[bytes], session_id: str = "",
                       ttl_s: float = 0.0) -> bytes:
    """A serialized ``GetRequest``, its namespace cached per namespace.

    A client sends one per Get. Up to :data:`_HAND_CODED_MAX_HASHES` hashes
    (the usual Get) it is written by hand, about 2 µs instead of 8 µs through
    protobuf; longer lists go through protobuf, whose C loop is then faster.
    The agentic fields, when set, go first (:func:`agentic_fields`).

    Args:
        namespace: the namespace of every hash.
        block_hashes: bytes-like block hashes; lengths are checked by the server.
        session_id: the request's agentic session (``""``: none).
        ttl_s: its TTL, seconds (0.0: none).

    Raises:
        TypeError: if a hash is not bytes-like.
    """
    prefix = agentic_fields(session_id, ttl_s) if session_id or ttl_s else b""
    if len(block_hashes) > _HAND_CODED_MAX_HASHES:
        serialized: bytes = request_with_hashes(pb.GetRequest, cached_namespace_pb(namespace),
                                                block_hashes).SerializeToString()
        return prefix + serialized
    head = prefix + _namespace_field(namespace)
    lengths = set(map(len, block_hashes))
    if len(lengths) == 1:
        separator = _REQUEST_HASH_TAG + encode_varint(lengths.pop())
        return b"".join((head, separator, separator.join(block_hashes)))
    return b"".join([head, *(_REQUEST_HASH_TAG + encode_varint(len(h)) + bytes(h) for h in block_hashes)])


def identity(message: bytes) -> bytes:
    """The (de)serializer of messages that :func:`encode_with_data` already serialized."""
    return message
