"""bench_peers' raw-socket server: the other end of ``RawSocketDriver``, in a process of its own.

Usage: ``python rawsock.py PAYLOAD_FILE``. It listens on a free loopback port,
prints the port on stdout, then serves one connection after another: ``G``
sends the payload of a kind with ``sendall``; ``P`` receives a kind's bytes
with ``recv_into`` into a buffer allocated once, then sends one byte 1;
``R`` sends back what the last ``P`` of that kind received. No copies besides
the kernel's.
"""

from __future__ import annotations

import socket
import sys

import torch

from drivers import KINDS, RAW_HEADER, Payload


def _recv_exactly(conn: socket.socket, view: memoryview) -> bool:
    received = 0
    while received < len(view):
        n = conn.recv_into(view[received:])
        if n == 0:
            return False
        received += n
    return True


def serve(conn: socket.socket, payload: Payload, received: dict[str, torch.Tensor]) -> None:
    """Answer one connection's requests until it closes."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    header = bytearray(RAW_HEADER.size)
    while _recv_exactly(conn, memoryview(header)):
        op, kind_index, nbytes = RAW_HEADER.unpack(header)
        kind = KINDS[kind_index[0]]
        stored = memoryview(payload.expected[kind].view(torch.uint8).numpy()).cast("B")
        landed = memoryview(received[kind].numpy()).cast("B")
        if nbytes != len(stored):
            raise ValueError(f"request for {nbytes} bytes of {kind}, which has {len(stored)}")
        if op == b"G":
            conn.sendall(stored)
        elif op == b"P":
            if not _recv_exactly(conn, landed):
                return
            conn.sendall(b"\x01")
        elif op == b"R":
            conn.sendall(landed)
        else:
            raise ValueError(f"unknown op {op!r}")


def main() -> int:
    """Listen on 127.0.0.1, print the port, serve connections until killed."""
    payload = Payload(sys.argv[1])
    received = {kind: torch.zeros(payload.expected[kind].numel() * 2, dtype=torch.uint8) for kind in KINDS}
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        print(listener.getsockname()[1], flush=True)
        while True:
            conn, _ = listener.accept()
            with conn:
                serve(conn, payload, received)


if __name__ == "__main__":
    sys.exit(main())
