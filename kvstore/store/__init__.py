"""The store core: the tiered store (``tiered``) over one index (``index``), its put, read and delete paths
(``placement``, ``reads``, ``removal``), the mover and its background copies (``mover``, ``copies``,
``records``, ``tasks``), start and close (``lifecycle``), and what it counts (``counts``, ``charges``,
``logical``, ``misses``, ``explain``, ``pins``). ``factory`` builds one from a ``StoreConfig``.

It imports the floors below it (the block format, keys, policies, tiers) and nothing above: the node
(``kvstore.server``), the clients, the connectors and the tools use it, never the other way round.
"""
