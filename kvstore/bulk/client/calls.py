"""A Get or Put on the bulk path as one call of the client: the control call on gRPC, then the transfer.

:class:`BulkCall` is called as a gRPC multicallable is (``call(request,
timeout=..., metadata=...)``), so the client's transports run it as they run
any unary call: the synchronous client in the calling thread, the asyncio
client on its loop (the control call) and in a worker thread (the transfer,
whose bytes move in system calls with the GIL released). What the transfer
gives back is the call's result.

A call the bulk path cannot carry raises :class:`~kvstore.shm.client.link.UseGrpc`
before anything of it took effect, and the client sends it over Get or Put
instead: the node's grant budget is full (``no_room``), its listener cannot be
reached (the link goes off for a while), or a grant was refused (it expired
while the client waited). A Get cut short mid-transfer returns the blocks that
arrived whole (the rest are misses); a Put cut short stored nothing and goes
over Put.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import grpc

from kvstore.blockcopy import Copied
from kvstore.bulk.client.link import BulkLink, Endpoint
from kvstore.bulk.client.transfer import (Refused, put_reply, receive_blocks, receive_into, reply_head, request,
                                          send_put)
from kvstore.bulk.frames import TransferCut
from kvstore.codec import Layout
from kvstore.shm.client.link import UseGrpc
from kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    import torch

    from kvstore.api import Buffer

logger = logging.getLogger(__name__)

Transfer = Callable[[socket.socket, Any, float], tuple[Any, bool]]
"""``(connection, control reply, deadline) -> (result, the connection is in step for another call)``."""


class BulkCall:
    """One attempt of a bulk Get or Put (see the module docstring).

    Args:
        link: the node's bulk link.
        endpoint: its listener.
        control: the ``BulkGet`` or ``BulkPut`` multicallable of the client's channel (sync or asyncio).
        transfer: moves the bytes once the control call granted them (see :data:`Transfer`).
        empty: the result of a call the node granted nothing for (an empty prefix, no blocks).
        aio: the channel is asyncio's: calling returns an awaitable.
    """

    def __init__(self, link: BulkLink, endpoint: Endpoint, control: Any, transfer: Transfer, empty: Any,
                 aio: bool) -> None:
        self._link = link
        self._endpoint = endpoint
        self._control = control
        self._transfer = transfer
        self._empty = empty
        self._aio = aio

    def __call__(self, request_message: Any, *, timeout: float, metadata: Any, wait_for_ready: bool | None = None
                 ) -> Any:
        deadline = time.monotonic() + timeout
        if self._aio:
            return self._async(request_message, timeout, metadata, deadline)
        return self._move(self._control(request_message, timeout=timeout, metadata=metadata), deadline)

    async def _async(self, request_message: Any, timeout: float, metadata: Any, deadline: float) -> Any:
        reply = await self._control(request_message, timeout=timeout, metadata=metadata)
        if not reply.grant:
            return self._move(reply, deadline)
        return await asyncio.to_thread(self._move, reply, deadline)

    def _move(self, reply: Any, deadline: float) -> Any:
        """The transfer a control reply granted, on a connection of the link."""
        if reply.no_room:
            raise UseGrpc("the node's bulk grants are all taken now")
        if not reply.grant:
            return self._empty
        link = self._link
        try:
            sock, _ = link.connection(self._endpoint, deadline - time.monotonic())
        except OSError as exc:
            link.failed(f"cannot connect to {self._endpoint.host}:{self._endpoint.port}: {exc}")
            raise UseGrpc("the node's bulk listener cannot be reached") from None
        in_step = False
        try:
            request(sock, reply.grant, deadline)
            result, in_step = self._transfer(sock, reply, deadline)
            return result
        except Refused as refused:
            if refused.code is grpc.StatusCode.PERMISSION_DENIED:  # the grant ran out: nothing happened
                raise UseGrpc(str(refused)) from None
            raise refused.error from None
        finally:
            if in_step:
                link.give_back(sock)
            else:
                try:
                    sock.close()
                except OSError:
                    pass


def get_into(link: BulkLink, endpoint: Endpoint, control: Any, destinations: Sequence[torch.Tensor], layout: Layout,
             verify: bool, aio: bool) -> BulkCall:
    """A Get into the caller's tensors (``BulkGetRequest`` -> :class:`~kvstore.blockcopy.Copied`)."""

    def transfer(sock: socket.socket, reply: pb.BulkGetResponse, deadline: float) -> tuple[Copied, bool]:
        try:
            reply_head(sock, deadline)
        except TransferCut as cut:
            raise UseGrpc(f"the transfer was cut before it began: {cut}") from None
        received = receive_into(sock, reply.sizes, destinations, layout, verify, deadline)
        if received.cut is not None:
            logger.info("bulk Get from %s cut after %d of %d blocks: %s", link.target, received.copied.num_copied,
                        len(reply.sizes), received.cut)
        return received.copied, received.cut is None

    return BulkCall(link, endpoint, control, transfer, Copied(0, 0), aio)


def get_blocks(link: BulkLink, endpoint: Endpoint, control: Any, then: Callable[[list[Buffer]], Any],
               aio: bool) -> BulkCall:
    """A Get whose blocks (each in a buffer of its own) go through ``then`` (``BulkGetRequest`` -> its result)."""

    def transfer(sock: socket.socket, reply: pb.BulkGetResponse, deadline: float) -> tuple[Any, bool]:
        try:
            reply_head(sock, deadline)
        except TransferCut as cut:
            raise UseGrpc(f"the transfer was cut before it began: {cut}") from None
        blocks, cut = receive_blocks(sock, reply.sizes, deadline)
        if cut is not None:
            logger.info("bulk Get from %s cut after %d of %d blocks: %s", link.target, len(blocks),
                        len(reply.sizes), cut)
        return then(blocks), cut is None

    return BulkCall(link, endpoint, control, transfer, then([]), aio)


def put(link: BulkLink, endpoint: Endpoint, control: Any, items: Sequence[Any], aio: bool) -> BulkCall:
    """A Put of ``items`` (``kvstore.bulk.client.transfer.put_sizes``'s) (``BulkPutRequest`` -> blocks stored)."""

    def transfer(sock: socket.socket, reply: pb.BulkPutResponse, deadline: float) -> tuple[int, bool]:
        try:
            send_put(sock, items, deadline)
            _, body, _ = reply_head(sock, deadline)
        except TransferCut as cut:  # nothing was stored: the Put goes over gRPC
            raise UseGrpc(f"the Put's transfer was cut: {cut}") from None
        return int(put_reply(body).num_stored), True

    return BulkCall(link, endpoint, control, transfer, 0, aio)
