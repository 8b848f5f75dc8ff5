"""Helpers that start real processes (redis-server, kvstore nodes) for tests."""
