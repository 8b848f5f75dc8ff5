"""The same-host data plane: block bytes through shared memory, control through the gRPC API (docs/shared-memory.md).

The parts, each a module of its own:

* :mod:`kvstore.shm.segment`: sealed ``memfd`` segments of a fixed size, owner-only;
* :mod:`kvstore.shm.allocator`: first-fit ranges of a segment;
* :mod:`kvstore.shm.sessions`: the node's sessions (one per client), their segments and leases;
* :mod:`kvstore.shm.handoff`: the Unix socket on which a granted session's segments are handed over;
* :mod:`kvstore.shm.node`: what ``kvstore serve`` runs: the sessions, the handoff socket, the copies;
* :mod:`kvstore.shm.link`: the client's side of one node's session.
"""
