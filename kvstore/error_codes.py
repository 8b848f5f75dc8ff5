"""The one mapping between kvstore's typed errors and gRPC status codes, used by the server and the clients.

Server side, :func:`status_of` turns an exception raised by the store into a
status code and a message (gRPC's own guidance in ``doc/statuscodes.md``):

=============================  ======================  ==========================================
exception                      status code             typical cause
=============================  ======================  ==========================================
InvalidArgumentError (+codec)  INVALID_ARGUMENT        bad hash, namespace, dtype, header, checksum
ResourceExhaustedError         RESOURCE_EXHAUSTED      block over max_block_bytes, no room to evict,
                                                       tenant quota spent, too many calls in flight
UnauthenticatedError           UNAUTHENTICATED         no bearer token, or an unknown one
PermissionDeniedError          PERMISSION_DENIED       the token does not cover the namespace's tenant
FailedPreconditionError        FAILED_PRECONDITION     a same-host session that ended (attach again)
UnavailableError               UNAVAILABLE             store closed, server shutting down
DeadlineExceededError          DEADLINE_EXCEEDED       the call's deadline passed
anything else                  INTERNAL                a bug; logged with its traceback
=============================  ======================  ==========================================

Client side, :func:`error_of` turns a status back into the typed error, so a
caller of ``KVStoreClient`` catches the same exceptions as a caller of the
embedded store.
"""

from __future__ import annotations

import grpc

from kvstore.errors import InvalidArgumentError, KVStoreError, ResourceExhaustedError, UnavailableError


class DeadlineExceededError(UnavailableError, TimeoutError):
    """A call's deadline passed before it finished (gRPC DEADLINE_EXCEEDED).

    A subclass of :class:`UnavailableError` (the service did not answer in time)
    and of the built-in :class:`TimeoutError`.
    """


class RemoteError(KVStoreError):
    """A status with no more specific kvstore error (e.g. INTERNAL, UNIMPLEMENTED); base of the auth errors.

    Attributes:
        code: the gRPC status code.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


class UnauthenticatedError(RemoteError):
    """A call carried no bearer token, or one the server does not know (gRPC UNAUTHENTICATED).

    Raised by the server's call guard (``kvstore.server.auth``) and, client
    side, by :func:`error_of`. The message never repeats the token.
    """

    def __init__(self, message: str) -> None:
        KVStoreError.__init__(self, message)
        self.code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(RemoteError):
    """A valid token that does not cover the tenant (``cache_salt``) of the call's namespace (PERMISSION_DENIED)."""

    def __init__(self, message: str) -> None:
        KVStoreError.__init__(self, message)
        self.code = grpc.StatusCode.PERMISSION_DENIED


class FailedPreconditionError(RemoteError):
    """The call names state the node no longer has, e.g. a same-host session that ended (FAILED_PRECONDITION).

    The client sets that state up again (it attaches again) rather than retrying the call as it is.
    """

    def __init__(self, message: str) -> None:
        KVStoreError.__init__(self, message)
        self.code = grpc.StatusCode.FAILED_PRECONDITION


_ERROR_TO_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    # most specific first: DeadlineExceededError is also an UnavailableError
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
)

_STATUS_TO_ERROR: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
}

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
"""Status codes a client retries (idempotent calls only): the server is restarting or shutting down."""


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message that report ``exc`` to a client.

    Args:
        exc: an exception raised while serving a call.

    Returns:
        ``(code, message)``; unknown exceptions are ``INTERNAL`` with their type
        name only, so no internals leak to clients.
    """
    for error_type, code in _ERROR_TO_STATUS:
        if isinstance(exc, error_type):
            return code, str(exc) or type(exc).__name__
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"


def error_of(code: grpc.StatusCode, details: str | None) -> KVStoreError:
    """The typed kvstore error of a status received by a client.

    Args:
        code: the call's status code (not ``OK``).
        details: the status message.

    Returns:
        An :class:`InvalidArgumentError`, :class:`ResourceExhaustedError`,
        :class:`UnavailableError`, :class:`DeadlineExceededError`,
        :class:`UnauthenticatedError`, :class:`PermissionDeniedError` or, for
        any other code, a :class:`RemoteError` carrying it.
    """
    message = details or code.name
    error_type = _STATUS_TO_ERROR.get(code)
    if error_type is None:
        return RemoteError(code, message)
    return error_type(message)
