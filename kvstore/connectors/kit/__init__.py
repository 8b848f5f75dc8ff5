"""What every connector (vLLM, SGLang, HF) shares: its store from settings, its fetches, its save queue.

* :mod:`kvstore.connectors.kit.settings`: the settings every connector shares, checked in one place.
* :mod:`kvstore.connectors.kit.stores`: one client (or embedded store) from a connector's settings, and
  :class:`~kvstore.connectors.kit.stores.StoreHealth`, the backoff after a failed call.
* :mod:`kvstore.connectors.kit.spec`: what one block of a destination holds, and the check that a block fits.
* :mod:`kvstore.connectors.kit.fetch`: one fetch of a prefix into its destination, by the best path the
  client offers, each block checked against the destination's :class:`~kvstore.connectors.kit.fetch.BlockSpec`.
* :mod:`kvstore.connectors.kit.leased`: a lease's blocks checked and viewed in place as arrays.
* :mod:`kvstore.connectors.kit.saves`: one background save queue with bounded staging and the store's health.
* :mod:`kvstore.connectors.kit.bases`: what mypy sees of the engines' (untyped) base classes.

The connectors keep only their engine's glue.
"""
