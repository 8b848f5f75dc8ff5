"""The shared wire helpers as pure logic: namespace conversion, chunking and reassembly."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgumentError, ResourceExhaustedError, UnknownDtypeError
from kvstore.keys import HashAlgorithm, Namespace
from kvstore.wire import (
    BlockAssembler,
    encode_get_request,
    iter_chunks,
    namespace_from_pb,
    namespace_to_pb,
)


def test_namespace_round_trips_every_field() -> None:
    ns = Namespace(model="m", revision="r1", dtype="bfloat16", layout="mla", block_size=32, tp_size=4, tp_rank=3,
                   adapter="lora-7", cache_salt="tenant", hash_algorithm=HashAlgorithm.SHA256)
    back = namespace_from_pb(namespace_to_pb(ns))
    assert back == ns and back.root == ns.root


def test_unknown_dtype_in_namespace_is_a_codec_error() -> None:
    message = namespace_to_pb(Namespace(model="m"))
    message.dtype = "float13"
    with pytest.raises(UnknownDtypeError):
        namespace_from_pb(message)


@pytest.mark.parametrize("size", [0, 1, 9, 10, 11, 30, 31])
def test_chunks_reassemble_to_the_block(size: int) -> None:
    block = bytes(range(size))
    chunks = list(iter_chunks(block, 10))
    assert [offset for offset, _, _ in chunks] == list(range(0, max(size, 1), 10))
    assert [last for _, _, last in chunks] == [False] * (len(chunks) - 1) + [True]
    assert all(len(data) <= 10 for _, data, _ in chunks)
    assembler = BlockAssembler(max_block_bytes=100, max_blocks=2)
    for index in range(2):
        assembler.begin(index, size)
        for offset, data, _ in chunks:
            assembler.add(index, offset, data)
    assert assembler.finish() == [block, block]


def test_a_single_chunk_block_is_not_copied() -> None:
    block = b"x" * 10
    ((_, data, _),) = iter_chunks(block, 10)
    assembler = BlockAssembler(100, 1)
    assembler.begin(0, 10)
    assembler.add(0, 0, data)
    assert assembler.finish()[0] is block


def test_assembler_refuses_bad_streams() -> None:
    assembler = BlockAssembler(max_block_bytes=100, max_blocks=2)
    with pytest.raises(ResourceExhaustedError, match="max_block_bytes"):
        assembler.begin(0, 101)
    with pytest.raises(InvalidArgumentError, match="expected"):
        assembler.begin(1, 10)
    with pytest.raises(InvalidArgumentError, match="before that block's first chunk"):
        assembler.add(0, 0, b"x")
    assembler.begin(0, 10)
    with pytest.raises(InvalidArgumentError, match="offset"):
        assembler.add(0, 5, b"x")
    with pytest.raises(InvalidArgumentError, match="run past"):
        assembler.add(0, 0, b"x" * 11)
    assembler.add(0, 0, b"x" * 5)
    with pytest.raises(InvalidArgumentError, match="truncated"):
        assembler.begin(1, 10)
    with pytest.raises(InvalidArgumentError, match="truncated"):
        _truncated()
    full = BlockAssembler(100, 1)
    full.begin(0, 1)
    full.add(0, 0, b"x")
    with pytest.raises(InvalidArgumentError, match="max_hashes_per_request=1"):
        full.begin(1, 1)


def _truncated() -> None:
    assembler = BlockAssembler(100, 1)
    assembler.begin(0, 2)
    assembler.add(0, 0, b"x")
    assembler.finish()


def test_assembler_bounds_the_bytes_of_one_stream() -> None:
    assembler = BlockAssembler(max_block_bytes=100, max_blocks=10, max_total_bytes=150)
    assembler.begin(0, 100)
    assembler.add(0, 0, b"x" * 100)
    with pytest.raises(ResourceExhaustedError, match="max_put_bytes"):
        assembler.begin(1, 60)  # refused before any of its bytes are buffered


# ---------------------------------------------------------------------- the compact Lookup reply

import grpc  # noqa: E402

from kvstore.api import LookupResult  # noqa: E402
from kvstore.error_codes import RemoteError  # noqa: E402
from kvstore.wire import (  # noqa: E402
    decode_block_chunk,
    encode_block_chunk,
    iter_block_chunks,
    lookup_from_pb,
    lookup_to_pb,
    reply_head,
)
from kvstore.v1 import kvstore_pb2 as pb  # noqa: E402

TIERS = ("memory", "disk", "redis")


@pytest.mark.parametrize(
    ("block_tiers", "tiers"),
    [
        (b"", ()),
        (b"\x01", ("disk",)),
        (b"\x00\x00\x01\x02", ("memory", "memory", "disk", "redis")),
        (bytes(1024), ("memory",) * 1024),
        (b"\x02" * 3, ("redis",) * 3),
    ],
    ids=["none", "one", "several", "1024", "all-in-one-lower-tier"],
)
def test_lookup_result_from_block_tiers(block_tiers: bytes, tiers: tuple[str, ...]) -> None:
    result = LookupResult.from_block_tiers(block_tiers, TIERS)
    assert result == LookupResult(len(block_tiers), tiers)
    assert type(result.tiers) is tuple
    assert LookupResult.from_block_tiers(block_tiers, list(TIERS)) == result


@pytest.mark.parametrize("block_tiers", [b"\x03", b"\x00\x03", b"\x00\xff\x01", b"\x03" * 4])
def test_lookup_result_refuses_a_tier_index_out_of_range(block_tiers: bytes) -> None:
    with pytest.raises(IndexError):
        LookupResult.from_block_tiers(block_tiers, TIERS)


def test_lookup_reply_round_trips_through_its_wire_form() -> None:
    for block_tiers in (b"", b"\x02", b"\x00\x01\x01\x02"):
        message = lookup_to_pb(block_tiers, TIERS)
        assert message.num_blocks == len(block_tiers) and message.block_tiers == block_tiers
        assert tuple(message.tier_names) == TIERS
        received = pb.LookupResponse.FromString(message.SerializeToString())
        assert lookup_from_pb(received) == LookupResult.from_block_tiers(block_tiers, TIERS)


@pytest.mark.parametrize(
    "message",
    [
        pb.LookupResponse(num_blocks=3, tier_names=TIERS, block_tiers=b"\x00\x01"),  # fewer tier bytes
        pb.LookupResponse(num_blocks=1, tier_names=TIERS, block_tiers=b"\x00\x01"),  # more tier bytes
        pb.LookupResponse(num_blocks=2, tier_names=TIERS, block_tiers=b"\x00\x07"),  # index out of range
        pb.LookupResponse(num_blocks=1, tier_names=(), block_tiers=b"\x00"),  # no tier names at all
    ],
    ids=["short", "long", "out-of-range", "no-names"],
)
def test_a_malformed_lookup_reply_is_a_remote_error(message: pb.LookupResponse) -> None:
    with pytest.raises(RemoteError) as info:
        lookup_from_pb(message)
    assert info.value.code is grpc.StatusCode.INTERNAL and "LookupResponse" in str(info.value)


# ---------------------------------------------------------------------- assembling without copies


def _assemble(block: bytes, chunk_bytes: int, *, copy: bool) -> bytes | memoryview:
    """``block`` sent as serialized BlockChunks and reassembled from the received messages."""
    assembler = BlockAssembler(max_block_bytes=1 << 20, max_blocks=1, copy=copy)
    for offset, data, last in iter_chunks(block, chunk_bytes):
        assembler.add_reply_chunk(*decode_block_chunk(encode_block_chunk(offset, len(block), data, last)))
    (assembled,) = assembler.finish()
    return assembled


def test_without_copy_a_one_chunk_block_stays_a_view_of_its_message() -> None:
    block = bytes(range(100))
    assembled = _assemble(block, 100, copy=False)
    assert type(assembled) is memoryview and assembled.readonly and assembled == block
    assert isinstance(assembled.obj, bytes) and len(assembled.obj) > len(block)  # the whole received message


def test_without_copy_a_block_of_several_chunks_is_joined_into_bytes() -> None:
    block = bytes(range(100))
    assembled = _assemble(block, 30, copy=False)
    assert type(assembled) is bytes and assembled == block


@pytest.mark.parametrize("chunk_bytes", [30, 100])
def test_with_copy_every_block_is_bytes(chunk_bytes: int) -> None:
    block = bytes(range(100))
    assembled = _assemble(block, chunk_bytes, copy=True)
    assert type(assembled) is bytes and assembled == block


def test_without_copy_empty_and_bytes_chunks_pass_through() -> None:
    assembler = BlockAssembler(100, 3, copy=False)
    block = b"y" * 10
    assembler.begin(0, 0)
    assembler.begin(1, 10)
    assembler.add(1, 0, block)
    assembler.begin(2, 4)
    assembler.add(2, 0, memoryview(b"abcd"))
    blocks = assembler.finish()
    assert blocks[0] == b"" and blocks[1] is block and type(blocks[2]) is memoryview and blocks[2] == b"abcd"


# ---------------------------------------------------------------------- hand-written Get messages


@pytest.mark.parametrize(
    "fields",
    [(0, 0, b"", False), (4096, 1 << 33, b"xyz", True), (0, 5, b"d" * 300, False)],
)
def test_block_chunk_is_plain_protobuf_both_ways(fields: tuple[int, int, bytes, bool]) -> None:
    offset, total_bytes, data, last = fields
    reference = pb.BlockChunk(offset=offset, total_bytes=total_bytes, data=data, last=last)
    assert pb.BlockChunk.FromString(encode_block_chunk(*fields)) == reference
    for message in (encode_block_chunk(*fields), reference.SerializeToString()):
        head, received = decode_block_chunk(message)
        assert head == (offset, total_bytes, last) and received == data


def test_block_chunk_decoding_follows_protobuf_rules() -> None:
    """Fields in any order, the last occurrence wins, unknown fields (the retired block_index too) are skipped."""
    unknown = b"\x08\x07" + b"\x31" + bytes(8) + b"\x3a\x02zz" + b"\x45" + bytes(4)  # fields 1, 6, 7, 8
    message = (
        pb.BlockChunk(data=b"old", offset=9).SerializeToString()
        + unknown
        + pb.BlockChunk(offset=2, data=b"new", last=True).SerializeToString()
    )
    head, data = decode_block_chunk(message)
    assert pb.BlockChunk.FromString(message).offset == head.offset == 2
    assert data == b"new" and head.last


@pytest.mark.parametrize("nbytes", [0, 1, 127, 128, 100_000, 4096])
def test_a_reply_head_and_its_block_are_the_one_chunk_reply(nbytes: int) -> None:
    block = bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)
    head = reply_head(nbytes, chunk_bytes=100_000)
    assert head is not None and head + block == encode_block_chunk(0, nbytes, block, True)
    assert decode_block_chunk(head + block) == ((0, nbytes, True), block)


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_a_block_chunk_of_any_bytes_like_type_decodes(kind: type) -> None:
    block = bytes(range(200))
    for message in (reply_head(200, 4096) + block, encode_block_chunk(10, 210, block, True)):  # type: ignore[operator]
        head, data = decode_block_chunk(kind(message))
        assert data == block and head.total_bytes in (200, 210)


def test_a_block_over_the_chunk_size_has_no_reply_head() -> None:
    assert reply_head(4097, chunk_bytes=4096) is None


def test_ready_replies_are_sent_as_they_are_and_other_blocks_are_encoded() -> None:
    blocks = [b"a" * 10, b"b" * 10, b"c" * 25]
    ready = reply_head(10, 10) + blocks[1]  # type: ignore[operator]
    messages = list(iter_block_chunks(blocks, 10, [None, ready, None]))
    assert messages[1] is ready
    assert messages == list(iter_block_chunks(blocks, 10))  # 1 + 1 + 3 chunks, the same bytes either way
    assert len(messages) == 5


def test_reply_chunks_begin_a_new_block_at_offset_zero() -> None:
    blocks = [b"x" * 7, b"y" * 25, b"", b"z" * 3]
    assembler = BlockAssembler(100, 4)
    for message in iter_block_chunks(blocks, 10):
        assembler.add_reply_chunk(*decode_block_chunk(message))
    assert assembler.finish() == blocks


def test_add_reply_takes_a_whole_block_as_a_view_of_its_message_and_skips_an_empty_one() -> None:
    block = b"q" * 300
    ready = reply_head(300, 1000) + block  # type: ignore[operator]
    assembler = BlockAssembler(1000, 3, copy=False)
    assembler.add_reply(b"")  # the reply of a Get that found nothing
    assembler.add_reply(ready)
    for message in iter_block_chunks([b"r" * 25], 10):  # a chunked block between two whole ones
        assembler.add_reply(message)
    assembler.add_reply(ready)
    blocks = assembler.finish()
    assert blocks == [block, b"r" * 25, block]
    assert isinstance(blocks[0], memoryview) and blocks[0].obj is ready  # no copy
    copying = BlockAssembler(1000, 1)
    copying.add_reply(ready)
    assert type(copying.finish()[0]) is bytes


def test_add_reply_checks_a_whole_block_as_add_reply_chunk_does() -> None:
    ready = reply_head(300, 1000) + b"q" * 300  # type: ignore[operator]
    with pytest.raises(ResourceExhaustedError, match="max_block_bytes"):
        BlockAssembler(299, 2).add_reply(ready)
    one = BlockAssembler(1000, 1)
    one.add_reply(ready)
    with pytest.raises(InvalidArgumentError, match="max_hashes_per_request"):
        one.add_reply(ready)
    open_block = BlockAssembler(1000, 2)
    open_block.add_reply(encode_block_chunk(0, 20, b"y" * 10, False))
    with pytest.raises(InvalidArgumentError, match="truncated"):  # a whole block while another is half done
        open_block.add_reply(ready)


@pytest.mark.parametrize("messages, error", [
    ([encode_block_chunk(10, 20, b"y" * 10, True)], "before that block's first chunk"),
    ([encode_block_chunk(0, 20, b"y" * 10, False), encode_block_chunk(0, 5, b"z" * 5, True)], "truncated"),
    ([encode_block_chunk(0, 20, b"y" * 10, False), encode_block_chunk(12, 20, b"y" * 8, True)], "expected offset 10"),
])
def test_a_reply_stream_out_of_order_is_invalid_argument(messages: list[bytes], error: str) -> None:
    assembler = BlockAssembler(100, 4)
    with pytest.raises(InvalidArgumentError, match=error):
        for message in messages:
            assembler.add_reply_chunk(*decode_block_chunk(message))
        assembler.finish()


@pytest.mark.parametrize("message", [b"\x08", b"\x22\x05abc", b"\x0b", b"\x08" + b"\xff" * 11])
def test_a_malformed_block_chunk_is_invalid_argument(message: bytes) -> None:
    with pytest.raises(InvalidArgumentError):
        decode_block_chunk(message)


@pytest.mark.parametrize(
    "hashes",
    [
        [], [b"a" * 16], [b"a" * 16, bytearray(b"b" * 16), memoryview(b"c" * 16)], [b"a" * 16, b"b" * 32], [b"x" * 200],
        [bytes([i]) * 16 for i in range(100)],  # long lists go through protobuf
        [bytearray(b"y" * 32)] * 40,
    ],
)
def test_get_request_matches_protobuf(hashes: list[bytes]) -> None:
    namespace = Namespace(model="m", cache_salt="tenant")
    reference = pb.GetRequest(namespace=namespace_to_pb(namespace), block_hashes=[bytes(h) for h in hashes])
    assert encode_get_request(namespace, hashes) == reference.SerializeToString()


from kvstore.wire import decode_hash_request  # noqa: E402

_NS = pb.Namespace(model="m" * 200, dtype="float16", layout="kv", block_size=16, tp_size=1, hash_algorithm="xxh3_128")


@pytest.mark.parametrize("message_type", [pb.LookupRequest, pb.GetRequest, pb.DeleteRequest])
@pytest.mark.parametrize(
    "hashes",
    [[], [b"a" * 16], [bytes([i]) * 16 for i in range(15)], [bytes([i % 256]) * 16 for i in range(1024)],
     [bytes([i]) * 32 for i in range(40)], [b""] * 3, [b"a" * 16, b"b" * 32] * 10, [b"x" * 200] * 20],
)
def test_hash_requests_decode_as_protobuf_does(message_type: type, hashes: list[bytes]) -> None:
    """The direct read (one hash length, under 128 bytes) and protobuf's (the rest) agree with protobuf."""
    reference = message_type(namespace=_NS, block_hashes=hashes)
    request = decode_hash_request(message_type, reference.SerializeToString())
    assert list(request.block_hashes) == hashes and all(type(h) is bytes for h in request.block_hashes)
    assert pb.Namespace.FromString(request.namespace) == _NS


@pytest.mark.parametrize(
    "message",
    [
        # the hashes before the namespace; then an unknown field after them; then the namespace twice (merged)
        pb.GetRequest(block_hashes=[b"h" * 16] * 20).SerializeToString()
        + pb.GetRequest(namespace=_NS).SerializeToString(),
        pb.GetRequest(namespace=_NS, block_hashes=[b"h" * 16] * 20).SerializeToString() + b"\x18\x01",
        pb.GetRequest(namespace=pb.Namespace(model="a")).SerializeToString()
        + pb.GetRequest(namespace=pb.Namespace(block_size=16), block_hashes=[b"h" * 16] * 20).SerializeToString(),
    ],
)
def test_hash_requests_of_any_other_shape_follow_protobuf(message: bytes) -> None:
    reference = pb.GetRequest.FromString(message)
    request = decode_hash_request(pb.GetRequest, message)
    assert list(request.block_hashes) == list(reference.block_hashes)
    assert pb.Namespace.FromString(request.namespace) == reference.namespace


@pytest.mark.parametrize("message", [
    pb.GetRequest(namespace=_NS, block_hashes=[b"h" * 16] * 20).SerializeToString()[:-1],  # a hash cut short
    b"\x0a\xff",  # the namespace runs past the end
    b"\x12\x10" + b"h" * 15,
])
def test_a_malformed_hash_request_is_invalid_argument(message: bytes) -> None:
    with pytest.raises(InvalidArgumentError, match="malformed GetRequest"):
        decode_hash_request(pb.GetRequest, message)


def test_the_three_hash_requests_number_their_fields_alike() -> None:
    """``decode_hash_request`` reads Lookup, Get and Delete requests with one layout."""
    numbers = {(m.DESCRIPTOR.fields_by_name["namespace"].number, m.DESCRIPTOR.fields_by_name["block_hashes"].number)
               for m in (pb.LookupRequest, pb.GetRequest, pb.DeleteRequest)}
    assert numbers == {(1, 2)} and set(pb.GetRequest.DESCRIPTOR.fields_by_name) == {
        "namespace", "block_hashes", "agent_session_id", "ttl_s"}  # the agentic fields: read beside the hashes


@pytest.mark.parametrize("length_bytes", range(1, 11))
def test_a_long_namespace_length_varint_is_refused_as_protobuf_refuses_it(length_bytes: int) -> None:
    """A length written in ``length_bytes`` bytes (padded with 0x80 continuation bytes): protobuf takes up to 5."""
    namespace = pb.Namespace(model="m", block_size=16).SerializeToString()  # under 128 bytes: one byte of length
    groups = [len(namespace)] + [0] * (length_bytes - 1)
    varint = bytes(g | 0x80 for g in groups[:-1]) + bytes([groups[-1]])
    message = b"\x0a" + varint + namespace + b"\x12\x02ab" * 20
    try:
        expected = pb.GetRequest.FromString(message)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError
        with pytest.raises(InvalidArgumentError):
            decode_hash_request(pb.GetRequest, message)
    else:
        request = decode_hash_request(pb.GetRequest, message)
        assert list(request.block_hashes) == list(expected.block_hashes) and length_bytes <= 5
