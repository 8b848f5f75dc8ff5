"""Shared pytest set-up: process fixtures live in ``tests/support`` and are imported where needed."""
