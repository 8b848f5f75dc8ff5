"""The node's replay model: what one request does to a node's tiers, in the order ``kvstore.store`` does it.

``kvstore simulate`` runs this model; ``kvstore loadtest`` with one worker
runs the same requests against a real node (``TieredStore``), and the two
count the same hits (``tests/sim/test_node_agreement.py`` checks it exactly).
The policies are the store's own (``kvstore.policy``), called in the store's
order; blocks are one unit each, so a capacity is a number of blocks.

One request, with blocks ``b[0..n)`` (head first), is a client's lookup, get
and put (as ``kvstore loadtest`` and the connectors do), and touches, inserts
and evicts in this order. ``docs/simulate.md`` explains why.

1. **Lookup** ``b``: the hit is the longest prefix ``b[0..h)`` resident in the
   local tiers (each block in whichever tier holds it). It changes no recency;
   it records ``b[h]`` as the start of a put to come, continuing ``b[0..h)``.
2. **Get** ``b[0..h)``: each block is touched in its tier, tail first
   (``b[h-1]`` first, so the head ends most recent). The blocks found in the
   disk tier are then promoted: held in the disk tier (no victims there)
   and placed in the memory tier (step 4, with nothing protected); each
   batch leaves the disk tier as it is inserted in memory.
3. **Put** ``b[h..n)``: its blocks already resident are touched in their tiers,
   tail first; the others (fresh, in order) are placed in the memory tier
   (step 4) with the put's continuation ``b[0..h)`` protected. Then the blocks
   of ``b[0..h)`` still resident are touched again, tail first, so the request's
   chain ends ordered tail (least recent) to head, as a request's blocks are
   freed tail first in vLLM.
4. **Placing** blocks in a tier: the protected blocks resident in the tier are
   held (out of the eviction order, back as the most recent, tail first, after);
   ``room`` is the capacity less the held blocks. A put's new blocks carry its
   TTL, pinned tail first while the tier's cap on pinned blocks allows. The blocks go in batches of at
   most ``room``, tail first; for each batch the policy names victims for the
   batch (``victims``, the front of its order), the victims are
   evicted, and the batch is inserted tail first. Blocks no room is left for
   go to the next tier, or nowhere from the last.
5. **Evicting** from the memory tier demotes the victims to the disk tier, when
   there is one: placed there in the victims' order reversed (so the first
   victim, the least recent, ends most recent), with their priority and
   retention kept; the disk tier's own victims are dropped. A block being
   promoted that the disk tier drops meanwhile is not placed in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvstore.continuations import Continuations
from kvstore.errors import InvalidArgumentError
from kvstore.misses import DEFAULT_HISTORY_BLOCKS, DROPPED, EVICTED, EXPIRED, NEVER_STORED, OTHER_NAMESPACE, \
    MissCounts, MissHistory, classify
from kvstore.policy import DEFAULT_PRIORITY, PriorityLRUPolicy, make_policy, resolve_policy_name
from kvstore.policy.sessions import SessionTracker


@dataclass(slots=True)
class RequestHits:
    """What one request hit: blocks of its prefix found in the memory tier and in the disk tier."""

    memory: int = 0
    disk: int = 0


class NodeModel:
    """One node's local tiers, memory and an optional disk tier, replaying requests in the store's order.

    Sessions and TTLs (``docs/agentic.md``) as the node has them: a request's TTL
    pins the blocks its get hits and its put stores (``kvstore.policy.lru``), each
    tier pinning at most ``max_pinned_fraction`` of its blocks (the node's
    ``store.pins.max_tier_fraction``; its byte caps per node and tenant are not
    modelled); with the ``session`` policy a :class:`SessionTracker` runs beside
    the policies, fed at each lookup, whose clock is the count of lookups.

    Misses are named as a node names them (``kvstore.misses``): the model keeps
    the same bounded history of removals and counts each missed block of a lookup
    by cause in :attr:`misses` (``lease_lost`` never happens here: a request is one
    step; ``tier_unavailable`` neither: there is no shared tier).

    Args:
        policy: a name ``kvstore.policy.make_policy`` takes (``lru``, ``slru``, ``adaptive``, ``session``,
            ``default``).
        capacity_blocks: blocks the memory tier holds (> 0).
        disk_capacity_blocks: blocks the disk tier holds; 0 for no disk tier.
        default_priority: the tiers' default priority.
        max_pinned_fraction: the share of a tier's blocks that may be pinned at once.
        history_blocks: removals remembered to name misses (the node's ``store.miss_history_blocks``).

    Raises:
        InvalidArgumentError: on an unknown policy or a capacity out of range.
    """

    def __init__(self, policy: str, capacity_blocks: int, *, disk_capacity_blocks: int = 0,
                 default_priority: int = DEFAULT_PRIORITY, max_pinned_fraction: float = 0.5,
                 history_blocks: int = DEFAULT_HISTORY_BLOCKS) -> None:
        if capacity_blocks <= 0 or disk_capacity_blocks < 0:
            raise InvalidArgumentError(f"capacities must be > 0 (memory) and >= 0 (disk) blocks, "
                                       f"got {capacity_blocks} and {disk_capacity_blocks}")
        self.now = 0.0
        try:
            self.policies: list[PriorityLRUPolicy] = [
                make_policy(policy, default_priority=default_priority, capacity_bytes=capacity_blocks,
                            demotes=disk_capacity_blocks > 0, clock=self._clock)
            ]
            if disk_capacity_blocks > 0:
                self.policies.append(make_policy(policy, default_priority=default_priority,
                                                 capacity_bytes=disk_capacity_blocks, clock=self._clock))
            name = resolve_policy_name(policy)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        self.capacities = [capacity_blocks, disk_capacity_blocks][: len(self.policies)]
        self._max_pinned = [int(c * max_pinned_fraction) for c in self.capacities]
        self._continuations: Continuations[int] = Continuations()
        self.sessions: SessionTracker[int] | None = (
            SessionTracker(sum(self.capacities), self._cool) if name == "session" else None)
        self.lookups = 0
        self.evicted_blocks = 0
        self.demoted_blocks = 0
        self.history: MissHistory[int] = MissHistory(history_blocks)
        self.misses = MissCounts()
        """Blocks missed by cause, and reuse gaps (trace seconds)."""
        self._namespaces: set[str] = set()  # namespaces put under

    def _clock(self) -> float:
        return self.now

    def _cool(self, chain: Sequence[int]) -> None:
        for policy in self.policies:
            policy.cool(chain)

    def _allow_pin(self, level: int) -> bool:
        """Whether tier ``level`` may pin one more block: over its share the least recently used pins end first,
        as on a node (``kvstore.pins.Pins.allow``); refused only when those are held."""
        policy = self.policies[level]
        excess = policy.pinned_nbytes + 1 - self._max_pinned[level]
        return excess <= 0 or policy.unpin_oldest(excess) >= excess

    def _ttl_for(self, level: int, ttl_s: float) -> float:
        """``ttl_s`` if tier ``level`` may pin one more block (:meth:`_allow_pin`), else 0.0 (the node refuses the
        pin, not the block)."""
        return ttl_s if ttl_s and self._allow_pin(level) else 0.0

    def tier_of(self, key: int) -> int | None:
        """The tier holding ``key`` (0 memory, 1 disk), or ``None``."""
        for level, policy in enumerate(self.policies):
            if key in policy:
                return level
        return None

    def request(self, blocks: Sequence[int], now: float = 0.0, priority: int | None = None,
                expires_at: float = 0.0, session: str = "", ttl_s: float = 0.0, namespace: str = "") -> RequestHits:
        """Replay one request (module docstring, steps 1-5) and return its hits.

        Args:
            blocks: the request's chained block ids, head first.
            now: the request's time, seconds (for retention and TTLs).
            priority: the priority of its put (the tier's default when ``None``).
            expires_at: when that priority's retention ends (0.0 for none).
            session: the session it names (``""``: none).
            ttl_s: the TTL its get and put carry, seconds (0.0: none).
            namespace: the name of its namespace, for the misses' causes (a request in a namespace never put
                under, while another was, misses ``other_namespace``); its ids must not collide with another's.
        """
        self.now = now
        self.lookups += 1
        begin = getattr(self.policies[0], "begin_request", None)  # a simulator baseline's (``kvstore.sim.baselines``)
        if begin is not None:
            begin()
        hits = RequestHits()
        levels = self._lookup(blocks)
        if session and self.sessions is not None:
            self.sessions.request(session, blocks, self.lookups)
        h = len(levels)
        if h < len(blocks):
            self._count_misses(blocks[h:], namespace, now)
        if h:
            hits.memory = levels.count(0)
            hits.disk = h - hits.memory
            self._get(blocks[:h], levels, now, ttl_s)
        if h < len(blocks):
            self._namespaces.add(namespace)
            self._put(blocks[h:], now, priority, expires_at, ttl_s, session, h)
        return hits

    def _count_misses(self, missed: Sequence[int], namespace: str, now: float) -> None:
        """Each missed block's cause, as ``kvstore.explain.MissLedger.lookup_missed`` names it."""
        removals = self.history.get_many(missed)
        first = removals[0]
        if first is not None and removals.count(first) == len(removals):  # a chain's tail evicted together
            self.misses.count_removal(first, len(removals), now)
            return
        if None not in removals:  # a block the history holds is in no tier (forgotten when stored again)
            causes = classify(None, removals)
        else:
            resident = self.policies[0].contains_many(missed)
            for policy in self.policies[1:]:
                resident = [a or b for a, b in zip(resident, policy.contains_many(missed))]
            other = namespace not in self._namespaces and bool(self._namespaces)
            causes = classify(resident, removals, namespace_cause=OTHER_NAMESPACE if other else NEVER_STORED)
        self.misses.count(causes, removals, now)

    def _lookup(self, blocks: Sequence[int]) -> list[int]:
        policies = self.policies
        found = policies[0].contains_many(blocks)
        if False not in found:
            return [0] * len(blocks)
        levels = [0] * found.index(False)
        if len(policies) > 1:
            rest = blocks[len(levels):]
            for in_memory, in_disk in zip(policies[0].contains_many(rest), policies[1].contains_many(rest)):
                if not (in_memory or in_disk):
                    break
                levels.append(0 if in_memory else 1)
        self._continuations.record(blocks, len(levels))
        return levels

    def _pin(self, level: int, keys: Sequence[int], ttl_s: float) -> None:
        """Pin the resident ``keys`` of tier ``level`` with ``ttl_s``, tail first, while the tier's cap allows
        (``Index.pin``)."""
        policy = self.policies[level]
        for key in reversed(keys):
            if key in policy and (policy.is_pinned(key) or self._allow_pin(level)):
                policy.pin(key, ttl_s)

    def _meta(self, policy: PriorityLRUPolicy, key: int) -> tuple[int, float, float, float]:
        """What a block takes with it to another tier: priority, retention end, TTL and its end."""
        return (policy.priority_of(key), policy.expiry_of(key), *policy.pin_of(key))

    def _get(self, prefix: Sequence[int], levels: list[int], now: float, ttl_s: float = 0.0) -> None:
        policies = self.policies
        if 1 not in levels:
            policies[0].touch_many(prefix)
            if ttl_s:
                self._pin(0, prefix, ttl_s)
            return
        for i in range(len(prefix) - 1, -1, -1):
            policies[levels[i]].touch(prefix[i])
        if ttl_s:
            for level in (0, 1):
                self._pin(level, [key for key, at in zip(prefix, levels) if at == level], ttl_s)
        disk = policies[1]
        moving = list(dict.fromkeys(key for key, level in zip(prefix, levels) if level == 1 and key in disk))
        metas = {key: self._meta(disk, key) for key in moving}
        disk.hold_many(moving)  # held in the disk tier while they move, as the store's mover holds them
        try:
            self._place_in(0, moving, now, metas=metas, source=1)
        finally:  # those not moved return, tail first, as the index releases a batch
            disk.release_many([key for key in reversed(moving) if key in disk])

    def _put(self, keys: Sequence[int], now: float, priority: int | None, expires_at: float, ttl_s: float = 0.0,
             session: str = "", depth: int = 0) -> None:
        policies = self.policies
        if len(policies) == 1:
            found = policies[0].contains_many(keys)
            if True in found:
                resident = [key for key, hit in zip(keys, found) if hit]
                policies[0].touch_many(resident)
                if ttl_s:
                    self._pin(0, resident, ttl_s)
                fresh = list(dict.fromkeys(key for key, hit in zip(keys, found) if not hit))
            else:
                fresh = list(dict.fromkeys(keys))
        else:
            resident_at: list[list[int]] = [[], []]
            for i in range(len(keys) - 1, -1, -1):
                level = self.tier_of(keys[i])
                if level is not None:
                    policies[level].touch(keys[i])
                    resident_at[level].append(keys[i])
            if ttl_s:
                for level, found_keys in enumerate(resident_at):
                    self._pin(level, found_keys[::-1], ttl_s)
            fresh = list(dict.fromkeys(key for key in keys if self.tier_of(key) is None))
        if not fresh:
            return
        protect = self._continuations.pop(fresh[0])
        admit = getattr(policies[0], "admit_put", None)  # a simulator baseline's gate (``kvstore.sim.baselines``)
        if admit is not None and not admit(fresh, depth):
            return
        sessions = self.sessions
        if sessions is not None:
            allowed = sessions.admissible(self.lookups) if session else None
            if allowed is not None and len(fresh) > allowed:  # admission that fits the turnover: the head only
                fresh = fresh[:allowed]
                sessions.bounded_puts += 1
            sessions.placed(self.lookups, len(fresh))
            if not fresh:
                return
        meta = (policies[0].default_priority if priority is None else priority, expires_at, ttl_s)
        left = fresh
        for level in range(len(policies)):
            left = self._place_in(level, left, now, meta=meta, protect=protect)
            if not left:
                break
        if protect:
            if len(policies) == 1:
                top = policies[0]
                found = top.contains_many(protect)
                top.touch_many(protect if False not in found else [k for k, hit in zip(protect, found) if hit])
            else:
                for i in range(len(protect) - 1, -1, -1):
                    level = self.tier_of(protect[i])
                    if level is not None:
                        policies[level].touch(protect[i])

    def _place_in(self, level: int, keys: list[int], now: float, *, meta: tuple[int, float, float] | None = None,
                  metas: dict[int, tuple[int, float, float, float]] | None = None, source: int | None = None,
                  protect: Sequence[int] = ()) -> list[int]:
        """Step 4 for tier ``level``; returns the keys no room was left for, in order (all of them or none)."""
        policy = self.policies[level]
        capacity = self.capacities[level]
        protect = list(dict.fromkeys(protect))  # held once each, as the index holds a key
        held = [key for key, hit in zip(protect, policy.contains_many(protect)) if hit] if protect else []
        policy.hold_many(held)
        try:
            room = capacity - len(held)
            if room <= 0:
                return keys
            end = len(keys)
            while end > 0:
                start = max(0, end - room)
                excess = policy.nbytes + (end - start) - capacity
                if excess > 0:
                    victims = policy.victims(excess, now)
                    if source is not None and len(victims) < excess:  # a move into a tier held full: the store
                        return keys[:end]  # cannot reserve its room, and the move gives up (its blocks dropped)
                    self._evict(level, victims, now)
                if source is None and meta is not None:  # new blocks of a put: none is tracked here
                    priority, expires_at, ttl_s = meta
                    self.history.forget_many(keys[start:end])  # stored again (``Index.publish``)
                    if not ttl_s:
                        policy.insert_many(keys[start:end], 1, priority, expires_at)
                    else:  # published tail first, each pinned as the tier's share allows (Index.publish)
                        for key in reversed(keys[start:end]):
                            policy.insert(key, 1, priority, expires_at, self._ttl_for(level, ttl_s))
                else:
                    moved = []
                    for i in range(end - 1, start - 1, -1):
                        key = keys[i]
                        if source is not None and key not in self.policies[source]:
                            continue  # dropped from its source tier while it was being moved
                        if key in policy:
                            policy.remove(key)
                        priority, expires_at, ttl_s, until = metas[key]  # type: ignore[index]  # moves: metas
                        policy.insert(key, 1, priority, expires_at, self._ttl_for(level, ttl_s), until)
                        moved.append(key)
                    if source is not None and level < source:  # a promotion: the batch leaves its source now
                        self._leave(source, moved)
                end = start
            return []
        finally:
            policy.release_many(held[::-1])

    def _leave(self, level: int, keys: list[int]) -> None:
        """Keys promoted out of tier ``level``, their hold there given back (tiers are exclusive)."""
        policy = self.policies[level]
        present = [key for key in keys if key in policy]
        policy.remove_many(present)

    def _evict(self, level: int, victims: list[int], now: float) -> None:
        policy = self.policies[level]
        history = self.history
        if level + 1 < len(self.policies):
            kept = {key: self._meta(policy, key) for key in victims}
            policy.hold_many(victims)  # claimed while they move out, as the index does; removed with them
            dropped = self._place_in(level + 1, victims, now, metas=kept, source=level)
            self.demoted_blocks += len(victims)
            if history.capacity and dropped:
                history.record_many(dropped, DROPPED, now, level, [kept[key][0] for key in dropped])
        else:
            self.evicted_blocks += len(victims)
            if history.capacity:
                expired = [key for key in victims if policy.ttl_ran_out(key)] if policy.num_ran_out else []
                evicted = [key for key in victims if key not in set(expired)] if expired else victims
                uniform = getattr(policy, "uniform_priority", 0)  # a baseline has no priorities
                for part, cause in ((expired, EXPIRED), (evicted, EVICTED)):
                    history.record_many(part, cause, now, level,
                                        [uniform] * len(part) if uniform is not None else
                                        list(map(policy.priority_of, part)))
        policy.remove_many(victims)
