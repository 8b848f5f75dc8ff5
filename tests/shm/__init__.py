"""Tests of the same-host data plane (``kvstore.shm``)."""
