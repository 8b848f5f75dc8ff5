"""Clients of ``kvstore serve`` nodes: ``KVStoreClient`` (synchronous) and ``AsyncKVStoreClient`` (asyncio).

Both implement :class:`kvstore.api.BlockClient`, so a connector takes either
or the embedded store, and both are written once: every call's requests, its
merge over nodes, the retries (:class:`Retry`, :class:`Backoff`), the fan-out
and the nodes' membership are one piece of code with no I/O
(:class:`~kvstore.client.core.ClientCore`, whose calls are plans of
:mod:`kvstore.client.plan`), which yields the I/O it needs; each client is a
thin transport that performs it (:class:`~kvstore.client.plan.Transport`), in
threads or on an asyncio loop, as redis-py shares its commands between its two
clients. Every call has a deadline (``timeout_s``, covering all
its retries and, with several nodes, all of its fan-out), the number of calls
in flight is bounded (``max_inflight``), and calls that are safe to repeat are
retried on UNAVAILABLE with exponential backoff and full jitter (the AWS
Architecture Blog's "Exponential Backoff and Jitter"). Status errors are raised
as kvstore's typed errors through the one mapping in ``kvstore.error_codes``.

Retried calls: lookup, get, delete, clear, stats, health and put. Put is
idempotent because a block hash names its content (the chained hash of the
prefix in the namespace) and a put of a key already stored is a no-op; a put
retried after a lost reply may therefore report fewer blocks as newly stored.

Several nodes. ``KVStoreClient(["a:50051", "b:50051", "c:50051"])`` (or
``targets=[...]``) spreads blocks over the nodes by rendezvous hashing
(:mod:`kvstore.routing`: ``owner(h) = argmax_n XXH3_64(h, seed=XXH3_64(node id))``,
Thaler & Ravishankar 1998; the node id is the target string, so every client
must list a node under the same name):

* lookup asks every node that owns some of the hashes, in parallel, for its own
  hashes in order, and merges the answers into the longest prefix (block ``i``
  is a hit iff its position in its owner's sub-list is below that owner's
  prefix; the prefix ends at the first miss);
* get fetches from the owners in parallel and merges in order, cutting at the
  first miss; put sends each block to its owner, delete to the owners; clear
  goes to every node and returns the sum; stats returns the tier-by-tier sum
  over the nodes that answered (:meth:`KVStoreClient.node_stats` gives each node's).

A node that cannot be reached (UNAVAILABLE or DEADLINE_EXCEEDED after the
retries) is marked down and the call goes on without it: its blocks are misses,
puts, deletes and clears to it are skipped, and no error reaches the caller.
Other errors (a malformed request, RESOURCE_EXHAUSTED, an auth failure) still
raise, as with one node. A down node's blocks are not re-routed, so a node that
flaps moves no keys. The node stays down for a backoff (``down_backoff_s``,
doubling per failure up to ``max_down_backoff_s``); after it, the next call
starts a ``grpc.health.v1`` probe in the background, and a SERVING answer
brings the node back. Health is thus probed lazily, by the client's own
traffic; a client that makes no calls probes nothing.

With a single target the client behaves as before: a failed call raises (after
its retries). Credentials, metadata and channel options apply to every target.

Fork safety. A :class:`KVStoreClient` made before ``fork`` (``os.fork`` or
``multiprocessing``'s ``fork`` context) can be used in the child, under this
contract:

* in the child, the first call opens a fresh channel per node (with its own
  subchannel pool, so no connection of the parent is reused), fresh in-flight
  slots, lock and worker threads, and a fresh same-host session; the parent's
  channels, session and threads are left untouched, and the parent's client
  keeps working;
* gRPC's fork handlers must run: at the moment of ``fork`` no thread of the
  process may be inside gRPC core, or gRPC skips them ("Other threads are
  currently calling into gRPC, skipping fork() handlers") and the child may
  abort in gRPC's poller, left mid-poll by a thread it does not have
  ("ev_epoll1_linux.cc: Check failed: next_worker->state == KICKED"). A
  same-host session's ``Attach`` stream is a call always in flight, and gRPC's
  thread polling it is inside gRPC core, so the client ends its same-host
  sessions just before a fork (an ``os.register_at_fork`` hook that waits for
  the stream's threads to end) and attaches new ones on the next call, in the
  parent and the child alike (:meth:`kvstore.shm.client.link.SharedMemoryLink.end_for_fork`).
  Leases (:meth:`read`) held across a fork are released then: copy what must
  outlive them. With gRPC Python's own fork support on
  (``GRPC_ENABLE_FORK_SUPPORT=1`` before gRPC is imported; it parks gRPC's
  threads itself, but makes every fork of the process wait about 1 s), the
  sessions are kept. With ``GRPC_ENABLE_FORK_SUPPORT`` set false in the child,
  its first call raises :class:`~kvstore.errors.UnavailableError` at once
  instead of hanging. Fork while none of this client's calls is in flight (its
  calls run in the calling thread, and the worker threads of a client of
  several nodes are idle between calls); a gRPC server or another gRPC client
  busy in the same process breaks the contract, whatever this client does;
* the contract is tested for :class:`KVStoreClient`
  (``tests/server/test_client_fork.py``); an :class:`AsyncKVStoreClient`'s
  channels also reopen in a child, but an event loop must not cross ``fork``,
  so in a child make a new loop and, simplest, a new client.

Example::

    from kvstore import Namespace, hash_blocks
    from kvstore.client import KVStoreClient

    with KVStoreClient(["10.0.0.1:50051", "10.0.0.2:50051"]) as client:
        ns = Namespace(model="my-llama", dtype="float16", block_size=16)
        hashes = hash_blocks(ns, token_ids)
        client.put(ns, hashes, tensors)            # [L, 2, H, 16, D] each
        hit = client.lookup(ns, hashes).num_blocks
        tensors = client.get_tensors(ns, hashes[:hit])
"""

from kvstore.client.aio import AsyncKVStoreClient
from kvstore.client.channel import (
    CONNECT_TIMEOUT_MS,
    DEFAULT_MAX_MESSAGE_BYTES,
    RECONNECT_BACKOFF_MS,
    TargetChannel,
    resolve_targets,
)
from kvstore.client.core import DEFAULT_MAX_INFLIGHT, DEFAULT_PROBE_TIMEOUT_S, DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S
from kvstore.client.retry import (
    DEFAULT_BACKOFF_S,
    DEFAULT_MAX_BACKOFF_S,
    DEFAULT_RETRIES,
    Backoff,
    InflightSlots,
    Retry,
    backoff_s,
)
from kvstore.client.stats import merge_store_stats
from kvstore.client.sync import KVStoreClient

__all__ = [
    "AsyncKVStoreClient",
    "Backoff",
    "CONNECT_TIMEOUT_MS",
    "DEFAULT_BACKOFF_S",
    "DEFAULT_MAX_BACKOFF_S",
    "DEFAULT_MAX_INFLIGHT",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_PROBE_TIMEOUT_S",
    "DEFAULT_RETRIES",
    "DEFAULT_TIMEOUT_S",
    "InflightSlots",
    "KVStoreClient",
    "MAX_TIMEOUT_S",
    "RECONNECT_BACKOFF_MS",
    "Retry",
    "TargetChannel",
    "backoff_s",
    "merge_store_stats",
    "resolve_targets",
]
