"""The same-host data plane: block bytes through shared memory, a session's control calls on its own Unix socket
pairs, the rest through the gRPC API (docs/shared-memory.md).

The parts, each a module of its own:

* :mod:`kvstore.shm.segment`: sealed ``memfd`` segments of a fixed size, owner-only;
* :mod:`kvstore.shm.allocator`: first-fit ranges of a segment;
* :mod:`kvstore.shm.sessions`: the node's sessions (one per client), their segments and leases;
* :mod:`kvstore.shm.handoff`: the Unix socket on which a granted session's segments are handed over;
* :mod:`kvstore.shm.node`: what ``kvstore serve`` runs: the sessions, the handoff socket, the copies;
* :mod:`kvstore.shm.link`: the client's side of one node's session;
* :mod:`kvstore.shm.frames`: the framing of a session's control channels;
* :mod:`kvstore.shm.control`: the client's side of those channels (the node's: ``kvstore.server.shm_control``).
"""
