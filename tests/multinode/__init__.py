"""Several real kvstore nodes: fan-out through one client, shared Redis and Redis Cluster, node and Redis failures."""
