"""The same-host data plane: block bytes through shared memory, a session's control calls on its own Unix socket
pairs, the rest through the gRPC API (docs/shared-memory.md).

What both halves agree on:

* :mod:`kvstore.shm.segment`: sealed ``memfd`` segments of a fixed size, owner-only;
* :mod:`kvstore.shm.allocator`: first-fit ranges of a segment;
* :mod:`kvstore.shm.frames`: the framing of a session's control channels;
* :mod:`kvstore.shm.handoff`: the handoff protocol (a grant for the session's descriptors);
* :mod:`kvstore.shm.host`: the host's id, and where a node's handoff socket is.

The node's half, :mod:`kvstore.shm.node` (what ``kvstore serve`` runs), and the client's half,
:mod:`kvstore.shm.client`, import only these and never each other.
"""
