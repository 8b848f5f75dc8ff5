"""The house's boundaries (issue 45): private names stay private, imports point one way, types are checked.

Measured by ``tests/support/house.py``; ``docs/design.md`` (the newcomer's
guide) says which floor each package is on and what each may import.
"""

from __future__ import annotations

import subprocess
import sys

from tests.support.house import ROOT, import_cycles, import_graph, private_imports, type_ignores

MAX_TYPE_IGNORES = 15

# The floors of the house, bottom up (docs/design.md, "The floors"): a module may import its own floor and
# those below, never one above.
FLOORS: list[tuple[str, ...]] = [
    # 0, the ground: typed errors and process helpers
    ("kvstore.errors", "kvstore.ratelog", "kvstore.host_memory", "kvstore.unix_sockets"),
    # 1, what everything speaks: the block format, keys, the API's types, config, eviction policies (pure logic)
    ("kvstore.blocks", "kvstore.keys", "kvstore.validation", "kvstore.config", "kvstore.api", "kvstore.policy"),
    # 2, the tiers (the node's shared pool among them) and the store's event records
    ("kvstore.tiers", "kvstore.shm.allocator", "kvstore.shm.segment", "kvstore.shm.node.pool", "kvstore.events.log",
     "kvstore.events.schema"),
    # 3, the store core
    ("kvstore.store",),
    # 4, over the store: the node, its wire and its planes, the clients, the embedded store, the events' streams
    ("kvstore.wire", "kvstore.error_codes", "kvstore.security", "kvstore.routing", "kvstore.connection",
     "kvstore.shm", "kvstore.bulk", "kvstore.server", "kvstore.client", "kvstore.v1", "kvstore.events",
     "kvstore.embedded", "kvstore.store.factory"),
    # 5, the engines' side
    ("kvstore.connectors",),
    # 6, the tools and the command line
    ("kvstore.tools", "kvstore.cli", "kvstore"),
]


def floor_of(module: str) -> int:
    """The floor of ``module``: that of the longest prefix named in :data:`FLOORS`.

    Raises:
        KeyError: for a module no floor names.
    """
    best = None
    for number, names in enumerate(FLOORS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (number, name)
    if best is None:
        raise KeyError(module)
    return best[0]


def test_no_module_imports_another_modules_private_names():
    assert private_imports("kvstore", "tests", "benchmarks") == []


def test_the_import_graph_has_no_cycles():
    assert import_cycles() == []


def test_imports_point_down_the_floors():
    upward = [f"{source} (floor {floor_of(source)}) -> {target} (floor {floor_of(target)})"
              for source, targets in import_graph().items() for target in targets
              if floor_of(target) > floor_of(source)]
    assert upward == []


def test_type_ignores_are_few():
    assert len(type_ignores()) <= MAX_TYPE_IGNORES, type_ignores()


def test_mypy_strict_is_clean_on_the_client_the_connectors_and_the_store_core():
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:]
