"""Reading damaged LMDB data files safely: the check the disk tier runs before it opens one, and salvage.

LMDB keeps no page checksums and trusts every byte it maps: one flipped value
size or page number in a leaf page sends a read off the end of the map, and the
process dies of SIGBUS with nothing logged; a truncated file or a zeroed meta
page stops it from opening at all. Both functions here read ``data.mdb`` with
``os.pread``, never through a map, so a short or damaged file is an error here,
never a signal:

* :func:`check_data_file` runs py-lmdb's offline verifier (``lmdb.verify``,
  "verify-then-trust"), which checks every page the committed snapshot
  reaches (page numbers, types, node bounds, key order, tree counters,
  overflow extents, the free list and that live and free pages cover the file
  exactly), and adds the one rule it leaves out: the file must hold every page
  up to the last one in use, or a read of a value cut short is a SIGBUS;
* :func:`salvage_records` reads every record that can still be reached from the
  newest valid snapshot (meta page), skipping damaged pages and values.

Only what the disk tier writes is understood by the salvage reader: LMDB 0.9's
format (``MDB_DATA_VERSION`` 1, 64-bit page numbers, little-endian), named trees
without ``MDB_DUPSORT``; the layout follows ``libraries/liblmdb/mdb.c``
(``MDB_page``, ``MDB_node``, ``MDB_db``, ``MDB_meta``). Nothing here writes to the file.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Container, Iterator

from lmdb import verify as lmdb_verify

PAGE_HEADER_BYTES = 16  # PAGEHDRSZ: pgno u64, pad u16, flags u16, lower u16, upper u16 (or overflow page count u32)
NODE_HEADER_BYTES = 8  # NODESIZE: lo u16, hi u16, flags u16, ksize u16
NUM_METAS = 2
MAX_KEY_BYTES = 511  # MDB_MAXKEYSIZE of the default build
MAX_DEPTH = 32  # CURSOR_STACK
P_INVALID = (1 << 64) - 1  # the root of an empty tree
MDB_MAGIC = 0xBEEFC0DE
MDB_DATA_VERSION = 1

P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_DIRTY, P_KEEP = 0x01, 0x02, 0x04, 0x08, 0x10, 0x8000
F_BIGDATA, F_SUBDATA = 0x01, 0x02

_PAGE = struct.Struct("<QHHHH")
_OVERFLOW = struct.Struct("<QHHI")
_NODE = struct.Struct("<HHHH")
_DB = struct.Struct("<IHHQQQQQ")  # MDB_db: pad (the page size in the free tree's), flags, depth, branch, leaf,
# overflow pages, entries, root
_META = struct.Struct("<IIQQ")  # magic, version, address, map size; then two MDB_db, last page, txnid
_META_TAIL = struct.Struct("<QQ")


class DamagedFile(Exception):
    """A page or record of the file cannot be read as LMDB wrote it; the message names it."""


@dataclass(frozen=True, slots=True)
class TreeRecord:
    """An ``MDB_db``: where one tree starts and what its pages hold.

    Attributes:
        flags: ``md_flags`` (``MDB_INTEGERKEY`` for the free-page tree).
        depth: levels of pages, 0 for an empty tree.
        num_branch_pages, num_leaf_pages, num_overflow_pages, num_entries: the recorded counts.
        root: page number of the root, :data:`P_INVALID` when empty.
    """

    flags: int
    depth: int
    num_branch_pages: int
    num_leaf_pages: int
    num_overflow_pages: int
    num_entries: int
    root: int

    @classmethod
    def unpack(cls, raw: bytes, offset: int = 0) -> tuple[int, TreeRecord]:
        pad, flags, depth, branch, leaf, overflow, entries, root = _DB.unpack_from(raw, offset)
        return pad, cls(flags, depth, branch, leaf, overflow, entries, root)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One meta page: a committed transaction's view of the file.

    Attributes:
        slot: which meta page (0 or 1).
        txnid: the transaction that wrote it.
        page_bytes: the file's page size.
        last_page: the last page in use (``mm_last_pg``).
        free_tree, main_tree: the free-page tree and the main tree (which names the others).
    """

    slot: int
    txnid: int
    page_bytes: int
    last_page: int
    free_tree: TreeRecord
    main_tree: TreeRecord


class PageFile:
    """``data.mdb`` read by page with ``os.pread``: a page past the end of the file is :class:`DamagedFile`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self.page_bytes = 0

    def close(self) -> None:
        """Close the file."""
        os.close(self.fd)

    def read(self, offset: int, nbytes: int, what: str) -> bytes:
        """``nbytes`` at ``offset``.

        Raises:
            DamagedFile: naming ``what``, if they lie past the end of the file.
        """
        if offset < 0 or offset + nbytes > self.size:
            raise DamagedFile(f"{what} lies past the end of the file ({self.size} bytes)")
        data = os.pread(self.fd, nbytes, offset)
        if len(data) != nbytes:
            raise DamagedFile(f"{what}: short read")
        return data

    def page(self, pgno: int) -> bytes:
        """Page ``pgno`` (:attr:`page_bytes` set first, from a meta page)."""
        return self.read(pgno * self.page_bytes, self.page_bytes, f"page {pgno}")


def _read_meta(file: PageFile, slot: int, page_bytes: int) -> Snapshot:
    """Meta page ``slot`` as ``mdb_env_read_header`` reads it (meta 1 sits one page of meta 0's size further).

    Raises:
        DamagedFile: where LMDB would refuse it (MDB_INVALID, MDB_VERSION_MISMATCH), or on a page size it cannot use.
    """
    raw = file.read(slot * page_bytes, PAGE_HEADER_BYTES + _META.size + 2 * _DB.size + _META_TAIL.size,
                    f"meta page {slot}")
    pgno, _, flags, _, _ = _PAGE.unpack_from(raw)
    if not flags & P_META:
        raise DamagedFile(f"meta page {slot} is not marked as a meta page (flags {flags:#x})")
    magic, version, _, _ = _META.unpack_from(raw, PAGE_HEADER_BYTES)
    if magic != MDB_MAGIC:
        raise DamagedFile(f"meta page {slot} has a bad magic {magic:#x}")
    if version != MDB_DATA_VERSION:
        raise DamagedFile(f"meta page {slot} is of LMDB data version {version}, not {MDB_DATA_VERSION}")
    offset = PAGE_HEADER_BYTES + _META.size
    psize, free_tree = TreeRecord.unpack(raw, offset)
    _, main_tree = TreeRecord.unpack(raw, offset + _DB.size)
    last_page, txnid = _META_TAIL.unpack_from(raw, offset + 2 * _DB.size)
    if pgno != slot:
        raise DamagedFile(f"meta page {slot} names itself page {pgno}")
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        raise DamagedFile(f"meta page {slot} has a page size of {psize}")
    return Snapshot(slot, txnid, psize, last_page, free_tree, main_tree)


def read_snapshots(path: str | os.PathLike[str]) -> list[Snapshot]:
    """The readable meta pages of ``path``, newest first (the first is the one LMDB uses, when both are readable)."""
    file = PageFile(path)
    try:
        return snapshots_of(file, [])
    finally:
        file.close()


def snapshots_of(file: PageFile, problems: list[str]) -> list[Snapshot]:
    """The meta pages of ``file`` that read, newest first (as ``mdb_env_pick_meta`` picks them); each one that does
    not is appended to ``problems``."""
    found: list[Snapshot] = []
    page_bytes = 4096
    for slot in range(NUM_METAS):
        try:
            snapshot = _read_meta(file, slot, page_bytes)
        except DamagedFile as exc:
            problems.append(str(exc))
            continue
        if slot == 0:
            page_bytes = snapshot.page_bytes
        found.append(snapshot)
    found.sort(key=lambda s: (s.txnid, -s.slot), reverse=True)  # ties go to meta 0, as mdb_env_pick_meta
    return found


def check_data_file(path: str | os.PathLike[str]) -> list[str]:
    """Whether LMDB can be trusted with a data file: its problems, first found first; empty when there are none.

    Args:
        path: the ``data.mdb`` of an environment that no process has open.

    Returns:
        What ``lmdb.verify`` found, plus a truncation (the file shorter than the
        pages the committed meta page says are in use).

    Raises:
        OSError: if the file cannot be read.
    """
    try:
        problems = list(lmdb_verify.verify(os.fspath(path), subdir=False))
    except lmdb_verify.VerifyError as exc:
        return [str(exc)]
    snapshots = read_snapshots(path)
    if snapshots:
        newest = snapshots[0]
        needed_bytes = (newest.last_page + 1) * newest.page_bytes
        size = os.path.getsize(path)
        if size < needed_bytes:
            problems.append(f"the file is truncated: {size} bytes, but its pages need {needed_bytes}")
    return problems


def page_nodes(page: bytes, pgno: int, page_bytes: int, what: str) -> tuple[list[tuple[bytes, int, bytes | int]], bool]:
    """The nodes of a branch or leaf page: ``(key, flags, data)`` (leaf; ``data`` is the value, or for a big node its
    size and overflow page as 12 bytes) or ``(key, 0, child page)`` (branch); and whether it is a leaf.

    Raises:
        DamagedFile: if the page is not a branch or leaf page, names another page, or a node is out of bounds.
    """
    self_pgno, _, flags, lower, upper = _PAGE.unpack_from(page)
    kind = flags & ~(P_DIRTY | P_KEEP)
    if self_pgno != pgno:
        raise DamagedFile(f"{what} names itself page {self_pgno}")
    if kind not in (P_BRANCH, P_LEAF):
        raise DamagedFile(f"{what}: flags {flags:#x}, not a branch or leaf page")
    if lower < PAGE_HEADER_BYTES + 2 or lower % 2 or upper > page_bytes or lower > upper:
        raise DamagedFile(f"{what}: free space from {lower} to {upper}")
    num_keys = (lower - PAGE_HEADER_BYTES) >> 1
    is_leaf = kind == P_LEAF
    nodes: list[tuple[bytes, int, bytes | int]] = []
    for offset in struct.unpack_from(f"<{num_keys}H", page, PAGE_HEADER_BYTES):
        if offset % 2 or offset < upper or offset + NODE_HEADER_BYTES > page_bytes:
            raise DamagedFile(f"{what}: a node at offset {offset}")
        lo, hi, node_flags, ksize = _NODE.unpack_from(page, offset)
        key_end = offset + NODE_HEADER_BYTES + ksize
        if ksize > MAX_KEY_BYTES or key_end > page_bytes or (is_leaf and ksize == 0):
            raise DamagedFile(f"{what}: a key of {ksize} bytes at offset {offset}")
        key = page[offset + NODE_HEADER_BYTES: key_end]
        if not is_leaf:
            nodes.append((key, 0, lo | hi << 16 | node_flags << 32))
            continue
        size = lo | hi << 16
        data_bytes = 8 if node_flags & F_BIGDATA else size
        if key_end + data_bytes > page_bytes:
            raise DamagedFile(f"{what}: a value of {data_bytes} bytes at offset {key_end}")
        data = page[key_end: key_end + data_bytes]
        nodes.append((key, node_flags, struct.pack("<I", size) + data if node_flags & F_BIGDATA else data))
    return nodes, is_leaf


@dataclass(frozen=True, slots=True)
class SalvagedRecord:
    """One record :func:`salvage_records` could read: the named tree it is in, its key and its value."""

    tree: bytes
    key: bytes
    value: bytes


def salvage_records(path: str | os.PathLike[str], trees: Container[bytes] | None = None) -> Iterator[SalvagedRecord]:
    """Every record still readable in a damaged data file, from the newest snapshot whose meta page is valid.

    Records come one at a time, read as they are yielded (a large file is never
    held in memory); ``trees`` picks the named trees to read (all when ``None``).
    A page that cannot be read as a branch or leaf page is skipped with all it
    points to; a node out of its page's bounds, or a value whose overflow run is
    damaged, is skipped alone. The older snapshot is read only when the newer
    meta page is invalid: it may still hold records the last transaction
    deleted, which must not come back. Nothing read here is trusted: the caller
    checks each value (the disk tier checks each block against its key and checksum).

    Raises:
        OSError: if the file cannot be opened.
    """
    file = PageFile(path)
    try:
        snapshots = snapshots_of(file, [])
        if not snapshots:
            return
        snapshot = snapshots[0]
        file.page_bytes = snapshot.page_bytes
        for name, tree in _salvage_names(file, snapshot):
            if trees is None or name in trees:
                for key, value in _salvage_tree(file, snapshot, tree):
                    yield SalvagedRecord(name, key, value)
    finally:
        file.close()


def _salvage_names(file: PageFile, snapshot: Snapshot) -> list[tuple[bytes, TreeRecord]]:
    names = []
    for key, value in _salvage_tree(file, snapshot, snapshot.main_tree, main=True):
        if len(value) == _DB.size:
            names.append((key, TreeRecord.unpack(value)[1]))
    return names


def _salvage_tree(file: PageFile, snapshot: Snapshot, tree: TreeRecord, *, main: bool = False) -> Iterator[tuple[bytes, bytes]]:
    if tree.root == P_INVALID:
        return
    page_bytes = file.page_bytes
    visited: set[int] = set()
    stack = [(tree.root, 1)]
    while stack:
        pgno, depth = stack.pop()
        if pgno in visited or not NUM_METAS <= pgno <= snapshot.last_page or depth > MAX_DEPTH:
            continue
        visited.add(pgno)
        try:
            nodes, is_leaf = page_nodes(file.page(pgno), pgno, page_bytes, f"page {pgno}")
        except DamagedFile:
            continue
        if not is_leaf:
            stack.extend((child, depth + 1) for _, _, child in reversed(nodes) if isinstance(child, int))
            continue
        for key, flags, data in nodes:
            if not isinstance(data, bytes) or main != bool(flags & F_SUBDATA) or flags & ~(F_BIGDATA | F_SUBDATA):
                continue
            if not flags & F_BIGDATA:
                yield key, data
                continue
            size, first = struct.unpack("<IQ", data)
            try:
                head = file.read(first * page_bytes, _OVERFLOW.size, f"page {first}")
                self_pgno, _, page_flags, num_pages = _OVERFLOW.unpack(head)
                if self_pgno != first or page_flags & ~(P_DIRTY | P_KEEP) != P_OVERFLOW or \
                        num_pages != (PAGE_HEADER_BYTES - 1 + size) // page_bytes + 1:
                    continue
                yield key, file.read(first * page_bytes + PAGE_HEADER_BYTES, size, f"the value at page {first}")
            except DamagedFile:
                continue
