"""Argument checks of the clients and the CLI, against a real in-process server.

A bad ``put`` argument raises :class:`InvalidArgumentError` from ``put`` itself,
before any Put call reaches a node (sync and asyncio alike); a client rejects a
non-finite or out-of-range setting when it is built; ``kvstore stats`` and
``kvstore health`` report a bad flag in one line, without a traceback; and an
unknown health service is ``SERVICE_UNKNOWN``, not an unreachable node.
"""

from __future__ import annotations

import asyncio
import math
import re
import subprocess
import sys
import urllib.request
from typing import Any

import numpy as np
import pytest

from kvstore.client import calls, plan
from kvstore.cli import main
from kvstore.client import MAX_TIMEOUT_S, AsyncKVStoreClient, KVStoreClient
from kvstore.errors import InvalidArgumentError
from kvstore.wire import chunk_bytes_for
from tests.support.kvnode import REPO_ROOT, free_port

from tests.support.server import ThreadedServer, encoded, kv_blocks, namespace


def _put_calls(server: ThreadedServer) -> float:
    """How many Put calls the server has counted, whatever their status."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10).read()
    return sum(float(m) for m in re.findall(r'^kvstore_requests_total{code="\w+",method="Put"} (\S+)$',
                                           text.decode(), re.MULTILINE))


# ---------------------------------------------------------------------- put arguments

# (keyword arguments of put, or a hash to put in place of the first) -> a word of the error message
BAD_PUTS: list[tuple[dict[str, Any], str]] = [
    ({"priority": -1}, "priority"),
    ({"priority": 101}, "priority"),
    ({"priority": 2**40}, "priority"),
    ({"priority": 1.5}, "priority"),
    ({"priority": True}, "priority"),
    ({"priority": "10"}, "priority"),
    ({"retention_s": "10"}, "retention_s"),
    ({"retention_s": -1.0}, "retention_s"),
    ({"retention_s": math.nan}, "retention_s"),
    ({"retention_s": 10**400}, "retention_s"),
    ({"hash": "0123456789abcdef"}, "hash"),
    ({"hash": 16}, "hash"),
    ({"hash": b"short"}, "16 bytes"),
]
BAD_PUT_IDS = [f"{next(iter(kw))}={next(iter(kw.values()))!r}"[:40] for kw, _ in BAD_PUTS]


def _bad_put(kwargs: dict[str, Any]) -> tuple[Any, list[Any], list[bytes], dict[str, Any]]:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 2)
    kwargs = dict(kwargs)
    if "hash" in kwargs:
        hashes[0] = kwargs.pop("hash")
    return ns, hashes, encoded(ns, tensors), kwargs


@pytest.mark.parametrize(("kwargs", "word"), BAD_PUTS, ids=BAD_PUT_IDS)
def test_put_rejects_bad_arguments_before_any_call(server: ThreadedServer, kwargs: dict[str, Any],
                                                   word: str) -> None:
    ns, hashes, blocks, kwargs = _bad_put(kwargs)
    before = _put_calls(server)
    with KVStoreClient(server.target, timeout_s=30.0, retries=0) as kv:
        with pytest.raises(InvalidArgumentError, match=word):
            kv.put(ns, hashes, blocks, **kwargs)
        assert _put_calls(server) == before  # raised by put itself, no call started
        assert kv.lookup(ns, [h for h in hashes if isinstance(h, bytes) and len(h) == 16]).num_blocks == 0


@pytest.mark.parametrize(("kwargs", "word"), BAD_PUTS, ids=BAD_PUT_IDS)
async def test_async_put_rejects_bad_arguments_before_any_call(server: ThreadedServer, kwargs: dict[str, Any],
                                                               word: str) -> None:
    ns, hashes, blocks, kwargs = _bad_put(kwargs)
    before = _put_calls(server)
    async with AsyncKVStoreClient(server.target, timeout_s=30.0, retries=0) as kv:
        with pytest.raises(InvalidArgumentError, match=word):  # not asyncio.CancelledError
            await kv.put(ns, hashes, blocks, **kwargs)
        assert _put_calls(server) == before


def test_put_rejects_bad_arguments_with_several_nodes_too() -> None:
    ns, hashes, blocks, _ = _bad_put({})
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    with KVStoreClient(dead, timeout_s=5.0, retries=0) as kv:  # a down node would hide the error
        with pytest.raises(InvalidArgumentError, match="priority"):
            kv.put(ns, hashes, blocks, priority=-1)
        with pytest.raises(InvalidArgumentError, match="hash"):
            kv.put(ns, ["x" * 16, hashes[1]], blocks)


def test_put_rejects_a_namespace_that_is_not_one(server: ThreadedServer) -> None:
    _, hashes, blocks, _ = _bad_put({})
    with KVStoreClient(server.target, timeout_s=30.0, retries=0) as kv:
        with pytest.raises(InvalidArgumentError, match="namespace"):
            kv.put("my-model", hashes, blocks)  # type: ignore[arg-type]


# every value the server accepts still goes through
GOOD_PUTS: list[dict[str, Any]] = [
    {"priority": 0, "retention_s": 0},
    {"priority": 100, "retention_s": math.inf},
    {"priority": np.int64(50), "retention_s": np.float32(2.5)},
    {"priority": np.uint8(7), "retention_s": 30},
]


@pytest.mark.parametrize("kwargs", GOOD_PUTS, ids=[repr(kw) for kw in GOOD_PUTS])
def test_put_accepts_everything_the_server_does(client: KVStoreClient, kwargs: dict[str, Any]) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 3)
    views = [hashes[0], bytearray(hashes[1]), memoryview(hashes[2])]
    assert client.put(ns, views, tensors, **kwargs) == 3
    assert client.lookup(ns, hashes).num_blocks == 3


async def test_async_put_accepts_everything_the_server_does(server: ThreadedServer) -> None:
    async with AsyncKVStoreClient(server.target, timeout_s=30.0, retries=0) as kv:
        for kwargs in GOOD_PUTS:
            ns = namespace()
            hashes, tensors = kv_blocks(ns, 2)
            assert await kv.put(ns, [bytearray(hashes[0]), memoryview(hashes[1])], tensors, **kwargs) == 2
            assert (await kv.lookup(ns, hashes)).num_blocks == 2


class _Unsizable(bytes):
    """Bytes that pass the client's checks (they are bytes) but whose ``len()`` fails: a stream that breaks late."""

    def __len__(self) -> int:
        raise RuntimeError("no length")


async def test_async_put_turns_a_failing_request_stream_into_an_error_not_a_cancellation(
    server: ThreadedServer,
) -> None:
    ns = namespace()
    hashes, _ = kv_blocks(ns, 1)
    not_bytes: Any = _Unsizable(b"\0" * 64)  # len() of it fails inside the request stream
    rpc = calls.put_rpc(ns, hashes, [not_bytes], chunk_bytes_for(4 << 20), None, None)
    async with AsyncKVStoreClient(server.target, timeout_s=30.0, retries=0, shared_memory=False, bulk=False) as kv:  # gRPC's Put
        task = asyncio.ensure_future(kv.execute(plan.Plan({0: rpc}, calls.first)))
        with pytest.raises(InvalidArgumentError, match="Put request"):
            await task
        assert not task.cancelled()


def test_put_turns_a_failing_request_stream_into_an_error(server: ThreadedServer) -> None:
    ns = namespace()
    hashes, _ = kv_blocks(ns, 1)
    not_bytes: Any = _Unsizable(b"\0" * 64)  # len() of it fails inside the request stream
    rpc = calls.put_rpc(ns, hashes, [not_bytes], chunk_bytes_for(4 << 20), None, None)
    with KVStoreClient(server.target, timeout_s=30.0, retries=0, shared_memory=False, bulk=False) as client:  # gRPC's Put
        with pytest.raises(InvalidArgumentError, match="Put request"):
            client.execute(plan.Plan({0: rpc}, calls.first))


# ---------------------------------------------------------------------- client settings

SECONDS_SETTINGS = ("timeout_s", "probe_timeout_s", "backoff_s", "max_backoff_s", "down_backoff_s",
                    "max_down_backoff_s")


@pytest.mark.parametrize("client_class", [KVStoreClient, AsyncKVStoreClient])
@pytest.mark.parametrize("name", SECONDS_SETTINGS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, -1.0, "1", True],
                         ids=["inf", "-inf", "nan", "negative", "str", "bool"])
def test_clients_reject_a_bad_number_of_seconds(client_class: type, name: str, value: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=name):
        client_class("127.0.0.1:1", **{name: value})


@pytest.mark.parametrize("client_class", [KVStoreClient, AsyncKVStoreClient])
@pytest.mark.parametrize("name", ["timeout_s", "probe_timeout_s"])
def test_clients_reject_a_zero_deadline(client_class: type, name: str) -> None:
    with pytest.raises(InvalidArgumentError, match=name):
        client_class("127.0.0.1:1", **{name: 0})


@pytest.mark.parametrize("client_class", [KVStoreClient, AsyncKVStoreClient])
@pytest.mark.parametrize("name", ["timeout_s", "probe_timeout_s"])
def test_clients_reject_a_deadline_that_grpc_cannot_hold(client_class: type, name: str) -> None:
    client_class("127.0.0.1:1", **{name: MAX_TIMEOUT_S})
    with pytest.raises(InvalidArgumentError, match=name):  # past int64 nanoseconds: gRPC would fail it at once
        client_class("127.0.0.1:1", **{name: 1e10})


def test_a_long_deadline_is_a_deadline(server: ThreadedServer) -> None:
    with KVStoreClient(server.target, timeout_s=MAX_TIMEOUT_S, retries=0) as kv:
        assert kv.health() == "SERVING"


@pytest.mark.parametrize("client_class", [KVStoreClient, AsyncKVStoreClient])
def test_clients_accept_zero_backoffs(client_class: type) -> None:
    client = client_class("127.0.0.1:1", backoff_s=0, max_backoff_s=0.0, down_backoff_s=0, max_down_backoff_s=0)
    # kept as given, as floats: no pause before a retry, and a down node is probed again at once
    assert (client.retry.backoff.base_s, client.retry.backoff.cap_s) == (0.0, 0.0)
    assert (client.membership.base_backoff_s, client.membership.max_backoff_s) == (0.0, 0.0)
    assert client.retry.backoff.pause_s(5) == 0.0


@pytest.mark.parametrize("client_class", [KVStoreClient, AsyncKVStoreClient])
def test_clients_reject_a_down_backoff_cap_below_its_base(client_class: type) -> None:
    with pytest.raises(InvalidArgumentError, match="max_down_backoff_s"):
        client_class("127.0.0.1:1", down_backoff_s=10.0, max_down_backoff_s=1.0)


@pytest.mark.parametrize("client_class", [KVStoreClient, AsyncKVStoreClient])
@pytest.mark.parametrize(("name", "value"), [("max_inflight", 0), ("max_inflight", 1.5), ("retries", -1),
                                             ("retries", "3")])
def test_clients_reject_bad_counts(client_class: type, name: str, value: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=name):
        client_class("127.0.0.1:1", **{name: value})


# ---------------------------------------------------------------------- the CLI's flags


@pytest.mark.parametrize("argv", [
    ["health", "--timeout", "0"], ["health", "--timeout", "inf"], ["health", "--timeout", "nan"],
    ["stats", "--timeout", "-1"], ["stats", "--timeout", "soon"],
], ids=lambda argv: " ".join(argv))
def test_cli_rejects_a_bad_timeout_as_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--timeout" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["health", "stats"])
@pytest.mark.parametrize(("flags", "word"), [(["--target", ""], "target"), (["--timeout", "1e10"], "timeout_s")],
                         ids=["empty target", "timeout past gRPC's"])
def test_cli_reports_a_bad_flag_in_one_line(command: str, flags: list[str], word: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvstore {command}: ") and word in lines[0]


def test_cli_bad_timeout_through_the_real_entry_point() -> None:
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "health", "--timeout", "0"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "--timeout" in done.stderr.strip().splitlines()[-1]


# ---------------------------------------------------------------------- unknown health service


def test_health_of_an_unknown_service_is_service_unknown(client: KVStoreClient, server: ThreadedServer) -> None:
    assert client.health("nosuch") == "SERVICE_UNKNOWN"
    assert client.health() == "SERVING"
    with KVStoreClient([server.target, f"127.0.0.1:{free_port()}"], timeout_s=5.0, retries=0) as kv:
        assert kv.health("nosuch") == "SERVICE_UNKNOWN"


async def test_async_health_of_an_unknown_service_is_service_unknown(server: ThreadedServer) -> None:
    async with AsyncKVStoreClient(server.target, timeout_s=30.0, retries=0) as kv:
        assert await kv.health("nosuch") == "SERVICE_UNKNOWN"
        assert await kv.health("kvstore.v1.KVStore") == "SERVING"
    async with AsyncKVStoreClient([server.target, f"127.0.0.1:{free_port()}"], timeout_s=5.0, retries=0) as kv:
        assert await kv.health("nosuch") == "SERVICE_UNKNOWN"


def test_cli_health_of_an_unknown_service(server: ThreadedServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["health", "--target", server.target, "--service", "nosuch"]) == 1  # as NOT_SERVING
    captured = capsys.readouterr()
    assert captured.out.strip() == "SERVICE_UNKNOWN"
    assert "UNREACHABLE" not in captured.err
    dead = f"127.0.0.1:{free_port()}"
    assert main(["health", "--target", dead, "--timeout", "2", "--service", "nosuch"]) == 1
    assert capsys.readouterr().err.startswith(f"UNREACHABLE: {dead}: ")
