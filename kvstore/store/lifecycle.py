"""A store's start and close, in their order: the index rebuilt from persistent tiers; volatile tiers flushed down."""

from __future__ import annotations

import logging
from typing import Sequence

from kvstore.store.copies import CopyQueue
from kvstore.store.index import Index
from kvstore.store.mover import Mover
from kvstore.store.tasks import Tasks
from kvstore.tiers.base import SharedTier, Tier, check_at_start

logger = logging.getLogger(__name__)


async def restore(index: Index, tiers: Sequence[Tier], shared: SharedTier | None) -> None:
    """Rebuild ``index`` from what the local ``tiers`` hold (e.g. LMDB after a restart).

    Entries are inserted oldest access first, so the eviction order survives
    the restart. A block held by two tiers (a crash mid-move) stays in the
    upper one; the lower record is deleted.

    Raises:
        UnavailableError: if a local tier cannot be read.
    """
    for level, tier in enumerate(tiers):
        entries = await tier.resident()
        entries.sort(key=lambda e: e.meta.last_access)
        stale = []
        for found in entries:
            if index.level_of(found.key) is not None:
                stale.append(found.key)
                continue
            meta = found.meta  # a TTL that ran out while the node was down arrives unpinned (``Index.publish``)
            entry = index.place(found.key, meta.priority, meta.expires_at, meta.ttl_s if meta.pinned_until else 0.0,
                                meta.pinned_until)
            entry.block_nbytes = found.block_nbytes or found.nbytes  # its length as put (a frame's block's)
            index.charge([entry], level, [tier.footprint(found.nbytes)])
            index.publish(entry)
        if stale:
            await tier.delete(stale)
        if entries:
            policy = index.policies[level]
            logger.info("tier %s: restored %d blocks (%d bytes)", tier.name, len(policy), policy.nbytes)
    await learn_logical_sizes(index, tiers)
    await check_at_start(shared)  # a shared tier that is down at start is named in a warning now


async def keep_pins(index: Index, tiers: Sequence[Tier]) -> None:
    """Write each persistent tier's running TTLs into its records (a TTL given to, or renewed on, a block after it
    was written there), so that a restart restores them (``docs/agentic.md``). Logged, never raised."""
    for level, tier in enumerate(tiers):
        set_pins = getattr(tier, "set_pins", None)
        if not tier.persistent or set_pins is None:
            continue
        policy = index.policies[level]
        keys = [key for key in policy if policy.is_pinned(key)]
        if keys:
            try:
                await set_pins(keys, [policy.pin_of(key) for key in keys])
            except Exception:  # noqa: BLE001 - closing: the rest still closes
                logger.exception("recording the TTLs of tier %s on close failed", tier.name)


async def learn_logical_sizes(index: Index, tiers: Sequence[Tier]) -> None:
    """Read one restored block of each namespace, for its logical bytes per block (``kvstore.tiers.logical``).

    A block that cannot be read is logged and skipped: these are stats only, and the namespace's blocks
    count their stored bytes meanwhile.
    """
    for level, key in index.logical.unknown():
        try:
            [block] = await tiers[level].get([key])
        except Exception as exc:  # noqa: BLE001 - stats only
            logger.warning("tier %s: could not read a block for its logical size: %s", tiers[level].name, exc)
            continue
        if block is not None:
            index.logical.learn([key], [block])


async def drain(tasks: Tasks, copies: CopyQueue) -> None:
    """Wait until no operation, record delete or background copy is in flight, and the copy queue is empty
    (each may start the other: a put offers a write-through, a promotion deletes the records it moved)."""
    while tasks or copies.busy:
        await tasks.wait()
        await copies.wait_idle()


async def shut_down(tasks: Tasks, copies: CopyQueue, mover: Mover, tiers: Sequence[Tier], shared: SharedTier | None,
                    index: Index | None = None) -> None:
    """Finish the work in flight, copy each volatile tier into the persistent tier below it, record the TTLs the
    persistent tiers' blocks have now, and close every tier.

    Failures are logged, and the rest still closes.
    """
    await drain(tasks, copies)  # puts in flight (a cancelled put's too) publish before memory is copied down
    for level, tier in enumerate(tiers[:-1]):
        persistent = next((i for i in range(level + 1, len(tiers)) if tiers[i].persistent), None)
        if not tier.persistent and persistent is not None:
            try:
                await mover.flush(level, persistent)
            except Exception:
                logger.exception("demoting tier %s on close failed", tier.name)
    if index is not None:
        await keep_pins(index, tiers)
    await drain(tasks, copies)  # the flush's own record deletes and copies
    await copies.close()
    for tier in [*tiers, *([shared] if shared else [])]:
        try:
            await tier.close()
        except Exception:  # close the others all the same
            logger.exception("closing tier %s failed", tier.name)
