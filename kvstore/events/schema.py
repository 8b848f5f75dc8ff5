"""The wire schema of kvstore's KV events: vLLM's event batch, with kvstore's fields added (``docs/events.md``).

The node publishes batches in vLLM's framing (``vllm/distributed/kv_events.py``,
vLLM 0.32): three ZMQ frames, the topic, an 8-byte big-endian sequence number
and the msgpack of a batch. A batch is ``[ts, events, data_parallel_rank]`` (an
array, as vLLM's ``EventBatch``) and each event a map tagged by its ``type``,
one of vLLM's three: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``.
The fields vLLM requires are always sent, so vLLM's own ``KVEventBatch``
decoder reads kvstore's stream unchanged; it ignores the fields kvstore adds
(``namespace``, ``reason``, ``from_medium``), which kvstore's decoder here reads.

Events carry block hashes and namespace tags, never token ids (``token_ids`` is
always empty) nor KV bytes.
"""

from __future__ import annotations

import msgspec

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of the replay socket's end marker (vLLM's ``ZmqEventPublisher.END_SEQ``)."""

REMOVED_EVICTED = "evicted"
"""``BlockRemoved.reason``: dropped to make room (no lower tier took it)."""
REMOVED_MOVED = "moved"
"""``BlockRemoved.reason``: moved to another tier; a ``BlockStored`` with ``from_medium`` set follows."""
REMOVED_DELETED = "deleted"
"""``BlockRemoved.reason``: deleted by a client (``Delete``)."""
REMOVED_CLEARED = "cleared"
"""``BlockRemoved.reason``: its namespace was cleared (``Clear``); an ``AllBlocksCleared`` of it comes first."""
REMOVED_LOST = "lost"
"""``BlockRemoved.reason``: its tier could not serve it (unreadable, corrupt, or of another layout): forgotten."""

CLEARED_START = "start"
"""``AllBlocksCleared.reason``: the node (re)started; forget everything it published before."""
CLEARED_NAMESPACE = "namespace"
"""``AllBlocksCleared.reason``: one namespace (``namespace``) was cleared."""
CLEARED_OVERFLOW = "overflow"
"""``AllBlocksCleared.reason``: the node dropped events (its log was full): forget everything it published before."""


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """The base of the events: a map tagged ``type`` with the class name (as vLLM's ``KVCacheEvent``)."""


class BlockStored(KVCacheEvent):
    """Blocks became resident in one tier of one node.

    Attributes:
        block_hashes: the blocks' kvstore hashes (``bytes``, 16 or 32 bytes, ``kvstore.keys``), in no
            particular order (a batch of a put, a move or a restart).
        parent_block_hash: always ``None`` (kvstore indexes blocks, not chains).
        token_ids: always empty: events never carry tokens.
        block_size: tokens per block when the node knows it, else 0 (the namespace names it).
        lora_id: always ``None`` (the adapter is part of the namespace).
        medium: the tier that holds them now (``memory``, ``disk``: the tier's name).
        lora_name: always ``None``.
        namespace: the 8-byte namespace tag (``Namespace.tag``).
        from_medium: for a move, the tier they left (a ``BlockRemoved`` with reason ``moved`` came first);
            ``None`` for a put or a restart.
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    namespace: bytes = b""
    from_medium: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left one tier of one node.

    Attributes:
        block_hashes: the blocks' kvstore hashes.
        medium: the tier they left.
        namespace: the 8-byte namespace tag.
        reason: one of the ``REMOVED_*`` constants (``evicted``, ``moved``, ``deleted``, ``cleared``, ``lost``).
    """

    block_hashes: list[bytes]
    medium: str | None
    namespace: bytes = b""
    reason: str = ""


class AllBlocksCleared(KVCacheEvent):
    """Forget blocks: all of one namespace (``namespace`` set), or everything the node published (``b""``).

    Attributes:
        namespace: the cleared namespace's tag; empty for the whole node (a start or an overflow).
        reason: one of the ``CLEARED_*`` constants.
    """

    namespace: bytes = b""
    reason: str = ""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published batch: ``[ts, events, data_parallel_rank]`` (vLLM's ``EventBatch``).

    Attributes:
        ts: wall-clock time the batch was cut, seconds since the epoch.
        events: the events, in the order they happened on the node.
        data_parallel_rank: always ``None`` for a node (vLLM's engines set theirs).
    """

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def encoder() -> msgspec.msgpack.Encoder:
    """A msgpack encoder of :class:`KVEventBatch` (one per thread: msgspec encoders are not shared)."""
    return msgspec.msgpack.Encoder()


def decoder() -> msgspec.msgpack.Decoder[KVEventBatch]:
    """A msgpack decoder of :class:`KVEventBatch`.

    Raises (on ``decode``):
        msgspec.DecodeError: on bytes that are not such a batch.
    """
    return msgspec.msgpack.Decoder(KVEventBatch)
