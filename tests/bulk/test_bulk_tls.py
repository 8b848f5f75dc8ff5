"""The bulk path of a node with mutual TLS and tokens: its listener speaks TLS with the node's certificate and asks for
client certificates; a client with the TLS context moves its blocks there, one without it uses gRPC."""

from __future__ import annotations

import shutil
import socket
import ssl
from typing import Iterator

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.security import bearer_metadata, channel_credentials
from tests.bulk.test_bulk import counters
from tests.support.redis import TlsFiles, make_tls_files
from tests.support.security import AUTH_TOKENS, TOKEN_A, sha_namespace
from tests.support.server import ThreadedServer, kv_blocks, make_config
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed"),
              pytest.mark.slow]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def mtls_node(pki: TlsFiles) -> Iterator[ThreadedServer]:
    server = ThreadedServer(make_config(**{"security.tls_cert_file": pki.server_cert,
                                           "security.tls_key_file": pki.server_key,
                                           "security.tls_client_ca_file": pki.ca_cert,
                                           "security.auth_tokens": AUTH_TOKENS}))
    yield server
    server.stop()


def client_context(pki: TlsFiles, *, certificate: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=pki.ca_cert)
    if certificate:
        context.load_cert_chain(pki.client_cert, pki.client_key)
    return context


def tls_client(node: ThreadedServer, pki: TlsFiles, context: ssl.SSLContext | None) -> KVStoreClient:
    return KVStoreClient(node.target, timeout_s=30.0, retries=0, shared_memory=False, bulk_ssl_context=context,
                         metadata=bearer_metadata(TOKEN_A),
                         credentials=channel_credentials(pki.ca_cert, cert_file=pki.client_cert,
                                                         key_file=pki.client_key))


def test_a_client_with_the_tls_context_moves_its_blocks_on_the_tls_listener(mtls_node: ThreadedServer,
                                                                          pki: TlsFiles) -> None:
    ns = sha_namespace("tenant-a")
    hashes, tensors = kv_blocks(ns, 8)
    before = counters(mtls_node)["grants_redeemed"]
    with tls_client(mtls_node, pki, client_context(pki)) as client:
        assert client.put(ns, hashes, tensors) == 8
        into = [torch.empty_like(t) for t in tensors]
        assert client.get_into(ns, hashes, into) == 8
        assert client.bulk() == ("on",)
    assert all(torch.equal(a, b) for a, b in zip(into, tensors))
    assert counters(mtls_node)["grants_redeemed"] == before + 2


def test_a_client_without_it_uses_grpc(mtls_node: ThreadedServer, pki: TlsFiles) -> None:
    ns = sha_namespace("tenant-a")
    hashes, tensors = kv_blocks(ns, 2)
    before = counters(mtls_node)["grants_redeemed"]
    with tls_client(mtls_node, pki, None) as client:
        assert client.put(ns, hashes, tensors) == 2
        assert all(torch.equal(a, b) for a, b in zip(client.get_tensors(ns, hashes), tensors))
        assert client.bulk() == ("the node's bulk listener speaks TLS and this client has no bulk_ssl_context",)
    assert counters(mtls_node)["grants_redeemed"] == before


def test_plaintext_or_no_client_certificate_is_refused_and_the_node_goes_on(mtls_node: ThreadedServer,
                                                                            pki: TlsFiles) -> None:
    assert mtls_node.server.bulk is not None
    port = mtls_node.server.bulk.port
    with socket.create_connection(("127.0.0.1", port), timeout=30) as plain:
        plain.sendall(b"KVB1" + bytes(64))
        try:
            answer = plain.recv(64)
        except ConnectionResetError:
            answer = b""
        assert not answer.startswith(b"KVB1")  # the handshake fails (a TLS alert, or nothing): no kvstore reply
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
            with client_context(pki, certificate=False).wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                tls.sendall(b"KVB1" + bytes(64))
                assert tls.recv(64) != b""  # TLS 1.3 reports the missing certificate on the first read
    wait_until(lambda: counters(mtls_node)["connections"] == 0, 30, "the refused connections closed")
    test_a_client_with_the_tls_context_moves_its_blocks_on_the_tls_listener(mtls_node, pki)
