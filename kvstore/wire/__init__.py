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

from kvstore.wire.chunks import (
    BlockAssembler,
    Chunk,
    ChunkHead,
    decode_block_chunk,
    decode_put_request,
    encode_block_chunk,
    iter_block_chunks,
    iter_chunks,
    put_requests,
    reply_head,
)
from kvstore.wire.messages import (
    GET_METHOD,
    MAX_NAMESPACE_WIRE_BYTES,
    PUT_METHOD,
    HashRequest,
    agentic_fields,
    cached_namespace_pb,
    decode_hash_request,
    encode_get_request,
    explanation_from_pb,
    explanation_to_pb,
    identity,
    lookup_from_pb,
    lookup_to_pb,
    namespace_from_pb,
    namespace_to_pb,
    request_with_hashes,
    stats_from_pb,
    stats_to_pb,
)
from kvstore.wire.options import MESSAGE_OVERHEAD_BYTES, channel_options, chunk_bytes_for, sync_client_channel_options
from kvstore.wire.protobuf import encode_with_data, parse_request, split_data_field

__all__ = [
    "BlockAssembler",
    "Chunk",
    "ChunkHead",
    "GET_METHOD",
    "HashRequest",
    "MAX_NAMESPACE_WIRE_BYTES",
    "MESSAGE_OVERHEAD_BYTES",
    "PUT_METHOD",
    "agentic_fields",
    "cached_namespace_pb",
    "channel_options",
    "chunk_bytes_for",
    "decode_block_chunk",
    "decode_hash_request",
    "decode_put_request",
    "encode_block_chunk",
    "encode_get_request",
    "encode_with_data",
    "explanation_from_pb",
    "explanation_to_pb",
    "identity",
    "iter_block_chunks",
    "iter_chunks",
    "lookup_from_pb",
    "lookup_to_pb",
    "namespace_from_pb",
    "namespace_to_pb",
    "parse_request",
    "put_requests",
    "reply_head",
    "request_with_hashes",
    "split_data_field",
    "stats_from_pb",
    "stats_to_pb",
    "sync_client_channel_options",
]
