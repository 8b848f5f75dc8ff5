"""Fixtures of the same-host data plane tests."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.support.security import auth_config
from tests.support.server import ThreadedServer


@pytest.fixture(scope="module")
def node() -> Iterator[ThreadedServer]:
    """A node with auth (tokens A and B of ``tests.support.security``) and at most 8 same-host sessions, per module."""
    server = ThreadedServer(auth_config(**{"shared_memory.max_sessions": 8}))
    yield server
    server.stop()
