"""Errors that say what to do: each mistake a new user makes, through the public API or the CLI, and its message.

One test (or a few) per row of the table of mistakes in ``docs/errors.md``:
ports in use, a bad disk path or capacity, block and hash arguments of the wrong
kind, namespaces and metadata, CLI targets and options, a Redis that is down at
start, and an empty trace. The embedded store and the gRPC client must say the
same thing, so the API rows run against both.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

import kvstore
from kvstore.cli import main
from kvstore.client import KVStoreClient
from kvstore.config import DiskTierConfig, MemoryTierConfig, RedisTierConfig, StoreConfig
from kvstore.errors import ConfigError, InvalidArgumentError, UnavailableError, UnknownDtypeError
from tests.support.server import ThreadedServer, make_config
from tests.support.kvnode import REPO_ROOT, KVNode, free_port
from tests.support.redis import RedisProcess, redis_binaries

NS = kvstore.Namespace(model="errors-table", dtype="float16", block_size=16)


def _tensor(num_layers: int = 2, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_layers, 2, 2, 16, 8, generator=generator).to(torch.float16)


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    threaded = ThreadedServer(make_config())
    yield threaded
    threaded.stop()


@pytest.fixture(params=["embedded", "client"])
def store(request: pytest.FixtureRequest, server: ThreadedServer) -> Iterator[kvstore.BlockClient]:
    """The embedded store and a client of a node: the API rows must behave alike on both."""
    if request.param == "embedded":
        opened = kvstore.open_store(StoreConfig(memory=MemoryTierConfig(capacity_bytes=32 << 20)))
    else:
        opened = KVStoreClient(server.target, timeout_s=30.0, retries=0)
    with opened:
        yield opened


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port that another socket listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _serve(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """``kvstore serve ARGS`` as a process, expected to exit by itself (a refused start)."""
    return subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--log-format", "text", *args],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=timeout_s, stdin=subprocess.DEVNULL)


# -- ports --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_busy_metrics_port_is_named_with_the_flag_to_change_it(busy_port: int) -> None:
    result = _serve("--port", "0", "--metrics-port", str(busy_port))
    assert result.returncode == 1
    assert f"127.0.0.1:{busy_port}" in result.stderr
    assert "--metrics-port (KVSTORE_METRICS_PORT)" in result.stderr and "--metrics-port 0" in result.stderr


@pytest.mark.slow
def test_a_busy_grpc_port_is_named_with_the_flag_to_change_it(busy_port: int) -> None:
    result = _serve("--port", str(busy_port), "--metrics-port", "-1")
    assert result.returncode == 1
    assert f"127.0.0.1:{busy_port}" in result.stderr and "--port (KVSTORE_PORT)" in result.stderr
    assert "--port 0" in result.stderr


# -- the disk tier --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_disk_path_that_is_a_file_names_the_setting_and_the_path(tmp_path: Path) -> None:
    a_file = tmp_path / "afile"
    a_file.write_text("not a directory")
    with pytest.raises(ConfigError, match=f"store.disk.path: {a_file} exists and is not a directory"):
        kvstore.open_store(StoreConfig(disk=DiskTierConfig(path=str(a_file))))
    result = _serve("--port", "0", "--metrics-port", "-1", "--memory-capacity", "0", "--disk-path", str(a_file))
    assert result.returncode == 1
    assert f"store.disk.path: {a_file} exists and is not a directory" in result.stderr
    assert "--disk-path" in result.stderr and "Errno" not in result.stderr


@pytest.mark.slow
def test_a_disk_path_that_cannot_be_created_names_the_setting_and_the_path(tmp_path: Path) -> None:
    a_file = tmp_path / "afile"
    a_file.write_text("")
    below = a_file / "lmdb"  # below a file: no directory can be made there
    with pytest.raises(ConfigError, match=f"store.disk.path: cannot create the directory {below}"):
        kvstore.open_store(StoreConfig(disk=DiskTierConfig(path=str(below))))


@pytest.mark.slow
def test_a_disk_capacity_over_the_free_space_is_a_warning_at_start(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    too_big = shutil.disk_usage(tmp_path).free * 4
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.lmdb"):
        with kvstore.open_store(StoreConfig(disk=DiskTierConfig(path=str(tmp_path / "lmdb"),
                                                                capacity_bytes=too_big))) as store:
            # accepted: a warning, not a refusal (blocks get the capacity less LMDB's share of the map: docs/disk.md)
            assert too_big // 2 <= store.stats().tier("disk").capacity_bytes <= too_big
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("store.disk.capacity_bytes" in w and "--disk-capacity" in w and str(tmp_path) in w
               for w in warnings), warnings


@pytest.mark.slow
def test_a_disk_capacity_that_fits_gives_no_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.lmdb"):
        kvstore.open_store(StoreConfig(disk=DiskTierConfig(path=str(tmp_path / "lmdb"),
                                                           capacity_bytes=1 << 20))).close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# -- blocks and hashes at the API --------------------------------------------------------------------


def test_numpy_arrays_are_accepted_as_blocks(store: kvstore.BlockClient) -> None:
    ns = kvstore.Namespace(model=f"numpy-{type(store).__name__}", dtype="float16", block_size=16)
    hashes = kvstore.hash_blocks(ns, list(range(32)))
    tensors = [_tensor(seed=1), _tensor(seed=2)]
    assert store.put(ns, hashes, [t.numpy() for t in tensors]) == 2
    assert all(torch.equal(a, b) for a, b in zip(store.get_tensors(ns, hashes), tensors))


def test_blocks_of_another_type_are_named(store: kvstore.BlockClient) -> None:
    hashes = kvstore.hash_blocks(NS, list(range(32)))
    with pytest.raises(InvalidArgumentError, match="block 1: a numpy array of int64 has no kvstore dtype"):
        store.put(NS, hashes, [_tensor(), np.zeros((2, 2, 2, 16, 8), dtype=np.int64)])
    with pytest.raises(InvalidArgumentError, match="block 0: expected a torch.Tensor, a numpy.ndarray or encoded "
                                                   "bytes, got list"):
        store.put(NS, hashes[:1], [[1.0, 2.0]])


@pytest.mark.parametrize("call", ["lookup", "get", "get_tensors", "delete", "put"])
def test_one_hash_instead_of_a_list_says_so(store: kvstore.BlockClient, call: str) -> None:
    one_hash = kvstore.hash_blocks(NS, list(range(16)))[0]
    args = (NS, one_hash, [_tensor()]) if call == "put" else (NS, one_hash)
    with pytest.raises(InvalidArgumentError, match=r"expected a sequence of block hashes, got bytes "
                                                   r"\(one hash\? pass \[block_hash\]\)"):
        getattr(store, call)(*args)


@pytest.mark.parametrize("call", ["lookup", "get", "delete", "put"])
def test_hashes_as_hex_strings_say_how_to_convert_them(store: kvstore.BlockClient, call: str) -> None:
    hex_hashes = [h.hex() for h in kvstore.hash_blocks(NS, list(range(32)))]
    args = (NS, hex_hashes, [_tensor(), _tensor()]) if call == "put" else (NS, hex_hashes)
    with pytest.raises(InvalidArgumentError, match=r"block hash 0: expected bytes, got str \(a hex string\? "
                                                   r"use bytes.fromhex"):
        getattr(store, call)(*args)
    with pytest.raises(InvalidArgumentError, match="got str"):
        getattr(store, call)(NS, "".join(hex_hashes), *args[2:])


def test_a_hash_of_the_wrong_length_names_its_index(store: kvstore.BlockClient) -> None:
    hashes = kvstore.hash_blocks(NS, list(range(48)))
    with pytest.raises(InvalidArgumentError, match="block hash 2: must be 16 bytes for xxh3_128, got 15"):
        store.lookup(NS, [*hashes[:2], hashes[2][:15]])


def test_one_put_of_blocks_of_two_shapes_is_refused_and_stores_nothing(store: kvstore.BlockClient) -> None:
    ns = kvstore.Namespace(model=f"shapes-{type(store).__name__}", dtype="float16", block_size=16)
    hashes = kvstore.hash_blocks(ns, list(range(32)))
    with pytest.raises(InvalidArgumentError, match=r"block 1 has shape \[16, 2, 2, 16, 8\] but block 0 has "
                                                   r"\[32, 2, 2, 16, 8\]: the blocks of one namespace have one shape"):
        store.put(ns, hashes, [_tensor(num_layers=32), _tensor(num_layers=16)])
    assert store.lookup(ns, hashes).num_blocks == 0


def test_a_namespace_with_an_unknown_dtype_is_refused_at_construction() -> None:
    with pytest.raises(UnknownDtypeError, match=r"namespace.dtype 'fp16' is not a kvstore dtype "
                                                r"\(did you mean 'float16'\?\); valid: float32, float16, bfloat16"):
        kvstore.Namespace(model="m", dtype="fp16")
    with pytest.raises(InvalidArgumentError, match="namespace.layout must be one of"):
        kvstore.Namespace(model="m", layout="paged")
    assert kvstore.Namespace(model="m", dtype=torch.bfloat16) == kvstore.Namespace(model="m", dtype="bfloat16")
    assert kvstore.Namespace(model="m", dtype="torch.float16").dtype == "float16"


@pytest.mark.parametrize("metadata", [None, {}, (), {"x-request-source": "errors-test"}])
def test_client_metadata_none_or_a_mapping_is_accepted(server: ThreadedServer, metadata: object) -> None:
    with KVStoreClient(server.target, metadata=metadata, retries=0) as client:  # type: ignore[arg-type]
        assert client.health() == "SERVING"


@pytest.mark.parametrize(("metadata", "message"), [
    ("authorization: Bearer x", "must be \\(key, value\\) pairs"),
    ([("Authorization", "Bearer x")], "must be non-empty and lower case"),
    ([("authorization",)], "must be \\(key, value\\) pairs"),
])
def test_client_metadata_of_the_wrong_shape_is_refused(metadata: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        KVStoreClient("127.0.0.1:1", metadata=metadata)  # type: ignore[arg-type]


# -- the command line ------------------------------------------------------------------------------


def test_a_target_without_a_port_uses_50051(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["health", "--target", "localhost", "--timeout", "1"]) in (0, 1)  # whatever listens there
    captured = capsys.readouterr()
    assert "localhost:50051" in captured.err or captured.out.strip() == "SERVING"
    assert ":443" not in captured.err


def test_an_abbreviated_option_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--memory", "1GiB"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: kvstore serve" in err and "unrecognized arguments: --memory 1GiB" in err


@pytest.mark.parametrize("command", ["stats", "health", "simulate", "loadtest"])
def test_a_misspelt_option_shows_the_usage_of_its_subcommand(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--targt", "x"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: kvstore {command} ") and f"kvstore {command}: error: unrecognized arguments" in err


@pytest.mark.parametrize("command", ["loadtest", "simulate"])
def test_an_empty_trace_is_an_error(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main([command, "--trace", str(empty)]) == 2
    assert f"the trace {empty} has no requests" in capsys.readouterr().err


# -- Redis down at start ----------------------------------------------------------------------------


requires_redis = pytest.mark.skipif(redis_binaries() is None, reason="redis-server is not installed")


def test_redis_down_at_start_is_a_warning_naming_the_url_and_the_error(caplog: pytest.LogCaptureFixture) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.redis"):
        store = kvstore.open_store(StoreConfig(memory=MemoryTierConfig(capacity_bytes=8 << 20),
                                               redis=RedisTierConfig(url=url)))
    with store:
        warning = next(r.getMessage() for r in caplog.records if "does not answer at start" in r.getMessage())
        assert url in warning and "Error" in warning and "--redis-url" in warning
        redis = store.stats().tier("redis")
        assert redis.state == "down" and "Error" in redis.last_error and "(at 20" in redis.last_error
        assert store.stats().tier("memory").state == ""  # a local tier has no such state
        with pytest.raises(UnavailableError, match="ConnectionError") as info:
            store.clear(NS)
        assert url in str(info.value)
        for _ in range(3):  # the failures of the start and the clears open the circuit breaker
            with pytest.raises(UnavailableError) as info:
                store.clear(NS)
        assert url in str(info.value) and "circuit breaker open; last error: ConnectionError" in str(info.value)


@requires_redis
def test_the_state_of_redis_follows_it_coming_back() -> None:
    port = free_port()
    with kvstore.open_store(StoreConfig(memory=MemoryTierConfig(capacity_bytes=8 << 20),
                                        redis=RedisTierConfig(url=f"redis://127.0.0.1:{port}/0"))) as store:
        assert store.stats().tier("redis").state == "down"
        with RedisProcess(port=port):
            hashes = kvstore.hash_blocks(NS, list(range(16)))
            store.get(NS, hashes)  # a miss in memory: asks Redis, which answers now
            redis = store.stats().tier("redis")
            assert redis.state == "up" and redis.last_error  # the last error stays, for the record


@requires_redis
@pytest.mark.slow
def test_a_node_whose_redis_is_down_shows_it_in_stats_and_health(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with KVNode(redis_url=url, metrics=False) as node:
        warnings = [r for r in node.log_records() if r.get("level") == "WARNING"
                    and "does not answer at start" in r.get("event", "")]
        assert warnings and warnings[0]["url"] == url and "Error" in warnings[0]["error"]
        assert main(["stats", "--target", node.target]) == 0
        stats = capsys.readouterr().out
        assert '"state": "down"' in stats and '"last_error": "' in stats
        assert main(["health", "--target", node.target]) == 0  # it serves, from its local tiers
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == "SERVING" and lines[1].startswith("tier redis: down (last error: ")
        with KVStoreClient(node.target, retries=0) as client:  # the health services behind it, open to probes
            assert client.health("kvstore.tier.redis") == client.health("kvstore.tiers") == "NOT_SERVING"
            assert client.health("kvstore.tier.memory") == "SERVICE_UNKNOWN"
            assert client.health() == "SERVING"


@requires_redis
@pytest.mark.slow
def test_health_names_a_down_tier_also_without_the_token_its_stats_need(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"KVSTORE_SECURITY__AUTH_TOKENS": "errors-table-token-0123456789="}
    with KVNode(redis_url=f"redis://127.0.0.1:{free_port()}/0", metrics=False, env=env) as node:
        assert main(["health", "--target", node.target]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines == ["SERVING", "a tier of the node is down; `kvstore stats` (with the node's token) gives "
                                    "its last error"]


def test_a_node_without_a_tier_that_can_be_down_reports_its_tiers_serving(server: ThreadedServer,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    with KVStoreClient(server.target, retries=0) as client:
        assert client.health("kvstore.tiers") == "SERVING"
    assert main(["health", "--target", server.target]) == 0
    assert capsys.readouterr().out == "SERVING\n"
