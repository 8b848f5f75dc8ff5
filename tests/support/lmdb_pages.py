"""Where each record of an LMDB data file lives, page by page: for corruption tests to aim at, and to judge.

:func:`page_map` walks the newest snapshot of a clean ``data.mdb`` (with the
bounds-checked reader of ``kvstore.tiers.lmdb_file``) and records, for every
record of every named tree, the pages a read of it goes through: the main
tree's pages (which name the tree), the tree's branch pages and leaf page, and
the overflow run of a large value. A record is *hit* by a corruption when a
byte of one of those pages, or of a meta page, changed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.tiers.lmdb_file import (
    F_BIGDATA,
    NUM_METAS,
    P_INVALID,
    PageFile,
    TreeRecord,
    page_nodes,
    snapshots_of,
)


@dataclass(frozen=True, slots=True)
class RecordPages:
    """The pages one record depends on: the path from the main tree's root to its leaf, and its overflow run.

    Attributes:
        path: page numbers from the main tree's root down to the record's leaf page.
        overflow: the pages of its value, when the value is large (``range(0)`` otherwise).
        node_offset: where the record's leaf node starts in the file, bytes: its data size (two ``uint16``,
            low half first), flags and key size, then the key (``MDB_node``).
    """

    path: tuple[int, ...]
    overflow: range
    node_offset: int

    def pages(self) -> set[int]:
        """Every page of the record."""
        return {*self.path, *self.overflow}


@dataclass(slots=True)
class PageMap:
    """The layout of a data file's newest snapshot.

    Attributes:
        page_bytes: the page size.
        num_pages: pages in the file.
        records: per named tree, per key, its pages.
        tree_pages: per named tree (and ``b""`` for the main tree, ``b"free"`` for the free-page tree),
            its branch and leaf pages.
    """

    page_bytes: int
    num_pages: int
    records: dict[bytes, dict[bytes, RecordPages]] = field(default_factory=dict)
    tree_pages: dict[bytes, list[int]] = field(default_factory=dict)

    def leaf_pages(self, tree: bytes) -> list[int]:
        """The leaf pages of a named tree, in key order."""
        leaves = []
        for record in self.records[tree].values():
            if record.path[-1] not in leaves:
                leaves.append(record.path[-1])
        return leaves

    def hit(self, tree: bytes, key: bytes, changed_pages: set[int]) -> bool:
        """Whether a corruption that changed ``changed_pages`` touched the record (a meta page counts for all)."""
        if changed_pages & set(range(NUM_METAS)):
            return True
        record = self.records[tree].get(key)
        return record is None or bool(record.pages() & changed_pages)


def page_map(path: str | Path) -> PageMap:
    """Map the records of the clean data file ``path`` (see the module docstring).

    Raises:
        kvstore.tiers.lmdb_file.DamagedFile: if the file is not clean.
    """
    file = PageFile(path)
    try:
        snapshot = snapshots_of(file, [])[0]
        file.page_bytes = snapshot.page_bytes
        result = PageMap(snapshot.page_bytes, file.size // snapshot.page_bytes)
        main_records = _walk(file, snapshot.main_tree, (), result, b"")
        free_records = _walk(file, snapshot.free_tree, (), result, b"free")
        del free_records
        for name, (main_path, value) in main_records.items():
            _, tree = TreeRecord.unpack(value)
            result.records[name] = {key: pages for key, (pages, _) in
                                    _walk(file, tree, main_path, result, name, with_overflow=True).items()}
        return result
    finally:
        file.close()


def _walk(file: PageFile, tree: TreeRecord, above: tuple[int, ...], result: PageMap, name: bytes,
          *, with_overflow: bool = False) -> dict[bytes, tuple]:
    found: dict[bytes, tuple] = {}
    result.tree_pages[name] = []
    if tree.root == P_INVALID:
        return found
    stack = [(tree.root, above)]
    while stack:
        pgno, path = stack.pop()
        result.tree_pages[name].append(pgno)
        page = file.page(pgno)
        nodes, is_leaf = page_nodes(page, pgno, file.page_bytes, f"page {pgno}")
        path = (*path, pgno)
        if not is_leaf:
            stack.extend((child, path) for _, _, child in reversed(nodes))
            continue
        lower = struct.unpack_from("<H", page, 12)[0]
        offsets = struct.unpack_from(f"<{(lower - 16) // 2}H", page, 16)
        for (key, flags, data), offset in zip(nodes, offsets):
            overflow = range(0)
            if flags & F_BIGDATA:
                size, first = struct.unpack("<IQ", data)
                overflow = range(first, first + (16 - 1 + size) // file.page_bytes + 1)
            record = RecordPages(path, overflow, pgno * file.page_bytes + offset)
            found[key] = (record, data) if with_overflow else (path, data)
    return found
