"""The disk tier's corruption fuzzer: put blocks, stop the node, damage its LMDB file, start it, check every byte.

One trial (:func:`run_trial`):

1. a node (a real ``kvstore serve``, or a lighter store process: an embedded
   store in a child process) puts prefixes of blocks into a disk-only store, and stops;
2. ``data.mdb`` is damaged in one of the ways of :data:`MODES`: random byte
   flips (1 to 1,000), flips aimed at leaf, branch, meta, free-list or
   overflow pages, value sizes set off the map, a truncation, a zeroed region;
3. the node starts again (a failed start is counted), and every prefix is
   read back: each block served is checked against the digest this module
   kept when it made the block (a wrong one is counted), and each block the
   damage did not reach (:mod:`tests.support.lmdb_pages`, with every block
   before it in its prefix) must be served;
4. the node then takes new blocks, stops, starts, and everything is checked
   once more, so that damage the first start let through shows up.

Blocks are made from a seed (``encode_header`` over random bytes), so the
store process and the checker agree on them without sending them over.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol

import numpy as np

from kvstore.blocks.tensors import Layout, encode_header
from kvstore.keys import Namespace, block_key, hash_blocks
from tests.support.lmdb_pages import PageMap, page_map

REPO_ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = Namespace(model="tests/disk-fuzz", dtype="float16", block_size=16)
MODES = ("flips", "leaf", "branch", "meta", "free", "overflow", "value_size", "truncate", "zero")
"""How :func:`damage` damages a file; each trial picks one."""
DISK_CAPACITY = "64MiB"


# ---------------------------------------------------------------------------- blocks


def chain_blocks(seed: int, chain: int, length: int, kv_encoding: str = "") -> tuple[list[bytes], list[bytes]]:
    """The hashes and encoded blocks of prefix ``chain`` of a trial: ``[2, 2, H, 16, 64]`` float16, H in 1..8.

    H is drawn once per chain (the blocks of one put share a shape), so blocks
    are 8 to 64 KiB: some share leaf pages and all have overflow pages. With
    ``kv_encoding``, the blocks are Gaussian float16 tensors under that lossy
    encoding (``kvstore.blocks.encoding``), so damage can reach their scales and codes.
    """
    rng = np.random.default_rng([seed, chain])
    tokens = rng.integers(0, 50_000, size=length * NAMESPACE.block_size)
    shape = (2, 2, int(rng.choice([1, 2, 4, 8])), NAMESPACE.block_size, 64)
    blocks = []
    for _ in range(length):
        if kv_encoding:
            import torch

            from kvstore.blocks.encoding import encode_lossy

            tensor = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(torch.float16)
            blocks.append(bytes(encode_lossy(tensor, Layout.KV, kv_encoding)))
            continue
        payload = rng.integers(0, 256, size=int(np.prod(shape)) * 2, dtype=np.uint8).tobytes()
        blocks.append(encode_header("float16", Layout.KV, shape, payload) + payload)
    return [bytes(h) for h in hash_blocks(NAMESPACE, tokens)], blocks


def digest(block: bytes | memoryview) -> str:
    return hashlib.sha256(block).hexdigest()


# ---------------------------------------------------------------------------- nodes


class Node(Protocol):
    """What a trial needs from a node: start (``False`` if it did not come up), put, digests of gets, stop."""

    def start(self) -> bool: ...
    def put(self, seed: int, chains: range, length: int) -> None: ...
    def digests(self, seed: int, chains: range, length: int) -> list[list[str]]: ...
    def stop(self) -> None: ...
    def close(self) -> None: ...


class StoreProcess:
    """An embedded store with only a disk tier, in a child process driven by JSON lines (this module's ``__main__``).

    Lighter than a ``kvstore serve`` node (no gRPC, no torch), so the benchmark runs many trials; a crash of
    the child, such as a SIGBUS, is a failed start or a failed call just the same.
    """

    def __init__(self, disk_path: Path) -> None:
        self.disk_path = disk_path
        self._proc: subprocess.Popen[str] | None = None
        self.last_error = ""

    def start(self) -> bool:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.support.disk_fuzz", str(self.disk_path)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env, cwd=str(REPO_ROOT))
        try:
            self._call({"op": "ping"})
        except RuntimeError as exc:
            self.last_error = str(exc)
            return False
        return True

    def _call(self, request: dict[str, Any]) -> Any:
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self._proc.wait(timeout=60)
            stderr = self._proc.stderr.read() if self._proc.stderr else ""
            raise RuntimeError(f"store process exited ({self._proc.returncode}): {stderr[-2000:]}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["result"]

    def put(self, seed: int, chains: range, length: int) -> None:
        self._call({"op": "put", "seed": seed, "chains": [chains.start, chains.stop], "length": length})

    def digests(self, seed: int, chains: range, length: int) -> list[list[str]]:
        return self._call({"op": "digests", "seed": seed, "chains": [chains.start, chains.stop], "length": length})

    def stop(self) -> None:
        if self._proc is None:
            return
        try:
            self._call({"op": "close"})
        except RuntimeError:
            pass
        self._proc.wait(timeout=60)
        self._proc = None

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=60)
            self._proc = None


class ServeNode:
    """A real ``kvstore serve`` node with only a disk tier, reached over gRPC."""

    def __init__(self, disk_path: Path) -> None:
        from tests.support.kvnode import KVNode

        self.node = KVNode(memory_capacity="0", disk_path=disk_path, disk_capacity=DISK_CAPACITY, metrics=False,
                           startup_timeout_s=120.0)
        self.last_error = ""

    def start(self) -> bool:
        try:
            self.node.start()
        except RuntimeError as exc:
            self.last_error = str(exc)
            return False
        return True

    def _client(self):  # type: ignore[no-untyped-def]
        from kvstore.client import KVStoreClient

        return KVStoreClient(self.node.target, retries=0, timeout_s=60)

    def put(self, seed: int, chains: range, length: int) -> None:
        with self._client() as kv:
            for chain in chains:
                kv.put(NAMESPACE, *chain_blocks(seed, chain, length))

    def digests(self, seed: int, chains: range, length: int) -> list[list[str]]:
        with self._client() as kv:
            return [[digest(b) for b in kv.get(NAMESPACE, chain_blocks(seed, chain, length)[0])] for chain in chains]

    def stop(self) -> None:
        self.node.stop()

    def close(self) -> None:
        self.node.close()


# ---------------------------------------------------------------------------- damage


@dataclass
class Damage:
    """What :func:`damage` did: the mode, how many bytes it flipped, and the pages whose bytes changed."""

    mode: str
    num_flips: int = 0
    changed_pages: set[int] = field(default_factory=set)
    note: str = ""


def _flip(data: bytearray, offset: int, rng: random.Random, damage: Damage, page_bytes: int) -> None:
    if 0 <= offset < len(data):
        data[offset] ^= rng.randrange(1, 256)
        damage.num_flips += 1
        damage.changed_pages.add(offset // page_bytes)


def damage(path: Path, layout: PageMap, rng: random.Random, mode: str) -> Damage:
    """Damage the data file ``path`` (whose clean layout is ``layout``) in the way ``mode`` names."""
    data = bytearray(path.read_bytes())
    psize = layout.page_bytes
    result = Damage(mode)
    trees = {name: pages for name, pages in layout.tree_pages.items()}
    leaves = [p for name in (b"blocks", b"meta") for p in layout.leaf_pages(name)]
    branches = [p for name, pages in trees.items() if name != b"free" for p in pages if p not in leaves]
    if mode == "flips":
        for _ in range(max(1, round(10 ** rng.uniform(0, 3)))):
            _flip(data, rng.randrange(len(data)), rng, result, psize)
    elif mode in ("leaf", "branch", "free"):
        pool = {"leaf": leaves, "branch": branches, "free": trees.get(b"free", [])}[mode] or leaves
        for _ in range(rng.randint(1, 20)):
            page = rng.choice(pool)
            _flip(data, page * psize + rng.randrange(psize), rng, result, psize)
    elif mode == "meta":
        if rng.random() < 0.3:
            page = rng.randrange(2)
            data[page * psize:(page + 1) * psize] = bytes(psize)
            result.changed_pages.add(page)
            result.note = f"zeroed meta page {page}"
        else:
            for _ in range(rng.randint(1, 4)):
                _flip(data, rng.randrange(2) * psize + rng.randrange(160), rng, result, psize)
    elif mode == "overflow":
        records = list(layout.records[b"blocks"].values())
        for _ in range(rng.randint(1, 10)):
            record = rng.choice(records)
            _flip(data, record.overflow.start * psize + rng.randrange(16 + 128), rng, result, psize)
    elif mode == "value_size":
        records = list(layout.records[b"blocks"].values())
        for record in rng.sample(records, rng.randint(1, 3)):
            size = rng.choice([16_744_576, 0xFFFFFFFF, rng.randrange(1 << 32), rng.randrange(1, 1 << 16)])
            struct.pack_into("<HH", data, record.node_offset, size & 0xFFFF, size >> 16)
            result.changed_pages.add(record.node_offset // psize)
            result.num_flips += 4
    elif mode == "truncate":
        cut = rng.randrange(0, len(data))
        if rng.random() < 0.5:
            cut = cut // psize * psize
        result.changed_pages.update(range(cut // psize, len(data) // psize + 1))
        result.note = f"truncated to {cut} of {len(data)} bytes"
        del data[cut:]
    elif mode == "zero":
        length = rng.randint(4096, 256 * 1024)
        start = rng.randrange(0, max(1, len(data) - length))
        if rng.random() < 0.5:
            start = start // psize * psize
        data[start:start + length] = bytes(len(data[start:start + length]))
        result.changed_pages.update(range(start // psize, (start + length - 1) // psize + 1))
        result.note = f"zeroed {length} bytes at {start}"
    else:
        raise ValueError(mode)
    path.write_bytes(bytes(data))
    return result


# ---------------------------------------------------------------------------- trials


@dataclass
class Counts:
    """What trials found; the last three must stay 0.

    Attributes:
        trials: trials run. flips: bytes changed by flips (and value sizes).
        truncations, zeroed_regions: those trials.
        blocks_checked: blocks read back and compared with their digests (both reads of a trial).
        blocks_served: of those, served.
        repaired_starts: starts that quarantined the file and salvaged it.
        wrong_blocks: blocks served whose bytes differ from what was put.
        failed_starts: starts that did not come up (or calls that failed).
        lost_blocks: blocks the damage did not reach that were not served.
    """

    trials: int = 0
    flips: int = 0
    truncations: int = 0
    zeroed_regions: int = 0
    blocks_checked: int = 0
    blocks_served: int = 0
    repaired_starts: int = 0
    wrong_blocks: int = 0
    failed_starts: int = 0
    lost_blocks: int = 0
    per_mode: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def add(self, other: Counts) -> None:
        for f in dataclasses.fields(self):
            if f.name == "per_mode":
                for mode, count in other.per_mode.items():
                    self.per_mode[mode] = self.per_mode.get(mode, 0) + count
            elif f.name == "failures":
                self.failures.extend(other.failures)
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check(counts: Counts, seed: int, chains: range, length: int, got: list[list[str]],
           expected_served: dict[int, int]) -> None:
    """Compare what was served with the digests; ``expected_served[chain]``: blocks it must serve at least."""
    for chain, digests in zip(chains, got):
        _, blocks = chain_blocks(seed, chain, length)
        counts.blocks_checked += length
        counts.blocks_served += len(digests)
        for block, served in zip(blocks, digests):
            if served != digest(block):
                counts.wrong_blocks += 1
                counts.failures.append(f"seed {seed} chain {chain}: a wrong block served")
        if len(digests) < expected_served.get(chain, 0):
            counts.lost_blocks += expected_served[chain] - len(digests)
            counts.failures.append(f"seed {seed} chain {chain}: {len(digests)} served, "
                                   f"{expected_served[chain]} not reached by the damage")


def run_trial(seed: int, mode: str, *, node_kind: str = "process", num_chains: int = 24, length: int = 4,
              workdir: Path | None = None) -> Counts:
    """One trial (see the module docstring); returns its counts."""
    counts = Counts(trials=1, per_mode={mode: 1})
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix=f"disk-fuzz-{seed}-", dir=workdir))
    disk = root / "disk"
    make = StoreProcess if node_kind == "process" else ServeNode
    node: Node = make(disk)  # type: ignore[assignment]
    chains = range(num_chains)
    try:
        if not node.start():
            raise RuntimeError(f"the clean node did not start: {node.last_error}")  # type: ignore[attr-defined]
        node.put(seed, chains, length)
        node.stop()
        data_file = disk / "data.mdb"
        layout = page_map(data_file)
        hurt = damage(data_file, layout, rng, mode)
        counts.flips += hurt.num_flips
        counts.truncations += mode == "truncate"
        counts.zeroed_regions += mode == "zero"
        expected = {}
        for chain in chains:
            hashes, _ = chain_blocks(seed, chain, length)
            intact = 0
            for block_hash in hashes:
                if layout.hit(b"blocks", block_key(NAMESPACE, block_hash), hurt.changed_pages):
                    break
                intact += 1
            expected[chain] = intact
        if not node.start():
            counts.failed_starts += 1
            counts.failures.append(f"seed {seed} {mode}: the node did not come up: "
                                   f"{node.last_error[-500:]}")  # type: ignore[attr-defined]
            return counts
        counts.repaired_starts += (disk / "quarantine").exists()
        try:
            _check(counts, seed, chains, length, node.digests(seed, chains, length), expected)
            more = range(num_chains, num_chains + 4)
            node.put(seed, more, length)  # the node still takes writes
            expected.update({chain: length for chain in more})
            node.stop()
            if not node.start():
                counts.failed_starts += 1
                counts.failures.append(f"seed {seed} {mode}: the second start failed: "
                                       f"{node.last_error[-500:]}")  # type: ignore[attr-defined]
                return counts
            _check(counts, seed, range(num_chains + 4), length, node.digests(seed, range(num_chains + 4), length),
                   expected)
        except RuntimeError as exc:
            counts.failed_starts += 1
            counts.failures.append(f"seed {seed} {mode}: a call failed: {str(exc)[-500:]}")
        return counts
    finally:
        node.close()
        shutil.rmtree(root, ignore_errors=True)


def trials(seeds: Iterator[int] | range, **kwargs: Any) -> Counts:
    """Run one trial per seed, the mode cycling through :data:`MODES`; the counts summed."""
    total = Counts()
    for seed in seeds:
        total.add(run_trial(seed, MODES[seed % len(MODES)], **kwargs))
    return total


# ---------------------------------------------------------------------------- the store process


def _serve(disk_path: str) -> None:  # pragma: no cover - runs in the child
    import logging

    from kvstore.config import DiskTierConfig, MemoryTierConfig, StoreConfig
    from kvstore.embedded import open_store

    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    config = StoreConfig(memory=MemoryTierConfig(enabled=False),
                         disk=DiskTierConfig(path=disk_path, capacity_bytes=64 << 20))
    store = open_store(config)
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        try:
            result: Any = None
            if op == "put":
                for chain in range(*request["chains"]):
                    store.put(NAMESPACE, *chain_blocks(request["seed"], chain, request["length"]))
            elif op == "digests":
                result = [[digest(b) for b in store.get(NAMESPACE, chain_blocks(request["seed"], chain,
                                                                                request["length"])[0])]
                          for chain in range(*request["chains"])]
            elif op == "close":
                store.close()
            reply = {"result": result}
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
        if op == "close":
            return


if __name__ == "__main__":  # pragma: no cover
    _serve(sys.argv[1])
