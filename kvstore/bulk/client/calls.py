"""A Get or Put on the bulk path as one call of the client: the call and its bytes on one bulk connection.

:class:`BulkCall` is called as a gRPC multicallable is (``call(request,
timeout=..., metadata=...)``), so the client's transports run it as they run
any unary call: the synchronous client in the calling thread, the asyncio
client in a worker thread (the bytes move in system calls with the GIL
released). It sends the ``BulkGetRequest`` or ``BulkPutRequest`` with the
caller's token on a connection to the node's bulk listener, which admits and
checks it as it would the gRPC call of that name and serves its grant at once
(``kvstore.bulk.frames``): one round trip, where the gRPC control call and a
grant would take two (2 MiB Gets: about 1.5 ms less here). What the transfer
gives back is the call's result.

A call the bulk path cannot carry raises :class:`~kvstore.shm.client.link.UseGrpc`
before anything of it took effect, and the client sends it over Get or Put
instead: the node's grant budget is full (``no_room``), or its listener cannot
be reached (the link goes off for a while). A refusal (the caller's token, its
tenant, a limit, a bad block) raises the status's typed error, as the gRPC call
would. A Get cut short mid-transfer returns the blocks that arrived whole (the
rest are misses); a Put cut short stored nothing and goes over Put.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from kvstore.blocks.copying import Copied
from kvstore.bulk.client.link import BulkLink, Endpoint
from kvstore.bulk.client.transfer import (Refused, parse_reply, receive_blocks, receive_into, reply_head, request,
                                          send_put)
from kvstore.bulk.frames import GET, PUT, TransferCut
from kvstore.blocks.tensors import Layout
from kvstore.shm.client.link import UseGrpc
from kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    import torch

    from kvstore.api import Buffer

logger = logging.getLogger(__name__)

_AUTH_KEY = "authorization"

Transfer = Callable[[socket.socket, float], tuple[Any, bool]]
"""``(connection, deadline) -> (result, the connection is in step for another call)``, once the request was sent
(a Put's blocks are sent by it)."""


class BulkCall:
    """One attempt of a bulk Get or Put (see the module docstring).

    Args:
        link: the node's bulk link.
        endpoint: its listener.
        kind: :data:`~kvstore.bulk.frames.GET` or :data:`~kvstore.bulk.frames.PUT`.
        transfer: sends what follows the request and reads the reply (see :data:`Transfer`).
        aio: called by the asyncio client: calling returns an awaitable.
    """

    def __init__(self, link: BulkLink, endpoint: Endpoint, kind: int, transfer: Transfer, aio: bool) -> None:
        self._link = link
        self._endpoint = endpoint
        self._kind = kind
        self._transfer = transfer
        self._aio = aio

    def __call__(self, request_message: Any, *, timeout: float, metadata: Any, wait_for_ready: bool | None = None
                 ) -> Any:
        deadline = time.monotonic() + timeout
        token = next((value for key, value in metadata or () if key.lower() == _AUTH_KEY), "").encode()
        body = request_message.SerializeToString()
        if self._aio:
            return asyncio.to_thread(self._move, body, token, deadline)
        return self._move(body, token, deadline)

    def _move(self, body: bytes, token: bytes, deadline: float) -> Any:
        """The call and its transfer, on a connection of the link."""
        link = self._link
        try:
            sock, fresh = link.connection(self._endpoint, deadline - time.monotonic())
        except OSError as exc:
            link.failed(f"cannot connect to {self._endpoint.host}:{self._endpoint.port}: {exc}")
            raise UseGrpc("the node's bulk listener cannot be reached") from None
        in_step = False
        try:
            try:
                request(sock, self._kind, body, deadline, token)
            except TransferCut as cut:  # an idle connection the node closed: nothing was asked of it
                raise UseGrpc(f"the bulk connection was closed: {cut}") from None
            result, in_step = self._transfer(sock, deadline)
            return result
        except Refused as refused:
            raise refused.error from None
        finally:
            if in_step:
                link.give_back(sock)
            else:
                try:
                    sock.close()
                except OSError:
                    pass


def _get_reply(sock: socket.socket, deadline: float) -> pb.BulkGetResponse:
    """A Get's reply up to its blocks; :class:`UseGrpc` when the node had no room or the connection ended first."""
    try:
        _, body, _ = reply_head(sock, deadline)
    except TransferCut as cut:  # the node closed an idle connection, or went away, before answering
        raise UseGrpc(f"the bulk connection ended before the reply: {cut}") from None
    reply: pb.BulkGetResponse = parse_reply(pb.BulkGetResponse, body)
    if reply.no_room:
        raise UseGrpc("the node's bulk grants are all taken now")
    return reply


def get_into(link: BulkLink, endpoint: Endpoint, destinations: Sequence[torch.Tensor], layout: Layout | str, verify: bool,
             aio: bool) -> BulkCall:
    """A Get into the caller's tensors (``BulkGetRequest`` -> :class:`~kvstore.blocks.copying.Copied`)."""

    def transfer(sock: socket.socket, deadline: float) -> tuple[Copied, bool]:
        reply = _get_reply(sock, deadline)
        received = receive_into(sock, reply.sizes, destinations, layout, verify, deadline)
        if received.cut is not None:
            logger.info("bulk Get from %s cut after %d of %d blocks: %s", link.target, received.copied.num_copied,
                        len(reply.sizes), received.cut)
        return received.copied, received.cut is None

    return BulkCall(link, endpoint, GET, transfer, aio)


def get_blocks(link: BulkLink, endpoint: Endpoint, then: Callable[[list[Buffer]], Any], aio: bool) -> BulkCall:
    """A Get whose blocks (each in a buffer of its own) go through ``then`` (``BulkGetRequest`` -> its result)."""

    def transfer(sock: socket.socket, deadline: float) -> tuple[Any, bool]:
        reply = _get_reply(sock, deadline)
        blocks, cut = receive_blocks(sock, reply.sizes, deadline)
        if cut is not None:
            logger.info("bulk Get from %s cut after %d of %d blocks: %s", link.target, len(blocks),
                        len(reply.sizes), cut)
        return then(blocks), cut is None

    return BulkCall(link, endpoint, GET, transfer, aio)


def put(link: BulkLink, endpoint: Endpoint, items: Sequence[Any], aio: bool) -> BulkCall:
    """A Put of ``items`` (``kvstore.bulk.client.transfer.put_sizes``'s) (``BulkPutRequest`` -> blocks stored)."""

    def transfer(sock: socket.socket, deadline: float) -> tuple[int, bool]:
        try:
            send_put(sock, items, deadline)
            _, body, _ = reply_head(sock, deadline)
        except TransferCut as cut:  # nothing was stored (or the same blocks were): the Put goes over gRPC
            raise UseGrpc(f"the Put's transfer was cut: {cut}") from None
        reply = parse_reply(pb.BulkPutResponse, body)
        if reply.no_room:
            raise UseGrpc("the node's bulk grants are all taken now")  # the node closes: its blocks were sent
        return int(reply.stored.num_stored), True

    return BulkCall(link, endpoint, PUT, transfer, aio)
