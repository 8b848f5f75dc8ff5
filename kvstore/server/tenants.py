"""Which tenant each namespace on this node belongs to: for the tenant quota, and to route each KV event to the
streams of its tenant (``kvstore.events.access``).

A namespace tag is a hash and names no tenant; the node learns the pair tenant
(``cache_salt``) → tag when an authorized call uses the namespace
(:meth:`TenantTags.note`; a Put also writes it down, :meth:`TenantTags.record`).
With a disk tier the pairs are kept in a small JSON file beside it
(:class:`TenantLedger`, ``tenants.json``), so that blocks restored from LMDB
after a restart count against their tenant, and their events reach their
tenant's stream, from the start.

Pairs of namespaces that hold nothing, and no Put is writing to, are forgotten
(the quota forgets them as it counts; the rest go when the map has doubled
since it was last pruned), so a tenant that names many namespaces costs memory
only for those that hold bytes. An event is routed when the store records it
(``EventLog.set_routes``), so forgetting a pair never misroutes an event
already recorded. Used from the server's loop only: no locks (the event log
reads :attr:`TenantTags.routes` on the same loop).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

from kvstore.keys import Namespace

if TYPE_CHECKING:
    from kvstore.config import Config

logger = logging.getLogger(__name__)

LEDGER_FILE = "tenants.json"
"""The :class:`TenantLedger`'s file name, in the disk tier's directory (``store.disk.path``)."""
PRUNE_FLOOR = 1024
"""Pairs held before the first pruning of namespaces that hold nothing."""


class TenantLedger:
    """The pairs tenant → namespace tag of a :class:`TenantTags`, in a small JSON file that survives restarts.

    The file is ``{"version": 1, "tenants": {"<tenant>": ["<tag hex>", ...]}}``,
    rewritten whole (to a temporary file, fsynced, then renamed over the old
    one) each time a tenant first writes to a namespace: once per namespace and
    tenant, not per Put. Tags that hold nothing are left out at the next write.
    JSON only: nothing read from disk is unpickled.

    Args:
        path: the file; its directory must exist (the disk tier's).
    """

    VERSION = 1

    def __init__(self, path: str) -> None:
        self.path = path

    def load(self) -> dict[str, set[bytes]]:
        """The pairs on disk; an empty map when the file is missing, and (with a warning) when it is unreadable."""
        try:
            with open(self.path, "rb") as f:
                doc = json.loads(f.read(64 << 20))
            if doc.get("version") != self.VERSION:
                raise ValueError(f"version {doc.get('version')!r}, expected {self.VERSION}")
            return {str(tenant): {bytes.fromhex(tag) for tag in tags} for tenant, tags in doc["tenants"].items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            logger.warning("tenant ledger %s is unreadable (%s): blocks restored from disk count against no "
                           "tenant's quota, and their events reach only the stream of every tenant, until their "
                           "tenant writes to their namespace again", self.path, exc)
            return {}

    def save(self, tags: Mapping[str, set[bytes]]) -> None:
        """Replace the file with ``tags`` atomically; a failure is logged, not raised (the pairs still hold in memory)."""
        doc = {"version": self.VERSION, "tenants": {t: sorted(tag.hex() for tag in s) for t, s in tags.items() if s}}
        temp = f"{self.path}.tmp"
        try:
            with open(temp, "wb") as f:
                f.write(json.dumps(doc, separators=(",", ":")).encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, self.path)
        except OSError as exc:
            logger.warning("tenant ledger %s could not be written (%s): after a restart, blocks of new "
                           "namespaces count against their tenant's quota only once it writes again", self.path, exc)


class TenantTags:
    """The pairs tenant → namespace tag of this node, and each tag's event route (module docstring).

    Args:
        ledger_path: the JSON file of the pairs (:class:`TenantLedger`), ``None`` to keep them in memory only.
        tenant_routes: each tenant the tokens name -> its event route (``EventAccess.tenant_routes``);
            empty: no routes (a node without tokens, or without events).

    Attributes:
        routes: namespace tag -> event route, of the tags of tenants in ``tenant_routes`` (for
            ``EventLog.set_routes``; updated in place).
        namespace_bytes: bytes a namespace holds by its tag (``TieredStore.namespace_bytes``); set once the
            store is open, until then nothing is pruned.
    """

    def __init__(self, ledger_path: str | None = None, tenant_routes: Mapping[str, int] | None = None) -> None:
        self._ledger = TenantLedger(ledger_path) if ledger_path else None
        self._tenant_routes = dict(tenant_routes or {})
        self._tags: dict[str, set[bytes]] = self._ledger.load() if self._ledger is not None else {}
        self._saved: set[bytes] = {tag for tags in self._tags.values() for tag in tags}
        self.routes: dict[bytes, int] = {}
        for tenant, tags in self._tags.items():
            route = self._tenant_routes.get(tenant)
            if route is not None:
                self.routes.update(dict.fromkeys(tags, route))
        self.namespace_bytes: Callable[[bytes], int] | None = None
        self._writing: dict[bytes, int] = {}  # tag -> Puts writing to it now: never forgotten meanwhile
        self._num_pairs = sum(map(len, self._tags.values()))
        self._prune_at = max(PRUNE_FLOOR, 2 * self._num_pairs)

    @classmethod
    def from_config(cls, config: Config, namespace_bytes: Callable[[bytes], int] | None = None,
                    tenant_routes: Mapping[str, int] | None = None) -> TenantTags:
        """The pairs of a node with ``config``: written to ``tenants.json`` in ``store.disk.path`` when the node
        has a disk tier and either a tenant quota or event routes (both need them after a restart)."""
        disk = config.store.disk.path
        keep = bool(disk) and (config.limits.tenant_quota_bytes > 0 or bool(tenant_routes))
        tenants = cls(os.path.join(disk, LEDGER_FILE) if keep else None, tenant_routes)
        tenants.namespace_bytes = namespace_bytes
        return tenants

    @property
    def keeps_ledger(self) -> bool:
        """Whether the pairs are written to a file (the node has a disk tier)."""
        return self._ledger is not None

    @property
    def tenants(self) -> list[str]:
        """Tenants known to hold (or to have held since they were last counted) bytes on this node."""
        return list(self._tags)

    def tags_of(self, tenant: str) -> set[bytes]:
        """The tags of ``tenant``'s namespaces (the set itself: do not change it, use :meth:`forget`)."""
        return self._tags.get(tenant, set())

    def note(self, namespace: Namespace) -> None:
        """An authorized call uses ``namespace``: its tag is its tenant's from now on (in memory; its blocks'
        events go to its tenant's stream). One dict lookup when the pair is known."""
        tag = namespace.tag
        tags = self._tags.get(namespace.cache_salt)
        if tags is not None and tag in tags:
            return
        self._add(namespace.cache_salt, tag)

    def record(self, namespace: Namespace) -> None:
        """:meth:`note`, and write the pair down before any block of the namespace is stored (a Put), so a crash
        never loses it."""
        self.note(namespace)
        if self._ledger is not None and namespace.tag not in self._saved:
            self._saved.add(namespace.tag)
            self._ledger.save(self._tags)

    @contextlib.contextmanager
    def writing(self, namespace: Namespace) -> Iterator[None]:
        """Scope of a Put into ``namespace``: :meth:`record`, and the pair is not forgotten until it ends (its
        blocks' events are routed as they are stored)."""
        self.record(namespace)
        tag = namespace.tag
        self._writing[tag] = self._writing.get(tag, 0) + 1
        try:
            yield
        finally:
            left = self._writing[tag] - 1
            if left:
                self._writing[tag] = left
            else:
                del self._writing[tag]

    def forget(self, tenant: str, tag: bytes) -> None:
        """Forget that ``tag`` is ``tenant``'s (it holds nothing now); not while a Put writes to it."""
        tags = self._tags.get(tenant)
        if tags is None or tag not in tags or tag in self._writing:
            return
        tags.discard(tag)
        self._num_pairs -= 1
        if not tags:
            del self._tags[tenant]
        self.routes.pop(tag, None)
        self._saved.discard(tag)

    def save(self) -> None:
        """Write the pairs of namespaces that hold bytes down (when the node stops: the pairs noted by calls
        other than Puts, e.g. blocks a Get copied from the shared tier, survive a restart too)."""
        if self._ledger is None:
            return
        self.prune()
        self._ledger.save(self._tags)
        self._saved = {tag for tags in self._tags.values() for tag in tags}

    def prune(self) -> None:
        """Forget the pairs of namespaces that hold nothing (once :attr:`namespace_bytes` is set)."""
        held = self.namespace_bytes
        if held is None:
            return
        for tenant, tags in list(self._tags.items()):
            for tag in [t for t in tags if not held(t)]:
                self.forget(tenant, tag)
        self._prune_at = max(PRUNE_FLOOR, 2 * self._num_pairs)

    def _add(self, tenant: str, tag: bytes) -> None:
        if self._num_pairs >= self._prune_at:  # before the new pair, which holds nothing yet
            self.prune()
        self._tags.setdefault(tenant, set()).add(tag)
        self._num_pairs += 1
        route = self._tenant_routes.get(tenant)
        if route is not None:
            self.routes[tag] = route
