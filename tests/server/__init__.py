"""Tests of the gRPC service, its clients and the kvstore CLI."""
