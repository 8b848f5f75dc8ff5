"""The node's KV event stream and the pairs tenant → namespace behind it, opened together for ``kvstore serve``.

On a node with bearer tokens the stream is authenticated and split by tenant
(``kvstore.events.access``): the node routes each event by the tenant of its
namespace (``kvstore.server.tenants``), so the pairs come first, from the
ledger, before the store restores anything from disk.
"""

from __future__ import annotations

from kvstore.config import Config
from kvstore.events import NodeEvents, open_node_events
from kvstore.events.access import EventAccess
from kvstore.server.admission import Admission, authenticates_clients
from kvstore.server.tenants import TenantTags


def open_tenants_and_events(config: Config, admission: Admission, *,
                            with_events: bool = True) -> tuple[TenantTags, NodeEvents | None]:
    """The node's tenant pairs, and its event stream as ``config.events`` says (``None`` when off).

    The pairs are written to ``tenants.json`` in ``store.disk.path`` when the node
    has a disk tier and either a tenant quota or an authenticated stream
    (``TenantTags.from_config``).

    Args:
        config: the whole configuration.
        admission: the node's admission (its tokens, if any).
        with_events: open the stream (``False`` for a node that serves a store it did not open).

    Raises:
        ConfigError: naming the setting, for a refused or unbindable endpoint.
    """
    authenticator = admission.authenticator
    access = None
    if with_events and config.events.endpoint and authenticator is not None:
        try:
            access = EventAccess(authenticator.principals, authenticator.principal_of, config.events.topic)
        except ValueError as exc:
            from kvstore.errors import ConfigError

            raise ConfigError("security.auth_tokens", str(exc)) from None
    tenants = TenantTags.from_config(config, tenant_routes=access.tenant_routes if access is not None else None)
    events = None
    if with_events:
        events = open_node_events(config.events, client_auth=authenticates_clients(config), access=access,
                                  routes=tenants.routes)
    return tenants, events
