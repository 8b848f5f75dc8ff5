"""Helpers of the security tests: tokens of three principals and the server
configuration that knows them (in the compact ``auth_tokens`` form).
"""

from __future__ import annotations

from typing import Any

from kvstore.client import KVStoreClient
from kvstore.config import Config
from kvstore.keys import HashAlgorithm, Namespace
from kvstore.security import bearer_metadata, token_sha256
from tests.support.server import ThreadedServer, make_config

TOKEN_A = "tenant-a-token-0123456789abcdef"
TOKEN_B = "tenant-b-token-0123456789abcdef"
TOKEN_ADMIN = "operator-token-0123456789abcdef"
AUTH_TOKENS = f"{TOKEN_A}=tenant-a;sha256:{token_sha256(TOKEN_B)}=tenant-b;{TOKEN_ADMIN}=*"
"""Tenant A's token in plaintext, tenant B's by its SHA-256, and an operator token covering every tenant."""

_COUNTER = iter(range(1 << 30))


def auth_config(**overrides: Any) -> Config:
    """The service tests' config with token authentication on (dotted ``overrides`` win)."""
    return make_config(**{"security.auth_tokens": AUTH_TOKENS, **overrides})


def sha_namespace(cache_salt: str, **fields: Any) -> Namespace:
    """A SHA-256 namespace of tenant ``cache_salt`` with a model no other test uses (unless given)."""
    fields.setdefault("model", f"security-model-{next(_COUNTER)}")
    fields.setdefault("dtype", "float16")
    fields.setdefault("block_size", 16)
    fields.setdefault("hash_algorithm", HashAlgorithm.SHA256)
    return Namespace(cache_salt=cache_salt, **fields)


def client_of(server: ThreadedServer, token: str | None, **kwargs: Any) -> KVStoreClient:
    """A synchronous client without retries that sends ``token`` (none when ``None``)."""
    metadata = bearer_metadata(token) if token is not None else ()
    return KVStoreClient(server.target, timeout_s=30.0, retries=0, metadata=metadata, **kwargs)


def raw_channel(server: ThreadedServer, credentials: Any = None, **options: Any) -> Any:
    """A plain ``grpc`` channel of its own (its own connection) to ``server``, for raw and malformed calls."""
    import grpc

    opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", 8 << 20),
            ("grpc.max_receive_message_length", 8 << 20), *options.items()]
    if credentials is not None:
        return grpc.secure_channel(server.target, credentials, options=opts)
    return grpc.insecure_channel(server.target, options=opts)
