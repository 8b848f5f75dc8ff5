"""A real ``kvstore serve`` process: SIGTERM shutdown, restart on the same LMDB path, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest
import torch

from kvstore.cli import SUBCOMMAND_MODULES, build_parser, main
from kvstore.client import KVStoreClient
from kvstore.errors import UnavailableError
from tests.support.kvnode import REPO_ROOT, KVNode, free_port

from tests.support.server import kv_blocks, namespace
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow  # starts processes or servers: outside `make test-fast`


@pytest.fixture(scope="module")
def disk_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVNode]:
    """A node whose only tier is LMDB (memory disabled), so every block is on disk."""
    path = tmp_path_factory.mktemp("lmdb")
    with KVNode(memory_capacity="0", disk_path=path, disk_capacity="64MiB",
                env={"KVSTORE_SERVER__GRACE_S": "5"}) as node:
        yield node


def test_sigterm_shuts_down_in_order_and_a_restart_serves_the_earlier_blocks(disk_node: KVNode) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 4)
    with KVStoreClient(disk_node.target, retries=0, timeout_s=30) as kv:
        assert kv.put(ns, hashes, tensors) == 4
        assert kv.lookup(ns, hashes).tiers == ("disk",) * 4
    port = disk_node.port

    assert disk_node.stop() == 0  # SIGTERM: a clean exit
    events = [r["event"] for r in disk_node.log_records(since_start=True)]
    assert events.index("serving") < events.index("signal received") < events.index("shutting down") \
        < events.index("stopped")
    assert any(r["event"].startswith("disk tier") and "closed" in r["event"]
               for r in disk_node.log_records(since_start=True))
    with KVStoreClient(f"127.0.0.1:{port}", retries=0, timeout_s=5) as kv:
        with pytest.raises(UnavailableError):
            kv.health()

    disk_node.start()
    assert disk_node.port == port
    with KVStoreClient(disk_node.target, retries=0, timeout_s=30) as kv:
        assert kv.lookup(ns, hashes).num_blocks == 4
        for sent, received in zip(tensors, kv.get_tensors(ns, hashes)):
            assert torch.equal(sent, received)
        assert kv.stats().tier("disk").blocks >= 4


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_the_node_serves_on_either_event_loop(event_loop: str) -> None:
    if event_loop == "uvloop":
        pytest.importorskip("uvloop")
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 2)
    with KVNode(env={"KVSTORE_SERVER__EVENT_LOOP": event_loop}) as node:
        with KVStoreClient(node.target, retries=0, timeout_s=30) as kv:
            assert kv.put(ns, hashes, tensors) == 2
            assert [torch.equal(a, b) for a, b in zip(tensors, kv.get_tensors(ns, hashes))] == [True, True]
        serving = next(r for r in node.log_records(since_start=True) if r["event"] == "serving")
        assert serving["event_loop"] == event_loop
        assert node.stop() == 0  # SIGTERM: the signal handlers work on this loop too


def test_client_retries_ride_out_a_restart(disk_node: KVNode) -> None:
    ns = namespace()
    hashes, tensors = kv_blocks(ns, 1)
    with KVStoreClient(disk_node.target, retries=1000, backoff_s=0.05, max_backoff_s=0.5, timeout_s=120) as kv:
        kv.put(ns, hashes, tensors)
        disk_node.stop()
        with KVStoreClient(disk_node.target, retries=0, timeout_s=5) as impatient:
            with pytest.raises(UnavailableError):
                impatient.lookup(ns, hashes)
        results: list[object] = []
        # the lookup retries in a thread; the node restarts from this one (a node dies with its starting thread)
        waiter = threading.Thread(target=lambda: results.append(_lookup_or_error(kv, ns, hashes)))
        waiter.start()
        disk_node.start()
        waiter.join()
        assert results == [1]  # retried on UNAVAILABLE until the node was back


def _lookup_or_error(kv: KVStoreClient, ns: object, hashes: list[bytes]) -> object:
    try:
        return kv.lookup(ns, hashes).num_blocks  # type: ignore[arg-type]
    except Exception as exc:  # reported to the test thread
        return exc


def test_cli_stats_and_health_against_a_node(disk_node: KVNode, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["health", "--target", disk_node.target]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    assert main(["health", "--target", disk_node.target, "--service", "kvstore.v1.KVStore"]) == 0
    capsys.readouterr()

    assert main(["stats", "--target", disk_node.target]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in stats["tiers"]] == ["disk"]
    assert {"blocks", "bytes", "capacity_bytes", "hits", "misses", "evictions", "corrupt_records"} \
        <= set(stats["tiers"][0])

    dead = f"127.0.0.1:{free_port()}"
    assert main(["health", "--target", dead, "--timeout", "2"]) == 1
    assert "UNREACHABLE" in capsys.readouterr().err
    assert main(["stats", "--target", dead, "--timeout", "2"]) == 1


def test_cli_health_exit_status_through_the_real_entry_point(disk_node: KVNode) -> None:
    ok = subprocess.run([sys.executable, "-m", "kvstore.cli", "health", "--target", disk_node.target],
                        capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "SERVING"


def test_serve_with_a_bad_setting_exits_nonzero(tmp_path: Path) -> None:
    node = KVNode(memory_capacity="lots", metrics=False, startup_timeout_s=60)
    try:
        with pytest.raises(RuntimeError, match="memory.capacity_bytes"):
            node.start()
        assert node.returncode == 2
    finally:
        node.close()


@pytest.mark.parametrize("command", [None, "serve", "stats", "health"])
def test_help_of_each_command_stands_on_its_own(command: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"] if command is None else [command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    if command is None:
        assert "serve" in text and "stats" in text and "health" in text
    else:
        assert "examples:" in text and f"kvstore {command}" in text
    if command == "serve":
        for flag in ("--config", "--host", "--port", "--metrics-port", "--memory-capacity", "--disk-path",
                     "--disk-capacity", "--redis-url", "--log-level"):
            assert flag in text


def test_subcommand_modules_are_registered() -> None:
    assert "kvstore.tools.sim.cli" in SUBCOMMAND_MODULES
    choices = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert {"serve", "stats", "health"} <= set(choices)
    assert "simulate" in choices  # registered by kvstore.tools.sim.cli


def test_a_second_sigterm_cuts_the_grace_short_but_still_closes_the_store(tmp_path: Path) -> None:
    """Regression: the first signal's handler was removed before the drain, so a second SIGTERM (or a second
    Ctrl-C) killed the node mid-drain and the blocks in its memory tier never reached disk."""
    import os
    import signal
    import time

    import grpc

    from kvstore.blocks.tensors import encode_block
    from kvstore.wire import encode_get_request, identity

    ns = namespace(layout="mla", dtype="uint8", block_size=1)
    hashes = [bytes([i]) * 16 for i in range(1, 5)]
    blocks = [encode_block(torch.full((1, 1, 1, 12 << 20), i, dtype=torch.uint8), "mla") for i in range(4)]
    node = KVNode(memory_capacity="128MiB", disk_path=tmp_path / "disk", disk_capacity="256MiB",
                  env={"KVSTORE_SERVER__GRACE_S": "60"})
    with node:
        with KVStoreClient(node.target, retries=0, timeout_s=60) as kv:
            assert kv.put(ns, hashes, blocks) == 4
            assert kv.lookup(ns, hashes).tiers == ("memory",) * 4
        channel = grpc.insecure_channel(node.target, options=[("grpc.max_receive_message_length", 4 << 20)])
        stream = channel.unary_stream("/kvstore.v1.KVStore/Get", request_serializer=identity,
                                      response_deserializer=identity)(encode_get_request(ns, hashes))
        next(stream)  # a stalled reader: the drain would wait out the whole 60 s grace for it
        os.kill(node.pid, signal.SIGTERM)  # type: ignore[arg-type]
        wait_until(lambda: any(r["event"] == "shutting down" for r in node.log_records(since_start=True)), 30,
                   "the node began its drain")
        start = time.monotonic()
        assert node.stop(timeout_s=30) == 0  # the second SIGTERM: observed -15, the node killed mid-drain
        assert time.monotonic() - start < 30
        with pytest.raises(grpc.RpcError):
            list(stream)
        channel.close()
        events = [r["event"] for r in node.log_records(since_start=True)]
        assert "stopped" in events and events.index("shutting down") < events.index("stopped")

        node.start()
        with KVStoreClient(node.target, retries=0, timeout_s=60) as kv:
            assert kv.lookup(ns, hashes).tiers == ("disk",) * 4  # observed: 1 of 4 blocks left
            assert kv.get(ns, hashes) == blocks


def test_during_the_shutdown_delay_health_reports_not_serving_then_the_port_closes(tmp_path: Path) -> None:
    """With ``server.shutdown_delay_s`` the NOT_SERVING of a SIGTERM is visible to probes before the port closes
    (without it, the port closed at once and probes saw only a refused connection)."""
    import os
    import signal
    import time

    from kvstore.errors import UnavailableError

    ns = namespace()
    hashes, tensors = kv_blocks(ns, 2)
    node = KVNode(memory_capacity="16MiB", env={"KVSTORE_SERVER__SHUTDOWN_DELAY_S": "3"})
    with node:
        with KVStoreClient(node.target, retries=0, timeout_s=10) as kv:
            assert kv.put(ns, hashes, tensors) == 2
            assert kv.health() == "SERVING"
            os.kill(node.pid, signal.SIGTERM)  # type: ignore[arg-type]
            deadline = time.monotonic() + 2.5
            while kv.health() == "SERVING" and time.monotonic() < deadline:
                time.sleep(0.05)  # polling the node's health: the signal's effect is seen only by probing
            assert kv.health() == "NOT_SERVING"
            with pytest.raises(UnavailableError, match="shutting down"):
                kv.lookup(ns, hashes)
            assert node._proc is not None and node._proc.wait(timeout=30) == 0
            with pytest.raises(UnavailableError):
                kv.health()
        events = [r["event"] for r in node.log_records(since_start=True)]
        assert events.index("shutting down") < events.index("stopped")


def test_a_disk_that_fills_up_costs_its_demotions_not_the_puts(tmp_path: Path) -> None:
    """Regression: once LMDB could not grow its file (a full filesystem; here ``RLIMIT_FSIZE``), every put
    that had to demote a memory victim failed with UNAVAILABLE ('mdb_txn_commit: Input/output error'),
    and a client of several nodes marked this one down."""
    from kvstore.keys import hash_blocks

    ns = namespace()
    node = KVNode(memory_capacity="1MiB", disk_path=tmp_path / "disk", disk_capacity="64MiB",
                  file_size_limit_bytes=2 << 20)
    with node, KVStoreClient(node.target, retries=0, timeout_s=30) as kv:
        num_blocks = 120  # ~65 KiB each: the memory tier holds ~15, the disk file could hold ~30
        hashes = [hash_blocks(ns, list(range(i * 16, i * 16 + 16)))[0] for i in range(num_blocks)]
        _, (tensor,) = kv_blocks(ns, 1, num_layers=4, num_kv_heads=8, head_dim=64)
        for block_hash in hashes:
            assert kv.put(ns, [block_hash], [tensor]) == 1  # observed: UnavailableError after ~30 puts
        assert kv.lookup(ns, hashes[-1:]).tiers == ("memory",)
        assert torch.equal(kv.get_tensors(ns, hashes[-1:])[0], tensor)
        assert kv.health() == "SERVING"
        logs = [r for r in node.log_records(since_start=True) if r["event"].startswith("demotion from memory dropped")]
        assert logs, "the failed demotions are logged"


@pytest.mark.parametrize("damage", ["value_size", "truncated", "meta_pages"])
def test_a_damaged_lmdb_file_is_quarantined_and_the_node_comes_up_and_serves(tmp_path: Path, damage: str) -> None:
    """Regression (issue 18, finding 2): one value-size field of a leaf page set to 16,744,576 killed the node with
    SIGBUS on every start, logging nothing (LMDB read off the map); a file cut short, or zeroed meta pages, stopped it
    until an operator moved the file by hand. Now the file is checked before LMDB maps it, moved aside with an ERROR
    naming it and the reason, and the node comes up on a new file holding every block that could be salvaged."""
    import struct

    from kvstore.keys import block_key
    from tests.support.lmdb_pages import page_map

    ns = namespace()
    hashes, tensors = kv_blocks(ns, 60, num_layers=4, num_kv_heads=8, head_dim=64)
    chains = [hashes[i:i + 1] for i in range(60)]  # one block per prefix: each stands or falls alone
    node = KVNode(memory_capacity="0", disk_path=tmp_path / "disk", disk_capacity="64MiB")
    with node:
        with KVStoreClient(node.target, retries=0, timeout_s=30) as kv:
            for chain, tensor in zip(chains, tensors):
                assert kv.put(ns, chain, [tensor]) == 1
        assert node.stop() == 0
        data_file = tmp_path / "disk" / "data.mdb"
        layout = page_map(data_file)
        changed: set[int] = set()
        with open(data_file, "r+b") as data:
            if damage == "value_size":
                record = layout.records[b"blocks"][block_key(ns, hashes[7])]
                data.seek(record.node_offset)
                data.write(struct.pack("<HH", 16_744_576 & 0xFFFF, 16_744_576 >> 16))
                changed = {record.path[-1]}
            elif damage == "truncated":
                size = data_file.stat().st_size
                data.truncate(size // 2 // 4096 * 4096)
                changed = set(range(size // 2 // 4096, size // 4096))
            else:
                data.write(bytes(2 * 4096))
                changed = {0, 1}
        node.start()  # observed before: exit -7 (SIGBUS), or 1 with "truncated" / MDB_INVALID
        errors = [r for r in node.log_records(since_start=True) if r["level"] == "ERROR"]
        assert errors and str(data_file) in errors[0]["event"] and "quarantine" in errors[0]["event"]
        assert len(list((tmp_path / "disk" / "quarantine").iterdir())) == 1
        with KVStoreClient(node.target, retries=0, timeout_s=30) as kv:
            for chain, tensor in zip(chains, tensors):
                got = kv.get_tensors(ns, chain)
                assert got == [] or (len(got) == 1 and torch.equal(got[0], tensor))  # a miss, never a wrong byte
                if not layout.hit(b"blocks", block_key(ns, chain[0]), changed):
                    assert len(got) == 1 and torch.equal(got[0], tensor)  # and every block not hit is served
            assert kv.put(ns, chains[7], [tensors[7]]) in (0, 1)
            assert torch.equal(kv.get_tensors(ns, chains[7])[0], tensors[7])
            assert kv.health() == "SERVING"
