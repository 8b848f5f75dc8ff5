"""Offline eviction-policy simulator."""
