"""The Store is used through its interface only: outside the store module no code touches the etcd client,
a private member of a store, or asks which implementation it holds (`isinstance(..., EtcdStore)`); and no
etcd key is written out anywhere but in `keys`. An AST walk over the product's modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRODUCT = REPO / "router_sidecar"
STORE_MODULE = PRODUCT / "coordination" / "store.py"
STORE_CLASSES = {"Store", "EtcdStore", "MemoryStore"}
# The client's own members, whatever object holds them (aetcd.Client._options, the store's client).
CLIENT_MEMBERS = {"_client", "_call", "_options", "new_client"}
KEY_ROOT = "/router-sidecar"


def store_private_members() -> set[str]:
    """The private names the store classes define or assign on `self`."""
    names = set(CLIENT_MEMBERS)
    for node in ast.walk(ast.parse(STORE_MODULE.read_text())):
        if isinstance(node, ast.ClassDef) and node.name in STORE_CLASSES:
            for inner in ast.walk(node):
                if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(inner.name)
                elif (
                    isinstance(inner, ast.Attribute)
                    and isinstance(inner.ctx, ast.Store)
                    and isinstance(inner.value, ast.Name)
                    and inner.value.id == "self"
                ):
                    names.add(inner.attr)
    return {name for name in names if name.startswith("_") and not name.startswith("__")} | {"new_client"}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def _key_parts(node: ast.AST) -> list[str]:
    """`keys.ROOT` / `keys.*_PREFIX` used inside `node`."""
    return [
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "keys"
        and (n.attr == "ROOT" or n.attr.endswith("_PREFIX"))
    ]


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def violations(source: str, private: set[str]) -> list[str]:
    """What in `source` goes around the Store interface, one line each."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(m == "aetcd" or m.startswith("aetcd.") for m in modules):
                found.append(f"{line}: imports the etcd client")
        elif isinstance(node, ast.Attribute) and node.attr in private:
            # A class's own members are its business; another object's (a store's) are not.
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{line}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass", "type")
            and any(_names(arg) & STORE_CLASSES for arg in node.args[1:])
        ) or (
            isinstance(node, ast.Compare)
            and any(_names(c) & {"EtcdStore", "MemoryStore"} for c in [node.left, *node.comparators])
        ):
            found.append(f"{line}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.JoinedStr)
            or (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add))
            or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len")
        ) and _key_parts(node):
            found.append(f"{line}: a key built or taken apart outside `keys`: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith(KEY_ROOT)
            and id(node) not in docstrings
        ):
            found.append(f"{line}: an etcd key written out: {node.value!r}")
    return found


def test_no_product_module_goes_around_the_store_interface() -> None:
    private = store_private_members()
    assert {"_client", "_call", "_commit", "_watches"} <= private
    found = {
        str(path.relative_to(REPO)): problems
        for path in sorted(PRODUCT.rglob("*.py"))
        if path != STORE_MODULE and "_pb2" not in path.name
        for problems in [violations(path.read_text(), private)]
        if problems
    }
    assert found == {}


@pytest.mark.parametrize(
    "source",
    [
        "store._client._options = {}",
        "await store._call(store._client.get_lease_info(1))",
        "self._client = store._client",
        "self._store._client.close()",
        "self.store._call(x)",
        "self._store._watches.clear()",
        "client = store.new_client({})",
        "if isinstance(store, EtcdStore): pass",
        "ok = isinstance(self._store, (MemoryStore, int))",
        "ok = type(store) is EtcdStore",
        "import aetcd",
        "from aetcd import rpc",
        "KEY = '/router-sidecar/replicas/'",
        "key = f'/router-sidecar/x/{a}'",
        "key = f'{keys.REPLICAS_PREFIX}{address}'",
        "key = keys.ROOT + 'config/x'",
        "owner = key[len(keys.OWNERS_PREFIX) :]",
    ],
)
def test_the_walk_finds_each_way_around(source: str) -> None:
    assert violations(source, store_private_members()), source


@pytest.mark.parametrize(
    "source",
    [
        "self._call = f'{method} {path}'",  # a module's own attribute that happens to share the name
        "await store.put(keys.replica(address), value, lease)",
        "ok = isinstance(item, Snapshot)",
        "async for item in store.watch_prefix(keys.OWNERS_PREFIX): pass",
        "path = '/run/router-sidecar/sidecar.sock'",
        'def f():\n    """Keys live under /router-sidecar/."""',
    ],
)
def test_the_walk_lets_the_interface_through(source: str) -> None:
    assert violations(source, store_private_members()) == []
