"""The product stands without its testbed: no module of router_sidecar/ imports router_testbed (statically,
through importlib, or by running it as `python -m router_testbed...`), so the router-sidecar wheel, which
does not carry the testbed, runs on its own."""

from __future__ import annotations

import ast
from pathlib import Path

PRODUCT = Path(__file__).resolve().parents[2] / "router_sidecar"
TESTBED = "router_testbed"


def references_to_testbed(path: Path, root: Path = PRODUCT) -> list[str]:
    """`file:line: what` for each import of the testbed, and each string naming one of its modules."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    where = path.relative_to(root.parent)
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # importlib.import_module("router_testbed.x"), [python, "-m", "router_testbed.sim"]
            names = [node.value] if node.value.split(".")[0] == TESTBED else []
        found += [f"{where}:{node.lineno}: {name}" for name in names if name.split(".")[0] == TESTBED]
    return found


def test_no_product_module_imports_the_testbed() -> None:
    modules = sorted(PRODUCT.rglob("*.py"))
    assert len(modules) > 40  # the walk sees the product, not an empty directory
    references = [r for module in modules for r in references_to_testbed(module)]
    assert references == []


def test_the_check_sees_every_way_of_naming_the_testbed(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import router_testbed.sim\n"
        "from router_testbed.drill import run\n"
        "import importlib\n"
        "importlib.import_module('router_testbed.demo')\n"
        "argv = ['python', '-m', 'router_testbed.sim']\n"
        "from router_sidecar.runtime import flags  # the product itself is fine\n"
        "note = 'router_testbed is a word in prose, too'\n"
    )
    assert references_to_testbed(module, tmp_path) == [
        f"{tmp_path.name}/m.py:1: router_testbed.sim",
        f"{tmp_path.name}/m.py:2: router_testbed.drill",
        f"{tmp_path.name}/m.py:4: router_testbed.demo",
        f"{tmp_path.name}/m.py:5: router_testbed.sim",
    ]
