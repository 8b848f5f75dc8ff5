"""Bearer tokens and tenants: the tokens file, the constant-time check, and every call of a real server."""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore.config import SecurityConfig, load_config
from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import HashAlgorithm
from kvstore.security import bearer_metadata, main, token_sha256
from kvstore.server.app import KVStoreServer
from kvstore.server.auth import Authenticator, Principal, TokenEntry, parse_tokens
from kvstore.error_codes import PermissionDeniedError, UnauthenticatedError
from kvstore.wire import namespace_to_pb, put_requests
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.support.server import ThreadedServer, encoded, kv_blocks

from tests.support.security import AUTH_TOKENS, TOKEN_A, TOKEN_ADMIN, TOKEN_B, auth_config, client_of, raw_channel, sha_namespace

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED

# ---------------------------------------------------------------- the tokens file, as pure logic


def test_document_with_plaintext_and_sha256_tokens(tmp_path) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(
        "tokens:\n"
        "  - name: team-a\n"
        f"    token_sha256: {token_sha256(TOKEN_A)}\n"
        "    tenants: [tenant-a, tenant-a2]\n"
        "  - name: ops\n"
        f"    token: {TOKEN_ADMIN}\n"
        "    tenants: ['*']\n"
    )
    auth = Authenticator.from_config(SecurityConfig(auth_tokens_file=str(path)))
    assert auth is not None and auth.num_tokens == 2
    team_a = auth.principal_of(TOKEN_A)
    assert team_a == Principal("team-a", frozenset({"tenant-a", "tenant-a2"}))
    assert team_a.covers("tenant-a2") and not team_a.covers("tenant-b") and not team_a.covers("")
    ops = auth.principal_of(TOKEN_ADMIN)
    assert ops is not None and ops.all_tenants and ops.covers("anything") and ops.covers("")
    assert auth.principal_of(TOKEN_B) is None
    assert auth.principal_of(TOKEN_A[:-1]) is None and auth.principal_of(TOKEN_A + "x") is None


def test_json_document_and_compact_form_merge() -> None:
    doc = json.dumps({"tokens": [{"token": TOKEN_A, "tenants": "tenant-a"}]})
    assert parse_tokens(doc, "inline", compact=True)[0].principal.tenants == frozenset({"tenant-a"})
    compact = parse_tokens(f"{TOKEN_A}=x,y ; sha256:{token_sha256(TOKEN_B)}=", "inline", compact=True)
    assert [e.principal.tenants for e in compact] == [frozenset({"x", "y"}), frozenset({""})]
    merged = Authenticator.from_config(SecurityConfig(auth_tokens=f"{TOKEN_B}=b"))
    assert merged is not None and merged.principal_of(TOKEN_B).tenants == frozenset({"b"})


def test_environment_variable_turns_auth_on() -> None:
    config = load_config(env={"KVSTORE_SECURITY__AUTH_TOKENS": AUTH_TOKENS})
    auth = Authenticator.from_config(config.security)
    assert auth is not None and auth.num_tokens == 3
    assert Authenticator.from_config(load_config(env={}).security) is None


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("tokens: []", "no token"),
        ("tokens: {}", "list"),
        ("- a\n- b", "mapping"),
        (f"tokens: [{{token: {TOKEN_A}}}]", "tenants"),
        (f"tokens: [{{token: {TOKEN_A}, tenants: []}}]", "tenants"),
        ("tokens: [{token: short, tenants: [a]}]", "16 characters"),
        ("tokens: [{token_sha256: abc, tenants: [a]}]", "64 hex"),
        (f"tokens: [{{token: {TOKEN_A}, token_sha256: {token_sha256(TOKEN_A)}, tenants: [a]}}]", "exactly one"),
        (f"tokens: [{{token: {TOKEN_A}, tenants: [a], role: admin}}]", "unknown keys"),
        (f"tokens: [{{token: {TOKEN_A}, tenants: [a]}}, {{token_sha256: {token_sha256(TOKEN_A)}, tenants: [b]}}]",
         "same token"),
        ("tokens: [unclosed", "cannot parse"),
    ],
)
def test_malformed_tokens_files_are_config_errors(tmp_path, text: str, needle: str) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        Authenticator.from_config(SecurityConfig(auth_tokens_file=str(path)))


def test_malformed_compact_form_and_missing_file_are_config_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="<token>="):
        Authenticator.from_config(SecurityConfig(auth_tokens=TOKEN_A))
    with pytest.raises(ConfigError, match="whitespace"):
        Authenticator.from_config(
            SecurityConfig(auth_tokens="tokens:\n - {token: 'a b c d e f g h i j k', tenants: [a]}"))
    with pytest.raises(ConfigError, match="cannot read"):
        Authenticator.from_config(SecurityConfig(auth_tokens_file=str(tmp_path / "missing.yaml")))


def test_every_configured_token_is_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    """No early exit: the check costs the same compare_digest calls whichever token (if any) matches."""
    import hmac

    from kvstore.server import auth as auth_module

    entries = [TokenEntry(bytes.fromhex(token_sha256(f"token-number-{i:04d}-padding")),
                          Principal(f"t{i}", frozenset({"x"}))) for i in range(50)]
    authenticator = Authenticator(entries)
    calls: list[tuple[bytes, bytes]] = []
    real_compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:  # a spy around the real comparison
        calls.append((a, b))
        return real_compare(a, b)

    monkeypatch.setattr(auth_module.hmac, "compare_digest", counting)
    for token in ("token-number-0000-padding", "token-number-0049-padding", "not-a-configured-token!"):
        calls.clear()
        authenticator.principal_of(token)
        assert len(calls) == 50
        assert all(len(a) == len(b) == 32 for a, b in calls)  # digests, never the raw token


@pytest.mark.parametrize(
    "metadata",
    [
        [],
        [("authorization", f"Basic {TOKEN_A}")],
        [("authorization", "Bearer")],
        [("authorization", "Bearer wrong-token-0123456789abcdef")],
        [("authorization", f"Bearer {TOKEN_A}"), ("authorization", f"Bearer {TOKEN_A}")],
    ],
)
def test_bad_metadata_is_unauthenticated(metadata: list[tuple[str, str]]) -> None:
    authenticator = Authenticator.from_config(SecurityConfig(auth_tokens=AUTH_TOKENS))
    assert authenticator is not None
    with pytest.raises(UnauthenticatedError) as info:
        authenticator.authenticate(metadata)
    assert TOKEN_A not in str(info.value)  # the message never echoes a token
    assert authenticator.authenticate([("authorization", f"bearer  {TOKEN_A} ")]).covers("tenant-a")


# ---------------------------------------------------------------- a real server with tokens


@pytest.fixture(scope="module")
def secure_server() -> Iterator[ThreadedServer]:
    """One server with the three test tokens (module scope: a server start costs ~0.2 s)."""
    threaded = ThreadedServer(auth_config())
    yield threaded
    threaded.stop()


@pytest.fixture()
def channel(secure_server: ThreadedServer) -> Iterator[grpc.Channel]:
    with raw_channel(secure_server) as ch:
        yield ch


def _calls(channel: grpc.Channel, ns_pb: pb.Namespace, hashes: list[bytes],
           blocks: list[bytes]) -> dict[str, Callable[[list[tuple[str, str]]], Any]]:
    """One callable per KVStore method that takes the metadata."""
    stub = pb_grpc.KVStoreStub(channel)
    put = channel.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=None,
                               response_deserializer=pb.PutResponse.FromString)
    from kvstore.wire import namespace_from_pb

    ns = namespace_from_pb(ns_pb)
    return {
        "Lookup": lambda md: stub.Lookup(pb.LookupRequest(namespace=ns_pb, block_hashes=hashes), metadata=md),
        "Get": lambda md: list(stub.Get(pb.GetRequest(namespace=ns_pb, block_hashes=hashes), metadata=md)),
        "Put": lambda md: put(put_requests(ns, hashes, blocks, 1 << 20), metadata=md),
        "Delete": lambda md: stub.Delete(pb.DeleteRequest(namespace=ns_pb, block_hashes=hashes), metadata=md),
        "Clear": lambda md: stub.Clear(pb.ClearRequest(namespace=ns_pb), metadata=md),
        "Stats": lambda md: stub.Stats(pb.StatsRequest(), metadata=md),
    }


def _code(call: Callable[[], Any]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


METHODS = ["Lookup", "Get", "Put", "Delete", "Clear", "Stats"]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_needs_a_valid_token(channel: grpc.Channel, method: str) -> None:
    ns = sha_namespace("tenant-a")
    hashes, tensors = kv_blocks(ns, 1)
    calls = _calls(channel, namespace_to_pb(ns), hashes, encoded(ns, tensors))
    assert _code(lambda: calls[method]([])) == UNAUTHENTICATED
    assert _code(lambda: calls[method](bearer_metadata("wrong-token-0123456789abcdef"))) == UNAUTHENTICATED
    assert _code(lambda: calls[method]([("authorization", TOKEN_A)])) == UNAUTHENTICATED  # no scheme
    assert _code(lambda: calls[method](bearer_metadata(TOKEN_A))) == grpc.StatusCode.OK
    assert _code(lambda: calls[method](bearer_metadata(TOKEN_ADMIN))) == grpc.StatusCode.OK


@pytest.mark.parametrize("method", [m for m in METHODS if m != "Stats"])
def test_a_token_only_reaches_its_own_tenants(channel: grpc.Channel, method: str) -> None:
    ns = sha_namespace("tenant-a")
    hashes, tensors = kv_blocks(ns, 1)
    calls = _calls(channel, namespace_to_pb(ns), hashes, encoded(ns, tensors))
    assert _code(lambda: calls[method](bearer_metadata(TOKEN_B))) == DENIED
    default_tenant = sha_namespace("")  # the empty salt is a tenant like any other
    calls = _calls(channel, namespace_to_pb(default_tenant), hashes, encoded(ns, tensors))
    assert _code(lambda: calls[method](bearer_metadata(TOKEN_A))) == DENIED


def test_denied_put_stores_nothing_and_admin_may_clear_any_tenant(secure_server: ThreadedServer) -> None:
    ns_a = sha_namespace("tenant-a")
    hashes, tensors = kv_blocks(ns_a, 3)
    with client_of(secure_server, TOKEN_A) as a, client_of(secure_server, TOKEN_B) as b, \
            client_of(secure_server, TOKEN_ADMIN) as admin:
        with pytest.raises(KVStoreError) as info:
            b.put(ns_a, hashes, tensors)
        assert isinstance(info.value, PermissionDeniedError)
        assert a.lookup(ns_a, hashes).num_blocks == 0
        assert a.put(ns_a, hashes, tensors) == 3
        assert admin.lookup(ns_a, hashes).num_blocks == 3
        assert admin.clear(ns_a) == 3
        assert a.lookup(ns_a, hashes).num_blocks == 0
    with client_of(secure_server, None) as anonymous, pytest.raises(UnauthenticatedError):
        anonymous.lookup(ns_a, hashes)


def test_health_and_reflection_stay_open(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore"), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = list(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                   timeout=10))
    names = {s.name for s in replies[0].list_services_response.service}
    assert "kvstore.v1.KVStore" in names


def test_xxh3_is_refused_with_auth_and_the_message_says_sha256(channel: grpc.Channel) -> None:
    ns = sha_namespace("tenant-a", hash_algorithm=HashAlgorithm.XXH3_128)
    stub = pb_grpc.KVStoreStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.Lookup(pb.LookupRequest(namespace=namespace_to_pb(ns), block_hashes=[b"\0" * 16]),
                    metadata=bearer_metadata(TOKEN_A))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sha256" in info.value.details()


def test_require_sha256_can_be_turned_off_explicitly() -> None:
    threaded = ThreadedServer(auth_config(**{"security.require_sha256": "false"}))
    try:
        ns = sha_namespace("tenant-a", hash_algorithm=HashAlgorithm.XXH3_128)
        hashes, tensors = kv_blocks(ns, 2)
        with client_of(threaded, TOKEN_A) as a:
            assert a.put(ns, hashes, tensors) == 2
            assert a.lookup(ns, hashes).num_blocks == 2
    finally:
        threaded.stop()


async def test_a_malformed_tokens_file_stops_the_server_from_starting(tmp_path) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text("tokens: [{token: short, tenants: [a]}]")
    server = KVStoreServer(auth_config(**{"security.auth_tokens": "", "security.auth_tokens_file": str(path)}))
    with pytest.raises(ConfigError, match="auth_tokens_file"):
        await server.start()


def test_the_documented_tokens_file_parses() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    document = text.split("```yaml\ntokens:", 1)[1].split("```", 1)[0]
    entries = parse_tokens("tokens:" + document, "docs/security.md")
    assert [e.principal.name for e in entries] == ["team-a", "team-b-batch", "ops"]
    assert entries[2].principal.all_tenants


def test_the_token_tool_prints_help_without_a_token_and_a_matching_digest_without_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "token:" not in capsys.readouterr().out
    main([])
    lines = dict(line.split(":", 1) for line in capsys.readouterr().out.splitlines()[:2])
    assert token_sha256(lines["token"].strip()) == lines["token_sha256"].strip()
