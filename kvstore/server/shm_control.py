"""The node's side of a session's control channels: each frame served by the servicer's own method of its kind.

A request (``kvstore.shm.frames``) runs the servicer's ``Lookup``,
``GetShared`` or ``PutShared`` handler itself, in a task of its own, with a
:class:`ControlContext` in place of grpc.aio's: the same admission (the
session's ``Attach`` token, checked again on every call against the node's
tokens; the in-flight limit, one "connection" per session), the same tenant,
hash, limit and quota checks, the same metrics and status mapping. Only the
transport differs. Another client, of this tenant or another, cannot reach a
session's channels: they are socket pairs whose client ends the node handed to
the session's process alone (``SCM_RIGHTS``), after that session's grant.

A channel ends when its client closes it or dies (end of file, possibly
mid-frame), on a malformed or oversized head (answered with its status first),
or when the session ends. None of these touches anything beyond the channel.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import TYPE_CHECKING, Any, Sequence

import grpc

from kvstore.shm.frames import KINDS, REQUEST_HEAD, FrameError, pack_reply, unpack_request_head

if TYPE_CHECKING:
    from kvstore.shm.sessions import Session

logger = logging.getLogger(__name__)

_AUTH_KEY = "authorization"


class _ControlAbort(grpc.aio.AbortError):
    """``ControlContext.abort``: the call ends with ``code`` and ``details`` (caught by the channel's loop)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.status = code
        self.message = details


class ControlContext:
    """What the servicer's handlers use of a ``grpc.aio.ServicerContext``, for one control-channel call.

    Args:
        peer: the "connection" the in-flight limit counts this call against (one per session).
        metadata: the session's ``Attach`` call's ``authorization`` entry (empty without one).
        deadline: ``time.monotonic()`` seconds by which the client wants the call done, ``None`` for none.
    """

    __slots__ = ("_peer", "_metadata", "_deadline")

    def __init__(self, peer: str, metadata: Sequence[tuple[str, Any]], deadline: float | None) -> None:
        self._peer = peer
        self._metadata = tuple(metadata)
        self._deadline = deadline

    def peer(self) -> str:
        """The session's name, as the in-flight limit's connection."""
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        """The ``Attach`` call's token entry: each call is authenticated again with it."""
        return self._metadata

    def time_remaining(self) -> float | None:
        """Seconds left before the client's deadline (``CLOCK_MONOTONIC``, one clock per host), ``None`` for none."""
        if self._deadline is None:
            return None
        return self._deadline - time.monotonic()

    def cancelled(self) -> bool:
        """Always ``False``: a client that goes away is seen when its reply cannot be sent."""
        return False

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        """End the call with a status (raises)."""
        raise _ControlAbort(code, details)

    def set_code(self, code: grpc.StatusCode) -> None:  # pragma: no cover - not used by these handlers
        """Unused (the handlers end with :meth:`abort`)."""

    def set_details(self, details: str) -> None:  # pragma: no cover
        """Unused."""


class ControlServer:
    """Serves the control channels of one servicer's sessions.

    Args:
        servicer: the ``KVStoreServicer`` whose handlers serve the frames.
        max_request_bytes: the largest request body, bytes (``server.max_message_bytes``, as gRPC's).

    Attributes:
        metadata: each session's ``Attach`` token entry, by session id (kept while its stream lasts).
    """

    def __init__(self, servicer: Any, max_request_bytes: int) -> None:
        self._servicer = servicer
        self.max_request_bytes = max_request_bytes
        self.metadata: dict[int, tuple[tuple[str, Any], ...]] = {}

    def remember(self, session_id: int, invocation_metadata: Sequence[tuple[str, Any]] | None) -> None:
        """Keep the token entry of the ``Attach`` call that opened ``session_id``."""
        self.metadata[session_id] = tuple((k, v) for k, v in (invocation_metadata or ()) if k.lower() == _AUTH_KEY)

    def forget(self, session_id: int) -> None:
        """The session ended: its calls are no longer admitted."""
        self.metadata.pop(session_id, None)

    async def serve(self, session: Session, sock: socket.socket) -> None:
        """Serve one channel of ``session`` until it ends (see the module docstring); closes ``sock``."""
        loop = asyncio.get_running_loop()
        peer = f"shm-session:{session.session_id:x}"
        try:
            sock.setblocking(False)
            while True:
                head = await _recv_exactly(loop, sock, REQUEST_HEAD.size)
                if head is None:
                    return
                try:
                    nbytes, kind, deadline = unpack_request_head(head, self.max_request_bytes)
                except FrameError as exc:
                    code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.oversized else grpc.StatusCode.INVALID_ARGUMENT
                    logger.info("same-host session %#x: control channel closed: %s", session.session_id, exc)
                    await loop.sock_sendall(sock, pack_reply(code.value[0], str(exc).encode()))
                    return
                body = await _recv_exactly(loop, sock, nbytes) if nbytes else b""
                if body is None:
                    return  # the client went away mid-frame
                metadata = self.metadata.get(session.session_id, ())
                context = ControlContext(peer, metadata, deadline)
                await loop.sock_sendall(sock, await self._handle(kind, body, context))
        except OSError as exc:  # the client went away while its reply was sent
            logger.debug("same-host session %#x: control channel ended: %s", session.session_id, exc)
        finally:
            sock.close()

    async def _handle(self, kind: int, body: bytes, context: ControlContext) -> bytes:
        """One call's reply frame. Its own task: a call's end (its slot, its count) is tied to its task's end."""
        handler = getattr(self._servicer, KINDS[kind])
        task = asyncio.get_running_loop().create_task(handler(body, context))
        try:
            reply = await task
        except _ControlAbort as abort:
            return pack_reply(abort.status.value[0], abort.message.encode())
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                task.cancel()
                raise
            # the handler ended the call as over already: its deadline passed
            return pack_reply(grpc.StatusCode.DEADLINE_EXCEEDED.value[0], b"the deadline passed on the node")
        except Exception as exc:  # noqa: BLE001 - the handlers map every kvstore error; anything else is a bug
            logger.error("control call %s failed", KINDS[kind], exc_info=exc)
            return pack_reply(grpc.StatusCode.INTERNAL.value[0], f"{type(exc).__name__}: {exc}".encode())
        return pack_reply(0, reply.SerializeToString())


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, nbytes: int) -> bytes | None:
    """``nbytes`` from ``sock``, or ``None`` if it ends first."""
    buffer = bytearray(nbytes)
    view, got = memoryview(buffer), 0
    while got < nbytes:
        n = await loop.sock_recv_into(sock, view[got:])
        if not n:
            return None
        got += n
    return bytes(buffer)
