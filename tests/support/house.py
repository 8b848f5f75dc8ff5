"""The house's boundaries, measured: cross-module imports of private names, import cycles, ``# type: ignore`` count.

Used by ``tests/test_house.py`` and by hand (``python -m tests.support.house``).
An import counts wherever it is written (top level, in a function, under
``TYPE_CHECKING``): an import cycle hidden in a function body is still a cycle.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import sys
from typing import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_ours(module: str) -> bool:
    return module.split(".")[0] in ("kvstore", "tests", "benchmarks")


def _is_generated(path: pathlib.Path) -> bool:
    return path.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))


def python_files(*roots: str) -> Iterator[pathlib.Path]:
    """Every ``.py`` file under ``roots`` (paths relative to the repository), generated code left out."""
    for root in roots:
        for path in sorted((ROOT / root).rglob("*.py")):
            if not _is_generated(path) and "__pycache__" not in path.parts:
                yield path


def private_imports(*roots: str) -> list[str]:
    """``path: from module import _name`` for each import of a private name (or from a private module) of our own
    code (``kvstore``, ``tests``, ``benchmarks``), generated code aside.

    Another project's underscore is its own convention: ``vllm._custom_ops`` is
    the module vLLM's own kernels and plugins import its custom ops from (the
    vLLM layout tests call them), so third-party modules are not counted.
    """
    found = []
    for path in python_files(*roots):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and (node.level or _is_ours(node.module)):
                names = [a.name for a in node.names if _is_private(a.name)]
                if any(_is_private(part) for part in node.module.split(".")):
                    names.append("*module*")
                for name in names:
                    found.append(f"{path.relative_to(ROOT)}: from {'.' * node.level}{node.module} import {name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if _is_ours(alias.name) and any(_is_private(part) for part in alias.name.split(".")):
                        found.append(f"{path.relative_to(ROOT)}: import {alias.name}")
    return found


def module_names(package: str = "kvstore") -> dict[str, pathlib.Path]:
    """Dotted module name → file, for every module of ``package``."""
    modules = {}
    for path in python_files(package):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_graph(package: str = "kvstore") -> dict[str, set[str]]:
    """Module → the modules of ``package`` it imports (anywhere in its body), to the deepest module named."""
    modules = module_names(package)
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")
                    base = base[:len(base) - node.level + (1 if path.name == "__init__.py" else 0)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [module] + [f"{module}.{a.name}" for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and target.split(".")[0] == package:
                    graph[name].add(target)
    return graph


def import_cycles(package: str = "kvstore") -> list[list[str]]:
    """The strongly connected components of more than one module in the import graph (Tarjan's algorithm)."""
    graph = import_graph(package)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(module_names(package)):
        if node not in index:
            visit(node)
    return cycles


def type_ignores(package: str = "kvstore") -> list[str]:
    """``path:line`` of each ``# type: ignore`` in ``package``."""
    found = []
    for path in python_files(package):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "type: ignore" in line:
                found.append(f"{path.relative_to(ROOT)}:{number}")
    return found


if __name__ == "__main__":
    print("private imports:", *private_imports("kvstore", "tests", "benchmarks"), sep="\n  ")
    print("import cycles:", *import_cycles(), sep="\n  ")
    print(f"type: ignore: {len(type_ignores())}")
