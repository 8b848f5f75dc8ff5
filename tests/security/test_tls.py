"""TLS and mutual TLS on a real server, with certificates of a throw-away CA made at test time (``openssl``)."""

from __future__ import annotations

import shutil
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.config import SecurityConfig
from kvstore.errors import ConfigError
from kvstore.security import bearer_metadata, channel_credentials
from kvstore.server.app import KVStoreServer
from tests.support.server import ThreadedServer, kv_blocks, make_config
from tests.support.redis import TlsFiles, make_tls_files

from tests.support.security import AUTH_TOKENS, TOKEN_A, client_of, raw_channel, sha_namespace

pytestmark = [pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed"),
              pytest.mark.slow]  # a PKI made with openssl, and TLS servers: outside `make test-fast`


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[TlsFiles, TlsFiles]:
    """The server's CA (with server and client certificates) and an unrelated CA with its own client certificate."""
    return make_tls_files(tmp_path_factory.mktemp("ca")), make_tls_files(tmp_path_factory.mktemp("other-ca"))


@pytest.fixture(scope="module")
def tls_server(pki: tuple[TlsFiles, TlsFiles]) -> Iterator[ThreadedServer]:
    files, _ = pki
    threaded = ThreadedServer(make_config(**{"security.tls_cert_file": files.server_cert,
                                             "security.tls_key_file": files.server_key}))
    yield threaded
    threaded.stop()


@pytest.fixture(scope="module")
def mtls_server(pki: tuple[TlsFiles, TlsFiles]) -> Iterator[ThreadedServer]:
    files, _ = pki
    threaded = ThreadedServer(make_config(**{"security.tls_cert_file": files.server_cert,
                                             "security.tls_key_file": files.server_key,
                                             "security.tls_client_ca_file": files.ca_cert,
                                             "security.auth_tokens": AUTH_TOKENS}))
    yield threaded
    threaded.stop()


def _health(channel: grpc.Channel) -> grpc.StatusCode:
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_tls_client_round_trips_blocks(tls_server: ThreadedServer, pki: tuple[TlsFiles, TlsFiles]) -> None:
    ns = sha_namespace("")
    hashes, tensors = kv_blocks(ns, 2)
    with client_of(tls_server, None, credentials=channel_credentials(pki[0].ca_cert)) as client:
        assert client.put(ns, hashes, tensors) == 2
        received = client.get_tensors(ns, hashes)
    assert all((a == b).all() for a, b in zip(tensors, received))


def test_plaintext_client_cannot_talk_to_a_tls_server(tls_server: ThreadedServer) -> None:
    with raw_channel(tls_server) as channel:
        assert _health(channel) == grpc.StatusCode.UNAVAILABLE


def test_client_that_does_not_trust_the_server_ca_fails(tls_server: ThreadedServer,
                                                        pki: tuple[TlsFiles, TlsFiles]) -> None:
    with raw_channel(tls_server, channel_credentials(pki[1].ca_cert)) as channel:
        assert _health(channel) == grpc.StatusCode.UNAVAILABLE


def test_mtls_client_with_a_certificate_of_the_ca_connects(mtls_server: ThreadedServer,
                                                           pki: tuple[TlsFiles, TlsFiles]) -> None:
    files, _ = pki
    credentials = channel_credentials(files.ca_cert, cert_file=files.client_cert, key_file=files.client_key)
    with raw_channel(mtls_server, credentials) as channel:
        assert _health(channel) == grpc.StatusCode.OK
    ns = sha_namespace("tenant-a")
    hashes, tensors = kv_blocks(ns, 1)
    with client_of(mtls_server, TOKEN_A, credentials=credentials) as client:  # TLS and a token together
        assert client.put(ns, hashes, tensors) == 1
        assert client.lookup(ns, hashes).num_blocks == 1


def test_mtls_without_a_client_certificate_fails(mtls_server: ThreadedServer, pki: tuple[TlsFiles, TlsFiles]) -> None:
    with raw_channel(mtls_server, channel_credentials(pki[0].ca_cert)) as channel:
        assert _health(channel) == grpc.StatusCode.UNAVAILABLE


def test_mtls_with_a_certificate_of_another_ca_fails(mtls_server: ThreadedServer,
                                                     pki: tuple[TlsFiles, TlsFiles]) -> None:
    files, other = pki
    credentials = channel_credentials(files.ca_cert, cert_file=other.client_cert, key_file=other.client_key)
    with raw_channel(mtls_server, credentials) as channel:
        assert _health(channel) == grpc.StatusCode.UNAVAILABLE


def test_mtls_plaintext_client_fails(mtls_server: ThreadedServer) -> None:
    with raw_channel(mtls_server) as channel:
        assert _health(channel) == grpc.StatusCode.UNAVAILABLE


async def test_unreadable_certificate_is_a_config_error(tmp_path) -> None:
    config = make_config(**{"security.tls_cert_file": str(tmp_path / "no.crt"),
                            "security.tls_key_file": str(tmp_path / "no.key")})
    with pytest.raises(ConfigError, match="TLS file"):
        await KVStoreServer(config).start()


def test_tls_settings_are_validated_together() -> None:
    with pytest.raises(ConfigError, match="together"):
        SecurityConfig(tls_cert_file="a.crt")
    with pytest.raises(ConfigError, match="mutual TLS"):
        SecurityConfig(tls_client_ca_file="ca.crt")
    with pytest.raises(ConfigError, match="together"):
        channel_credentials("ca.crt", cert_file="client.crt")
    assert bearer_metadata(TOKEN_A) == [("authorization", f"Bearer {TOKEN_A}")]
    with pytest.raises(ValueError):
        bearer_metadata("two words")
