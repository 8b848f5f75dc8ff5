"""The node's side of a session's control channels: frames in, the node's operations, replies out.

Each request (``kvstore.shm.frames``) is handed to the node's dispatcher
(``kvstore.shm.node.operations.SameHostOperations.dispatch``), which admits
it as the session's ``Attach`` call was (its token checked again, one in-flight
"connection" per session), runs the operation gRPC would run, and returns the
reply's status, body and descriptors. Another client, of this tenant or
another, cannot reach a session's channels: they are socket pairs whose client
ends the node handed to the session's process alone (``SCM_RIGHTS``), after
that session's grant.

A channel costs the node what its client actually sends, for a bounded time.
A request's body is read as it arrives, never allocated from the size its head
announces, and all bodies being received on the node together are bounded
(:class:`BodyBudget`); a body must arrive whole within :data:`BODY_TIMEOUT_S`
(or its call's deadline, if sooner). A channel ends when its client closes it
or dies (end of file, possibly mid-frame), on a malformed or oversized head
(answered with its status first), on a body that is too slow or over the
budget (RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED first), or when the session
ends. None of these touches anything beyond the channel.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Awaitable, Callable

import grpc

from kvstore.shm.frames import REQUEST_HEAD, FrameError, pack_reply, unpack_request_head

if TYPE_CHECKING:
    from kvstore.shm.node.sessions import Session

logger = logging.getLogger(__name__)

BODY_TIMEOUT_S = 5.0
"""Longest a request's body may take to arrive once its head has, seconds."""
BODY_BUDGET_BYTES = 64 << 20
"""Bytes of request bodies the node receives at once over every control channel; a frame past it is refused."""
_RECV_BYTES = 1 << 16
"""The most bytes read from a channel at a time."""

Dispatch = Callable[["Session", int, bytes, "float | None"], Awaitable["tuple[int, bytes, list[int]]"]]
"""``(session, kind, body, deadline) -> (code, reply body, descriptors)``: one request served (see the module
docstring); the control server closes the descriptors once sent."""


class BodyBudget:
    """The bytes of request bodies being received over every control channel of a node, against a bound.

    Args:
        limit_bytes: the bound, bytes.

    Attributes:
        held_bytes: bytes received of bodies not yet whole.
        refused: frames refused because the budget was spent.
    """

    def __init__(self, limit_bytes: int = BODY_BUDGET_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self.held_bytes = 0
        self.refused = 0

    def take(self, nbytes: int) -> bool:
        """Count ``nbytes`` more; ``False`` (nothing counted) when they would go over the bound."""
        if self.held_bytes + nbytes > self.limit_bytes:
            self.refused += 1
            return False
        self.held_bytes += nbytes
        return True

    def give(self, nbytes: int) -> None:
        """Uncount ``nbytes``."""
        self.held_bytes -= nbytes


class _ChannelEnd(Exception):
    """The channel ends: ``reply`` (a frame, or ``b""``) is sent first."""

    def __init__(self, reply: bytes, reason: str) -> None:
        super().__init__(reason)
        self.reply = reply


class ControlServer:
    """Serves the control channels of one node's sessions.

    Args:
        dispatch: serves one request (see :data:`Dispatch`).
        max_request_bytes: the largest request body, bytes (``server.max_message_bytes``, as gRPC's).
        budget: the node's budget of bodies being received (shared by every channel).
    """

    def __init__(self, dispatch: Dispatch, max_request_bytes: int, budget: BodyBudget | None = None) -> None:
        self._dispatch = dispatch
        self.max_request_bytes = max_request_bytes
        self.budget = budget if budget is not None else BodyBudget()

    async def serve(self, session: Session, sock: socket.socket) -> None:
        """Serve one channel of ``session`` until it ends (see the module docstring); closes ``sock``."""
        loop = asyncio.get_running_loop()
        try:
            sock.setblocking(False)
            while True:
                head = await _recv_exactly(loop, sock, REQUEST_HEAD.size)
                if head is None:
                    return
                try:
                    nbytes, kind, deadline = unpack_request_head(head, self.max_request_bytes)
                    body = await self._body(loop, sock, nbytes, deadline) if nbytes else b""
                except FrameError as exc:
                    code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.oversized else grpc.StatusCode.INVALID_ARGUMENT
                    raise _ChannelEnd(pack_reply(code.value[0], str(exc).encode()), str(exc)) from None
                if body is None:
                    return  # the client went away mid-frame
                code, reply, fds = await self._dispatch(session, kind, body, deadline)
                await _send_reply(loop, sock, pack_reply(code, reply), fds)
        except _ChannelEnd as end:
            logger.info("same-host session %#x: control channel closed: %s", session.session_id, end)
            if end.reply:
                try:
                    await loop.sock_sendall(sock, end.reply)
                except OSError:
                    pass
        except OSError as exc:  # the client went away while its reply was sent
            logger.debug("same-host session %#x: control channel ended: %s", session.session_id, exc)
        finally:
            sock.close()

    async def _body(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, nbytes: int,
                    deadline: float | None) -> bytes | None:
        """A request body of ``nbytes``, read as it arrives under the budget and the body's time bound.

        Returns:
            The body, or ``None`` when the client closed the channel first.

        Raises:
            _ChannelEnd: if it is too slow, or the budget has no room for it.
        """
        timeout_s = BODY_TIMEOUT_S
        if deadline is not None:
            timeout_s = max(0.0, min(timeout_s, deadline - time.monotonic()))
        budget, parts, got = self.budget, [], 0
        try:
            async with asyncio.timeout(timeout_s):
                while got < nbytes:
                    chunk = await loop.sock_recv(sock, min(_RECV_BYTES, nbytes - got))
                    if not chunk:
                        return None
                    if not budget.take(len(chunk)):
                        code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
                        reason = (f"the node is receiving {budget.held_bytes} bytes of control requests at once "
                                  f"(at most {budget.limit_bytes}); send again")
                        raise _ChannelEnd(pack_reply(code, reason.encode()), reason)
                    parts.append(chunk)
                    got += len(chunk)
        except TimeoutError:
            code = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            reason = f"a request body of {nbytes} bytes did not arrive within {timeout_s:.3g} s ({got} bytes did)"
            raise _ChannelEnd(pack_reply(code, reason.encode()), reason) from None
        finally:
            budget.give(got)
        return parts[0] if len(parts) == 1 else b"".join(parts)


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, nbytes: int) -> bytes | None:
    """``nbytes`` (a frame's head: a few bytes) from ``sock``, or ``None`` if it ends first."""
    data = b""
    while len(data) < nbytes:
        chunk = await loop.sock_recv(sock, nbytes - len(data))
        if not chunk:
            return None
        data += chunk
    return data


async def _send_reply(loop: asyncio.AbstractEventLoop, sock: socket.socket, frame: bytes, fds: list[int]) -> None:
    """Send a reply frame, its descriptors with its first bytes (``SCM_RIGHTS``); closes ``fds`` here."""
    try:
        if not fds:
            await loop.sock_sendall(sock, frame)
            return
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        while True:
            try:
                sent = sock.sendmsg([frame], rights)
                break
            except BlockingIOError:  # the client is not reading: wait until it does (its channel, its time)
                writable = loop.create_future()
                loop.add_writer(sock.fileno(), writable.set_result, None)
                try:
                    await writable
                finally:
                    loop.remove_writer(sock.fileno())
        if sent < len(frame):
            await loop.sock_sendall(sock, frame[sent:])
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
