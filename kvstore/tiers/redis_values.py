"""Values and keys of the Redis tier: batch sizes, checksum verdicts, key generations, chunking.

Keys and values. A :data:`~kvstore.keys.BlockKey` (``namespace tag (8 bytes) ||
block hash``) is stored under ``<prefix>:<tag hex>:<generation>:<block hash hex>``,
e.g. ``kvstore:1f2e3d4c5b6a7988:0:00112233445566778899aabbccddeeff``, so one
namespace can be found with ``SCAN MATCH <prefix>:<tag hex>:*``. The value is the
block's codec bytes (:mod:`kvstore.blocks.tensors`), header and checksum included; a get
verifies the checksum, which covers every byte, and a corrupt value is a miss,
is deleted and is counted; the store then checks the header against the
request's namespace. A block of another codec version (a node of another
release sharing the Redis) is a miss that is left in place.

Generations. Each namespace has a generation, kept in Redis under
``<prefix>:<tag hex>:generation`` (missing: 0) and part of every key of the
namespace. A clear increments it (``INCR``), on whichever node it runs: every
call reads the generation beside its own command, so from then on no node reads
or writes the old keys, which are unlinked later (:meth:`RedisTier.sweep_namespace`,
``SCAN`` + ``UNLINK``) or age out. A call that finds the namespace moved on
(cleared by another node) is made again under the new generation.

Batches. A get is one ``MGET`` per chunk of about :data:`CHUNK_BYTES` (in a
cluster, ``mget_nonatomic``: one ``MGET`` per slot, pipelined per node); puts,
existence checks and deletes are non-transactional pipelines. Large batches are
cut into chunks because redis-py bounds the whole send of a pipeline, and the
whole read of one reply, by ``socket_timeout_s``: a chunk must cross the network
within it. Checksums are verified on the event loop (xxh3 runs at about
20 GB/s: 0.4 ms for a full chunk); a chunk of at least
:data:`VERIFY_OFFLOAD_BYTES` (a single very large value) is verified in a worker
thread while the next chunk is fetched.
"""

from __future__ import annotations

from typing import Sequence

from kvstore.blocks.format import verify_block
from kvstore.errors import CodecError, UnsupportedVersionError
from kvstore.keys import NAMESPACE_TAG_BYTES, BlockKey

KiB = 1024
MiB = 1024 * KiB

CHUNK_BYTES = 8 * MiB
"""Bytes of values one round trip carries at most (one value larger than this goes alone).

With ``socket_timeout_s`` of 0.5 s this needs at least 16 MiB/s between the
store and Redis; raise ``socket_timeout_s`` for slower links or larger blocks.
"""

VERIFY_OFFLOAD_BYTES = 16 * MiB
"""Chunks of at least this many bytes are checksummed in a worker thread, not on the event loop.

Above a chunk's size, so only single very large values go to a thread: on a
busy host the hand-off cost more than the 0.4 ms an 8 MiB checksum takes.
"""

DEFAULT_VALUE_BYTES_HINT = 64 * KiB
"""Assumed value size for cutting the first gets into chunks, before any value size was seen."""

SCAN_COUNT = 1000
"""``COUNT`` hint of each ``SCAN`` step of :meth:`RedisTier.clear_namespace`, and keys per ``UNLINK`` batch."""

DEFAULT_PROTO_MAX_BULK_LEN = 512 * MiB
"""Redis' default ``proto-max-bulk-len``, used when ``CONFIG GET`` is not allowed."""

GOOD, CORRUPT, FOREIGN = 0, 1, 2
"""Verdicts of :func:`verify_all` on one value: intact (or a miss), corrupt (to delete), another release's (a miss
kept)."""


def verify_all(values: Sequence[bytes | None]) -> list[int]:
    """Each value's verdict (:func:`kvstore.blocks.format.verify_block`): good (a ``None`` miss too), corrupt, or foreign.

    A foreign value is a kvstore block of another format version, written by a
    node of another release sharing this Redis: a miss, but not deleted, since
    that node may still read it (``docs/redis.md``).
    """
    verdicts = []
    for value in values:
        if value is None:
            verdicts.append(GOOD)
            continue
        try:
            verify_block(value)
        except UnsupportedVersionError:
            verdicts.append(FOREIGN)
        except CodecError:
            verdicts.append(CORRUPT)
        else:
            verdicts.append(GOOD)
    return verdicts



def positions_by_namespace(keys: Sequence[BlockKey]) -> dict[bytes, list[int]]:
    """The positions of ``keys`` by namespace tag, in order (a store's call has one namespace)."""
    groups: dict[bytes, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key[:NAMESPACE_TAG_BYTES], []).append(i)
    return groups


def generation_of(name: bytes | str) -> int:
    """The generation field of a block's Redis key (``<prefix>:<tag>:<generation>:<hash>``); a key of another form
    (the generation key itself, an older release's ``<prefix>:<tag>:<hash>``) reads as the newest, -1 for old keys."""
    parts = (name.decode() if isinstance(name, bytes) else name).split(":")
    if len(parts) == 4 and parts[2].isdigit():
        return int(parts[2])
    if len(parts) == 3 and parts[2] != "generation":
        return -1  # an older release's key, with no generation: always old
    return 1 << 62


def chunks_by_bytes(sizes: Sequence[int], limit_bytes: int) -> list[range]:
    """Cut ``range(len(sizes))`` into consecutive runs of at most ``limit_bytes`` (at least one item each)."""
    chunks: list[range] = []
    start, total = 0, 0
    for i, nbytes in enumerate(sizes):
        if i > start and total + nbytes > limit_bytes:
            chunks.append(range(start, i))
            start, total = i, 0
        total += nbytes
    if start < len(sizes):
        chunks.append(range(start, len(sizes)))
    return chunks
