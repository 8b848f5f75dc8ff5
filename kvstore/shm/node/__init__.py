"""The node's half of the same-host data plane (``kvstore serve``):

* :mod:`kvstore.shm.node.pool`: the memory tier in sealed shared-memory slabs, read in place by clients;
* :mod:`kvstore.shm.node.sessions`: the sessions (one per client), their segments and leases;
* :mod:`kvstore.shm.node.handoff`: the Unix socket on which a granted session's descriptors are handed over;
* :mod:`kvstore.shm.node.control`: a session's control channels, each frame served by the node's operations;
* :mod:`kvstore.shm.node.plane`: the plane itself (sessions, handoff, slabs per session, the copies);
* :mod:`kvstore.shm.node.operations`: the same-host operations (attach, get, put) over the node's checks.
"""
