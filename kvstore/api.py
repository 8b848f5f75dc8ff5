"""The block-store API shared by the embedded store and the gRPC clients, so connectors work with either."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence, Union, runtime_checkable

if TYPE_CHECKING:
    import torch

    from kvstore.blocks.lease import BlockLease

from kvstore.keys import BlockHash, Namespace


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest cached prefix of a list of block hashes.

    Attributes:
        num_blocks: length of the cached prefix, in blocks; block ``i`` is cached
            for every ``i < num_blocks`` (prefix semantics: the first miss ends it).
        tiers: name of the tier holding each block of the prefix, ``len == num_blocks``.
    """

    num_blocks: int
    tiers: tuple[str, ...] = ()

    @classmethod
    def from_block_tiers(cls, block_tiers: bytes, tier_names: Sequence[str]) -> LookupResult:
        """The result whose block ``i`` is in tier ``tier_names[block_tiers[i]]`` (the wire's compact form).

        Raises:
            IndexError: if a tier index is not below ``len(tier_names)``.
        """
        num_blocks = len(block_tiers)
        if num_blocks > 1 and block_tiers.count(block_tiers[0]) == num_blocks:  # the usual prefix, in one tier
            return cls(num_blocks, (tier_names[block_tiers[0]],) * num_blocks)
        if num_blocks > 1:  # itemgetter builds the tuple in C: 1,024 blocks in ~15 us
            return cls(num_blocks, operator.itemgetter(*block_tiers)(tuple(tier_names)))
        return cls(num_blocks, tuple(tier_names[i] for i in block_tiers))


@dataclass(frozen=True, slots=True)
class TierStats:
    """Counts of one tier since the store opened.

    Attributes:
        name: tier name (``memory``, ``disk``, ``redis``).
        blocks: blocks resident (``-1`` when the tier cannot tell, e.g. shared Redis).
        bytes: capacity bytes those blocks occupy: what the tier stores (a lossy block's codes and scales, a
            compressed frame's length), rounded as the tier allocates.
        logical_bytes: bytes of the tensors those blocks hold as the engine holds them (decoded and
            uncompressed: ``prod(shape) * itemsize`` from each block's header); 0 for a shared tier (Redis),
            which the node does not index. ``logical_bytes / bytes`` is :attr:`logical_ratio`.
        capacity_bytes: capacity, bytes; 0 when the tier manages its own (Redis).
        hits: blocks a get served from this tier.
        misses: blocks a lookup or a get asked this tier for and it could not serve: a get's blocks served
            from a tier below, the first block a get found in no tier, every block a lookup asked for past
            the cached prefix. Defined once, in ``docs/service.md``.
        evictions: blocks that left this tier to make room, or as the store closed (demoted or dropped).
        demotions: blocks written into this tier by an eviction from the tier above.
        promotions: blocks copied from this tier into the top tier after a hit.
        corrupt_records: records that failed their checksum and were deleted.
        counters: further tier-specific counts (e.g. Redis ``errors``, ``skipped_writes``).
        pinned_bytes: capacity bytes of its blocks whose TTL runs (``docs/agentic.md``); 0 for a shared tier.
        state: ``up`` or ``down`` for a tier that can be unreachable (the shared Redis tier: ``down``
            from a failed round trip, its first at start included, until one succeeds); ``""`` for the others.
        last_error: the tier's last failure, e.g. ``ConnectionError: ... (at 2026-01-02T03:04:05Z)``; ``""`` if none.
    """

    name: str
    blocks: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    logical_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    corrupt_records: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    state: str = ""
    last_error: str = ""
    pinned_bytes: int = 0

    @property
    def logical_ratio(self) -> float:
        """Logical bytes per stored byte (``logical_bytes / bytes``): 2.0 for int8 blocks of bfloat16, more with
        compression; 0.0 when the tier holds nothing or cannot tell."""
        return self.logical_bytes / self.bytes if self.bytes > 0 and self.logical_bytes > 0 else 0.0


def merge_tier_status(merged: dict[str, object], tier: TierStats) -> dict[str, str]:
    """The ``state`` and ``last_error`` of one tier over several nodes: ``down`` if any node says so.

    Args:
        merged: the tier's fields merged so far (``state`` and ``last_error`` among them, or neither).
        tier: one more node's stats of the tier.
    """
    state, error = str(merged.get("state", "")), str(merged.get("last_error", ""))
    if tier.state == "down" or not state:
        state = tier.state or state
    return {"state": state, "last_error": error or tier.last_error}


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Stats of every tier, fastest first, and of lookups.

    Attributes:
        tiers: per tier, fastest first.
        lookup_hit_blocks: blocks that lookups found cached (the prefix length, summed over lookups).
        lookup_miss_blocks: blocks that lookups asked for past the cached prefix. The
            prefix hit ratio of the traffic is ``hit / (hit + miss)``; each of those
            blocks is also a miss of every tier (``docs/service.md``, "Metrics").
        lookup_blocks_by_tenant: the same two counts, ``(hit, miss)``, by tenant: ``default`` for the
            namespaces without a ``cache_salt``, else ``t-`` and 8 hex digits of the salt's SHA-256 (a salt
            may be a secret; ``kvstore.store.counts.tenant_label``), at most ``kvstore.store.counts.MAX_TENANTS`` of
            them and ``other`` for the rest. The node's own stats (``/metrics``); not sent by ``Stats``.
        missed_blocks: blocks missed by cause (``kvstore.store.misses.CAUSES``): those of lookups, which sum to
            ``lookup_miss_blocks``, and ``lease_lost``, the blocks gets asked for and did not get.
        reuse_gap_counts: per bucket of ``kvstore.store.misses.REUSE_GAP_BUCKETS_S`` (then ``+Inf``), the missed blocks
            requested that many seconds after their eviction: mass at short gaps says the cache is too small.
        reuse_gap_sum_s: the sum of those gaps, seconds.
        counters: node-wide counts of sessions and TTLs (``docs/agentic.md``): ``pinned_bytes``,
            ``pins_refused_tier``, ``pins_refused_node``, ``pins_refused_tenant``, ``pins_displaced``,
            ``ttl_clamped``, ``sessions``,
            ``cooled_chains``, ``bounded_puts``, ``miss_history_blocks``.
    """

    tiers: tuple[TierStats, ...]
    lookup_hit_blocks: int = 0
    lookup_miss_blocks: int = 0
    lookup_blocks_by_tenant: dict[str, tuple[int, int]] = field(default_factory=dict)
    missed_blocks: dict[str, int] = field(default_factory=dict)
    reuse_gap_counts: tuple[int, ...] = ()
    reuse_gap_sum_s: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)

    def tier(self, name: str) -> TierStats:
        """The stats of the tier called ``name``. Raises ``KeyError`` if there is none."""
        for stats in self.tiers:
            if stats.name == name:
                return stats
        raise KeyError(name)


Buffer = Union[bytes, memoryview]
"""An encoded block as the API returns it: ``bytes``, or a read-only ``memoryview`` that avoided a copy.

``KVStoreClient.get`` returns a block that arrived in one gRPC message as a
view of that message (it holds the message alive); ``bytes(block)`` copies it.
Both compare equal to ``bytes`` of the same content and decode with
``kvstore.blocks.tensors.decode_block``.
"""

Block = Union[bytes, "torch.Tensor"]
"""A block as the API takes it: encoded bytes (``kvstore.blocks.tensors``) or a tensor to encode.

Tensors are ``[num_layers, 2, num_kv_heads, block_size, head_dim]`` for the ``kv``
layout and ``[num_layers, 1, block_size, latent_dim]`` for ``mla``.
"""


@runtime_checkable
class BlockClient(Protocol):
    """What a connector needs from kvstore: ``kvstore.open_store`` and ``KVStoreClient`` both provide it.

    Every method takes a namespace and chained block hashes (``kvstore.keys.hash_blocks``).
    """

    def lookup(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> LookupResult:
        """The longest cached prefix of ``block_hashes``."""
        ...

    def get(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> Sequence[Buffer]:
        """Encoded blocks of the longest cached prefix, in order; stops at the first miss (see :data:`Buffer`).

        ``lookup``, ``get`` and ``put`` also take the keywords ``session_id`` and ``ttl_s`` (``docs/agentic.md``).
        """
        ...

    def get_tensors(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> list[torch.Tensor]:
        """Like :meth:`get`, decoded into CPU tensors of the namespace's layout.

        No tensor writes into a stored block: the embedded store copies each block
        into its tensor, a remote client's tensors view its own received messages.
        """
        ...

    def get_into(self, namespace: Namespace, block_hashes: Sequence[BlockHash],
                 destinations: Sequence[torch.Tensor], *, verify: bool | None = None) -> int:
        """Copy the blocks of the longest cached prefix into ``destinations`` (one tensor per hash, each of the
        block's dtype and shape, on any device, any view); returns how many.

        The Get a connector calls for its staging buffer or KV cache, whatever
        the transport: the embedded store copies from its tier's memory, a
        client of a node on the same host from shared memory, and one on
        another host from the gRPC messages; each block is copied once.
        Raises ``DestinationMismatchError`` at a block that does not fit its
        destination (the blocks before it are copied: its ``num_blocks``).
        """
        ...

    def read(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> BlockLease:
        """The encoded blocks of the longest cached prefix in place, held until released (a ``BlockLease``).

        ``with store.read(ns, hashes) as blocks:``: each block is a read-only view
        (of the tier's memory, the same-host shared segment, or the received
        gRPC messages), which nothing overwrites until the lease is released or
        runs out (``BlockLease.expires_at``). The fastest Get a connector can
        make when it copies the blocks itself.
        """
        ...

    def put(
        self,
        namespace: Namespace,
        block_hashes: Sequence[BlockHash],
        blocks: Sequence[Block],
        *,
        priority: int | None = None,
        retention_s: float | None = None,
    ) -> int:
        """Store blocks; returns how many were newly stored (already cached ones are skipped)."""
        ...

    def delete(self, namespace: Namespace, block_hashes: Sequence[BlockHash]) -> int:
        """Delete blocks from every tier; returns how many were found."""
        ...

    def stats(self) -> StoreStats:
        """Per-tier stats."""
        ...

    def close(self) -> None:
        """Release connections or close the embedded store."""
        ...
