"""The vLLM connector's embedded store: its configuration, and the lookup endpoint the scheduler reaches it by.

With ``target`` set, the scheduler and every worker each open a
:class:`~kvstore.client.KVStoreClient` of the nodes
(``kvstore.connectors.kit.stores.open_client``). Without it, every worker
opens an embedded store (``kvstore.open_store``) in its own process, so that
loads and saves are in-process copies; the scheduler, which runs in vLLM's
engine-core process, reaches each worker's store for its lookups through a
:class:`LookupEndpoint`: the same store served by :func:`kvstore.serve_in_process` on a
free loopback port, whose address the worker sends in its handshake.
"""

from __future__ import annotations

from kvstore.config import Config, load_config
from kvstore.connectors.vllm.config import VLLMConnectorConfig
from kvstore.embedded import EmbeddedStore

def embedded_config(config: VLLMConnectorConfig) -> Config:
    """The embedded store's whole configuration: the ``config`` file (if any), then ``KVSTORE_*`` variables.

    Raises:
        ConfigError: naming the field, on a bad file or variable.
    """
    return load_config(config.config)


class LookupEndpoint:
    """An embedded store of a worker, served on a free loopback port so the scheduler's lookups reach it.

    The endpoint serves the store's ``kvstore.v1.KVStore`` service over
    loopback, without metrics, and only to callers that present a bearer token
    made for it (:attr:`token`, which the scheduler gets in the worker's
    handshake), so other local users cannot read the cache through the port.
    The connector uses only Lookup through it; the worker's own loads and
    saves go to the store in-process.

    Args:
        store: the worker's embedded store.
        config: its configuration (limits apply to the endpoint too).

    Attributes:
        target: ``127.0.0.1:<port>``.
        token: the bearer token of every call.
    """

    def __init__(self, store: EmbeddedStore, config: Config) -> None:
        from kvstore.server.in_process import serve_in_process

        self._served = serve_in_process(store, config)
        self.token = self._served.token
        self.target = self._served.target

    def close(self) -> None:
        """Stop serving (the store stays open); never raises."""
        self._served.close()
