"""A call's failure as its transport sends it back: a status code and its details (``NodeService.scope``)."""

from __future__ import annotations

import grpc


class CallFailed(Exception):
    """A call ended with a status other than OK (:meth:`NodeService.scope`): what its transport sends back.

    Attributes:
        code: the gRPC status code.
        message: its details.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
