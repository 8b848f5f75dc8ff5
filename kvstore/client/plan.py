"""The client's call layer, with no I/O: a call as data (:class:`Plan` of :class:`Rpc` s), the I/O its logic asks
for, and the :class:`Transport` that performs that I/O.

Every method of both clients is written once (``kvstore.client.core``): it
builds a :class:`Plan` (each node's :class:`Rpc`, and how the nodes' results
merge) and hands it to its client's :meth:`Transport.execute`. The logic of
the call (deadline, retries, fan-out over nodes, the same-host and bulk
paths, membership) is a generator, a :data:`Step`, that yields one operation
at a time and is sent back its outcome:

* :class:`Attempt`: one attempt of an :class:`Rpc` on a node; sent back its result (or its error thrown in);
* :class:`Pause`: sleep; sent back ``None``;
* :class:`Together`: run parts at once; sent back each one's result or exception, in order;
* :class:`Slot` (:data:`SLOT`): take an in-flight slot; sent back the function that releases it;
* :class:`Probe`: start a health probe in the background; sent back ``None``;
* :class:`SessionOf`: a node's same-host session, attached first if it is time to; sent back it or ``None``;
* :class:`BulkOf`: a node's bulk endpoint, asked for first if it is time to; sent back it or ``None``.

The synchronous transport (:class:`~kvstore.client.KVStoreClient`) performs
them in the calling thread and worker threads, the asyncio one
(:class:`~kvstore.client.AsyncKVStoreClient`) on its loop, as redis-py's
command layer is shared by its two clients with the connection apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator, NamedTuple, Protocol, TypeVar

from kvstore.errors import InvalidArgumentError, KVStoreError

if TYPE_CHECKING:
    import grpc

    from kvstore.bulk.client.link import BulkLink, Endpoint
    from kvstore.client.channel import TargetChannel
    from kvstore.shm.client.link import SharedMemoryLink, SharedSession

_T = TypeVar("_T")

UNARY, REPLY_STREAM, REQUEST_STREAM = range(3)
"""The kinds of :class:`Rpc`: one request and one reply; a stream of replies (Get); a stream of requests (Put)."""


class RequestStream:
    """The serialized messages of a Put (a ``REQUEST_STREAM`` request), remembering an error raised making them.

    gRPC pulls a request iterator on its own side of the call and reports an
    error raised there only as UNKNOWN (sync) or a cancellation of the call
    (asyncio); the transport gets the real error back from :meth:`raise_error`.

    Args:
        messages: the serialized messages (:func:`kvstore.wire.put_requests`).

    Attributes:
        error: the error raised making a message, ``None`` while there is none.
    """

    def __init__(self, messages: Iterator[bytes]) -> None:
        self._messages = messages
        self.error: Exception | None = None

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> bytes:
        try:
            return next(self._messages)
        except StopIteration:
            raise
        except Exception as exc:
            self.error = exc
            raise

    def raise_error(self) -> None:
        """Raise the error of making the messages, if there was one.

        Raises:
            KVStoreError: that error, if it was one of kvstore's.
            InvalidArgumentError: for any other error (a request that cannot be serialized).
        """
        if isinstance(self.error, KVStoreError):
            raise self.error
        if self.error is not None:
            raise InvalidArgumentError(f"cannot serialize the Put request: {self.error!r}") from self.error


class Rpc(NamedTuple):
    """One node's part of a call: what one attempt sends, and how its reply becomes a result.

    Attributes:
        kind: :data:`UNARY`, :data:`REPLY_STREAM` (Get) or :data:`REQUEST_STREAM` (Put).
        method: the channel's multicallable for the call (``TargetChannel -> callable``).
        request: the request (a message or serialized bytes); for ``REQUEST_STREAM``,
            a function making a fresh :class:`RequestStream` for each attempt.
        read: ``reply -> result``; for ``REPLY_STREAM``, a function making a fresh
            assembler (``add_reply(bytes)``, ``finish() -> result``) for each attempt.
        rescue: ``error -> result`` for a status that is an answer (health's NOT_FOUND), else ``None``.
        wait_for_ready: wait for the channel's connection within the deadline (a probe of a down node).
        shared: for a call the same-host data plane can carry, ``session -> (rpc, done)`` making this
            attempt's part on it (``None`` when it cannot take this one: gRPC then); ``done`` (or ``None``)
            is called once the attempt's outcome is known (a Put's staged range is given back).
        bulk: for a call the bulk path can carry (``kvstore.bulk``), ``(link, endpoint) -> rpc`` making this
            attempt's part on it (a ``BulkGet`` or ``BulkPut`` whose method then moves the bytes).
    """

    kind: int
    method: Callable[[TargetChannel], Any]
    request: Any
    read: Callable[..., Any]
    rescue: Callable[[grpc.RpcError], Any] | None = None
    wait_for_ready: bool = False
    shared: Callable[[SharedSession], tuple[Rpc, Callable[[], None] | None] | None] | None = None
    bulk: Callable[[BulkLink, Endpoint], Rpc] | None = None


class Plan(NamedTuple):
    """A whole call: each node's part, and how the per-node results merge.

    Attributes:
        rpcs: each node's part, by the node's index in router order.
        merge: ``results -> the call's result``; ``results`` has one entry per node of the client, in router
            order, ``None`` for a node with no part or that is down.
    """

    rpcs: dict[int, Rpc]
    merge: Callable[[list[Any]], Any]


class Attempt(NamedTuple):
    """Make one attempt of ``rpc`` on node ``node``, with ``timeout_s`` (seconds) as its deadline."""

    node: int
    rpc: Rpc
    timeout_s: float


class Pause(NamedTuple):
    """Sleep ``seconds`` (a retry's backoff)."""

    seconds: float


class Together(NamedTuple):
    """Run ``parts`` at once, each a :data:`Step`; send back each one's result or exception, in order.

    Attributes:
        parts: the steps.
        deadline: the call's, by ``time.monotonic()``: a part not started by then is a miss (``None``).
    """

    parts: list[Generator[Any, Any, Any]]
    deadline: float


class Slot(NamedTuple):
    """Take one of the client's in-flight slots (``max_inflight``); send back the function that releases it."""


class Probe(NamedTuple):
    """Start a health probe of the down node ``node_id`` in the background (a step of the client's own)."""

    node_id: str


class SessionOf(NamedTuple):
    """The same-host session of ``link``, attached first if it is time to try; send back it or ``None``.

    Attributes:
        link: the node's same-host link.
        timeout_s: the longest an attach may take (what is left of the call's deadline), seconds.
    """

    link: SharedMemoryLink
    timeout_s: float


class BulkOf(NamedTuple):
    """The bulk endpoint of ``link``, asked for first if it is time to; send back it or ``None``.

    Attributes:
        link: the node's bulk link.
        timeout_s: the longest asking may take (what is left of the call's deadline), seconds.
    """

    link: BulkLink
    timeout_s: float


SLOT = Slot()
"""The one :class:`Slot` (it has no fields)."""

Step = Generator[Any, Any, _T]
"""The logic of a call, or of a part of one: yields operations, is sent their outcomes, returns its result."""

RETURNED = object()
"""What :meth:`Outcome.send_into` answers when the step returned (its result is then :attr:`Outcome.value`)."""


class Outcome:
    """What the last operation a step asked for gave, a value or an error, to send into the step.

    A transport's loop: ``while (op := outcome.send_into(step)) is not RETURNED``, setting :attr:`value` or
    :attr:`error` from performing ``op``; then :attr:`value` is the step's result.

    Attributes:
        value: the operation's result (or, once the step returned, the step's).
        error: the operation's error, ``None`` if it had none.
    """

    __slots__ = ("value", "error")

    def __init__(self) -> None:
        self.value: Any = None
        self.error: BaseException | None = None

    def send_into(self, step: Step[Any]) -> Any:
        """Resume ``step`` with this outcome, and clear it.

        Returns:
            The next operation the step asks for, or :data:`RETURNED` (its result is then :attr:`value`).

        Raises:
            BaseException: whatever the step raises.
        """
        value, error = self.value, self.error
        self.value, self.error = None, None
        try:
            return step.throw(error) if error is not None else step.send(value)
        except StopIteration as stop:
            self.value = stop.value
            return RETURNED


class Transport(Protocol):
    """What performs a plan's I/O: each client is one (redis-py's ``execute_command``, for plans).

    :class:`~kvstore.client.KVStoreClient` performs it in the calling thread and
    worker threads and returns the result; :class:`~kvstore.client.AsyncKVStoreClient`
    returns an awaitable of it, performed on the running loop.
    """

    def execute(self, plan: Plan) -> Any:
        """Perform ``plan`` under the client's deadline, slots, retries and membership (see the module docstring).

        Returns:
            The plan's merged result, or (asyncio) an awaitable of it.

        Raises:
            KVStoreError: the typed error of the call (:class:`~kvstore.errors.UnavailableError`, ...).
        """
        ...
