"""gRPC options and message sizes shared by the server and the clients."""

from __future__ import annotations

import grpc
import grpc.experimental

MESSAGE_OVERHEAD_BYTES = 4096
"""Room left in every data message for its other fields (namespace, hash, offsets), bytes."""


def chunk_bytes_for(max_message_bytes: int) -> int:
    """The largest block chunk that fits a message of ``max_message_bytes`` with its other fields, bytes."""
    return max(1, max_message_bytes - MESSAGE_OVERHEAD_BYTES)


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC options shared by the server and the clients: both message-size limits.

    Args:
        max_message_bytes: largest message sent or received, bytes.
    """
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def sync_client_channel_options(max_message_bytes: int) -> list[tuple[str, int | str]]:
    """Options of a synchronous client channel: :func:`channel_options` plus single-threaded streams.

    ``grpc.experimental.ChannelOptions.SingleThreadedUnaryStream`` makes a
    unary-stream call (Get) read its replies on the calling thread; without it
    gRPC's synchronous channel starts a helper thread per call, about 0.2 ms on
    this machine class (``benchmarks/bench_service.py``). The option is
    experimental in grpcio and ignored by ``grpc.aio`` channels.

    Args:
        max_message_bytes: largest message sent or received, bytes.
    """
    return [*channel_options(max_message_bytes), (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]
