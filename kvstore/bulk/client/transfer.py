"""The client's transfers on a bulk connection: a Get's blocks received straight into the caller's memory, a Put's
sent straight from it (``kvstore.bulk.frames`` is the format).

Get into tensors (:func:`receive_into`): each block's header is received
first into a small buffer and compared with the header a block of its
destination's dtype and shape has (all but the checksum field); where it is
that one and the destination is a contiguous CPU tensor, the payload is
received with ``recv_into`` straight into the destination's memory, and its
checksum taken there while it is in cache. Any other block (a lossy encoding,
another shape, a destination on a GPU or with gaps) is received into a buffer
of its own and copied from there (``kvstore.blocks.copying.copy_block_into``).

Put (:func:`send_put`): each tensor's header is built once per batch
(``kvstore.blocks.copying.tensor_blocks``), its checksum taken over the caller's
tensor where it lies, and header and payload go out in one ``sendmsg`` from
where they lie; the blocks travel a megabyte or so at a time, each sent right
after its checksum, while it is in cache.

A transfer cut short raises :class:`~kvstore.bulk.frames.TransferCut`; a Get's
blocks received whole before the cut are in place (and counted), the rest are
misses; a Put cut short stored nothing.
"""

from __future__ import annotations

import ctypes
import socket
import struct
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import grpc

from kvstore.blocks.copying import Copied, TensorBlock, copy_block_into, tensor_blocks
from kvstore.bulk.frames import MAGIC, MAX_BODY_BYTES, REPLY, REQUEST, TransferCut, recv_exactly_into, send_all
from kvstore.blocks.tensors import CHECKSUM_SPAN, Layout, block_checksum, blank_header, dtype_name, header_nbytes
from kvstore.errors import ChecksumError, DestinationMismatchError, KVStoreError
from kvstore.error_codes import error_of

if TYPE_CHECKING:
    import torch

    from kvstore.api import Block, Buffer

_CHECKSUM = struct.Struct("<Q")
SEND_GROUP_BYTES = 1 << 20
"""A Put's blocks are checksummed and sent this many bytes at a time (each group sent while it is in cache)."""


class Refused(KVStoreError):
    """The node answered a transfer with a status other than OK (its typed error is :attr:`error`).

    Attributes:
        code: the status code.
        error: the typed error of that status (``kvstore.error_codes.error_of``).
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.error = error_of(code, message)


class Received(NamedTuple):
    """What a Get into tensors received: its :class:`~kvstore.blocks.copying.Copied`, and the cut that ended it early
    (``None`` when every block arrived)."""

    copied: Copied
    cut: TransferCut | None


def request(sock: socket.socket, kind: int, body: bytes, deadline: float, token: bytes = b"") -> None:
    """Send a request (``kvstore.bulk.frames``): a grant to redeem (:data:`~kvstore.bulk.frames.REDEEM`), or a
    serialized ``BulkGetRequest`` or ``BulkPutRequest`` with the caller's token; a Put's blocks follow it.

    Raises:
        TransferCut: if it cannot be sent.
    """
    send_all(sock, [memoryview(REQUEST.pack(MAGIC, kind, len(token), len(body)) + token + body)], deadline)


def reply_head(sock: socket.socket, deadline: float) -> tuple[int, bytes, int]:
    """The node's reply head and body: ``(code, body, data_bytes)``.

    Raises:
        TransferCut: if it does not arrive whole.
        Refused: if the code is not OK (the body is its details).
        ConnectionError: on a reply that is not the format's.
    """
    head = bytearray(REPLY.size)
    recv_exactly_into(sock, memoryview(head), deadline)
    magic, code, body_bytes, data_bytes = REPLY.unpack(head)
    if magic != MAGIC or body_bytes > MAX_BODY_BYTES:
        raise ConnectionError("the bulk listener's reply is not a kvstore bulk reply")
    body = bytearray(body_bytes)
    if body_bytes:
        recv_exactly_into(sock, memoryview(body), deadline)
    if code != 0:
        try:
            status = grpc.StatusCode[_CODE_NAMES[code]]
        except KeyError:
            status = grpc.StatusCode.UNKNOWN
        raise Refused(status, body.decode(errors="replace"))
    return code, bytes(body), data_bytes


def receive_into(sock: socket.socket, sizes: Sequence[int], destinations: Sequence[torch.Tensor], layout: Layout | str,
                 verify: bool, deadline: float) -> Received:
    """Receive a Get's blocks (its reply already read up to the data) into ``destinations``, in order.

    Args:
        sock: the connection, positioned at the first block.
        sizes: each block's encoded length, bytes (the ``BulkGetResponse``'s).
        destinations: one tensor per block (at least as many), any device and strides.
        layout: the namespace's layout.
        verify: check each block's checksum.
        deadline: ``time.monotonic()`` by which every block must have arrived.

    Returns:
        What was copied; a mismatched destination ends it (``Copied.error``), with the connection's stream still
        in step (the rest of that block and the blocks after it are read and dropped).

    Raises:
        ChecksumError: (with ``verify``) on a block that is not what the node stored; the connection is then out of
            step and must be closed.
        CodecError: on a malformed block.
    """
    num_found = len(sizes)
    head = bytearray(512)
    heads = memoryview(head)
    expected: dict[tuple[Any, tuple[int, ...]], bytes] = {}
    at, end = CHECKSUM_SPAN
    for position, nbytes in enumerate(sizes):
        destination = destinations[position]
        try:
            payload = _landing(destination)
            if payload is not None:
                head_bytes = header_nbytes(destination.dim())
                if head_bytes + payload.nbytes != nbytes:
                    payload = None
            if payload is None:  # a block of its own, copied into its destination from there
                block = bytearray(nbytes)
                recv_exactly_into(sock, memoryview(block), deadline)
                try:
                    copy_block_into(block, destination, verify=verify, position=position, num_found=num_found)
                except DestinationMismatchError as exc:
                    _drain(sock, sum(sizes[position + 1:]), deadline)
                    return Received(Copied(position, num_found, exc), None)
                continue
            key = (destination.dtype, tuple(destination.shape))
            want = expected.get(key)
            if want is None:
                want = expected[key] = blank_header(dtype_name(destination.dtype), layout, key[1])
            got = heads[:head_bytes]
            recv_exactly_into(sock, got, deadline)
            if got[:at] != want[:at] or got[end:] != want[end:head_bytes]:  # another block: copied from a buffer
                block = bytearray(nbytes)
                block[:head_bytes] = got
                recv_exactly_into(sock, memoryview(block)[head_bytes:], deadline)
                try:
                    copy_block_into(block, destination, verify=verify, position=position, num_found=num_found)
                except DestinationMismatchError as exc:
                    _drain(sock, sum(sizes[position + 1:]), deadline)
                    return Received(Copied(position, num_found, exc), None)
                continue
            recv_exactly_into(sock, payload, deadline)  # straight into the caller's tensor
            if verify and block_checksum(got, payload) != _CHECKSUM.unpack_from(got, at)[0]:
                raise ChecksumError(f"block {position}: checksum mismatch: the block arrived corrupt")
        except TransferCut as cut:
            return Received(Copied(position, position), cut)
    return Received(Copied(num_found, num_found), None)


def receive_blocks(sock: socket.socket, sizes: Sequence[int], deadline: float) -> tuple[list[Buffer], TransferCut | None]:
    """Receive a Get's blocks (its reply already read up to the data) into buffers of their own.

    Returns:
        The blocks received whole (read-only views of new ``bytearray`` s, in order) and the cut that ended the
        transfer early (``None`` when every block arrived).
    """
    blocks: list[Buffer] = []
    for nbytes in sizes:
        block = bytearray(nbytes)
        try:
            recv_exactly_into(sock, memoryview(block), deadline)
        except TransferCut as cut:
            return blocks, cut
        blocks.append(memoryview(block).toreadonly())
    return blocks, None


def put_sizes(blocks: Sequence[Block], layout: Layout | str) -> tuple[list[Any], list[int]]:
    """A Put's blocks as they are sent (:class:`~kvstore.blocks.copying.TensorBlock` s and encoded bytes), and each
    one's encoded length, bytes; no payload is read yet."""
    items = tensor_blocks(blocks, layout)
    return items, [len(item) if type(item) is TensorBlock else memoryview(item).nbytes for item in items]


def send_put(sock: socket.socket, items: Sequence[Any], deadline: float) -> None:
    """Send a Put's blocks (after its request): each header, then each payload from where it lies.

    A tensor's checksum is taken over its own memory (a CPU tensor with gaps, or one on a GPU, is made
    contiguous in host memory first: that copy is the one the transfer needs), the header it makes is
    sent before it, and the blocks go out :data:`SEND_GROUP_BYTES` at a time.

    Raises:
        TransferCut: if the node closes the connection or the deadline passes first.
    """
    group: list[memoryview] = []
    group_bytes = 0
    keep: list[Any] = []  # the tensors made for sending, alive until sent
    at = CHECKSUM_SPAN[0]
    for item in items:
        if type(item) is TensorBlock:
            tensor = item.tensor.detach()
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                tensor = tensor.to("cpu").contiguous()
                keep.append(tensor)
            payload = _view(tensor)
            header = bytearray(item.blank)
            _CHECKSUM.pack_into(header, at, block_checksum(header, payload))
            group.append(memoryview(header))
            group.append(payload)
            group_bytes += item.nbytes
        else:
            view = memoryview(item).cast("B")
            group.append(view)
            group_bytes += view.nbytes
        if group_bytes >= SEND_GROUP_BYTES:
            send_all(sock, group, deadline)
            group, group_bytes, keep = [], 0, []
    if group:
        send_all(sock, group, deadline)


def parse_reply(message_type: Any, body: bytes) -> Any:
    """A reply body (a ``BulkGetResponse`` or ``BulkPutResponse``), parsed.

    Raises:
        ConnectionError: if it is not one.
    """
    try:
        return message_type.FromString(body)
    except Exception as exc:  # noqa: BLE001 - a malformed reply is the connection's fault
        raise ConnectionError(f"the bulk listener's reply is malformed: {exc}") from None


def _landing(destination: torch.Tensor) -> memoryview | None:
    """A writable byte view of a contiguous CPU tensor's memory (``None`` for any other tensor)."""
    if destination.device.type != "cpu" or not destination.is_contiguous() or destination.numel() == 0:
        return None
    nbytes = destination.numel() * destination.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(destination.data_ptr())).cast("B")


def _view(tensor: torch.Tensor) -> memoryview:
    """A read-only byte view of a contiguous CPU tensor's memory."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B").toreadonly()


def _drain(sock: socket.socket, nbytes: int, deadline: float) -> None:
    """Read and drop ``nbytes`` (the rest of a Get whose blocks the caller cannot take), keeping the stream in step."""
    scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
    while nbytes > 0:
        chunk = scratch[:min(nbytes, scratch.nbytes)]
        recv_exactly_into(sock, chunk, deadline)
        nbytes -= chunk.nbytes


_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
