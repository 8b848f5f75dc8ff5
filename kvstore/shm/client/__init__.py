"""The client's half of the same-host data plane:

* :mod:`kvstore.shm.client.link`: one node's session, attached on first use, its segments and mapped slabs;
* :mod:`kvstore.shm.client.control`: the client's side of the session's control channels;
* :mod:`kvstore.shm.client.handoff`: redeeming a session's grant for its descriptors.
"""
