"""No code in the ``kvstore`` package can turn received or stored bytes into Python objects (an AST scan).

KV blocks are raw bytes behind an explicit header (``kvstore.blocks.tensors``); configuration
and token files are read with ``yaml.safe_load``. Pickle-family loaders run code
chosen by whoever wrote the bytes, so a cache that other tenants or nodes write
to must never use them.
"""

from __future__ import annotations

import pytest

import ast
from pathlib import Path

import kvstore

PACKAGE_DIR = Path(kvstore.__file__).resolve().parent
BANNED_MODULES = frozenset({"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "joblib", "jsonpickle"})
BANNED_CALLS = frozenset({
    "marshal.load", "marshal.loads", "torch.load", "yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all",
    "yaml.full_load_all", "pandas.read_pickle", "pd.read_pickle", "numpy.lib.format.read_array",
})
BANNED_BUILTINS = frozenset({"eval", "exec", "compile", "__import__"})
SAFE_YAML_LOADERS = frozenset({"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"})


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def violations(source: str, filename: str = "<source>") -> list[str]:
    """Every deserializing import or call in ``source``, as ``file:line: what``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] in BANNED_MODULES:
                found.append(f"{where}: from {module} import ...")
            for alias in node.names:
                unsafe_yaml = module == "yaml" and alias.name in ("load", "load_all")
                if f"{module}.{alias.name}" in BANNED_CALLS or unsafe_yaml:
                    found.append(f"{where}: from {module} import {alias.name}")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            keywords = {k.arg: k.value for k in node.keywords}
            if name in BANNED_CALLS:
                found.append(f"{where}: {name}()")
            elif isinstance(node.func, ast.Name) and name in BANNED_BUILTINS:
                found.append(f"{where}: {name}()")
            elif name in ("yaml.load", "yaml.load_all"):
                loader = keywords.get("Loader", node.args[1] if len(node.args) > 1 else None)
                if loader is None or _dotted(loader).split(".")[-1] not in SAFE_YAML_LOADERS:
                    found.append(f"{where}: {name}() without SafeLoader")
            elif name.split(".")[-1] == "load" and name.split(".")[0] in ("np", "numpy"):
                allow = keywords.get("allow_pickle")
                if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                    found.append(f"{where}: {name}(allow_pickle=...)")
    return found


@pytest.mark.slow
def test_package_source_has_no_deserialization() -> None:
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    assert len(files) > 20  # the scan sees the whole package
    found = [v for path in files for v in violations(path.read_text(), str(path.relative_to(PACKAGE_DIR.parent)))]
    assert found == []


def test_the_scan_finds_each_kind_of_deserialization() -> None:
    cases = {
        "import pickle": 1, "import cPickle as p": 1, "from dill import loads": 1, "import shelve": 1,
        "from pickle import loads": 1, "import marshal\nmarshal.loads(b'')": 1, "torch.load('x.pt')": 1,
        "np.load('a.npy', allow_pickle=True)": 1, "numpy.load(f, allow_pickle=flag)": 1,
        "yaml.load(text)": 1, "yaml.load(text, Loader=yaml.Loader)": 1, "yaml.unsafe_load(text)": 1,
        "from yaml import load": 1, "eval(data)": 1, "exec(code)": 1,
    }
    for source, expected in cases.items():
        assert len(violations(source)) == expected, source
    for safe in ("yaml.safe_load(text)", "yaml.load(text, Loader=yaml.SafeLoader)", "np.load('a.npy')",
                 "np.load('a.npy', allow_pickle=False)", "model.eval()", "json.loads(s)", "import marshmallow"):
        assert violations(safe) == [], safe
