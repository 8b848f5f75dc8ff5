"""The bulk path: remote clients' block bytes on a plain socket, off gRPC (``docs/scaleout.md``).

Control stays on gRPC (``BulkGet``, ``BulkPut``: the caller's token, its tenant,
the limits, the lease or the room reserved); the node answers with a one-time
grant, and the bytes then move on a connection to the node's bulk listener:
sent with ``sendmsg`` straight from the leased blocks, received with
``recv_into`` straight into the caller's tensors (a Get) or into the node's
pool (a Put). :mod:`kvstore.bulk.frames` is the wire format both halves share;
:mod:`kvstore.bulk.node` is the node's half and :mod:`kvstore.bulk.client` the
client's.
"""
