"""The layers of `router_sidecar/` and what each may import, as docs/design.md#the-layers documents them.

The table in that section is the rule: each row names a layer and the layers it may import. This test reads
the table, walks every module's imports with `ast` (those inside functions and under `TYPE_CHECKING` too) and
fails on an import the table does not allow, on a module in no documented layer, and on an allowance that no
module uses any more (the table says what is true, not what would be permitted).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "router_sidecar"
DESIGN_DOC = REPO / "docs" / "design.md"
TOP = "router_sidecar/"  # the package's own modules: __init__.py, __main__.py

# Imports that break the layering today, each with the work that removes it. Remove an entry once it is gone;
# the test fails while an entry is no longer needed.
KNOWN_BREAKS: dict[tuple[str, str], str] = {}

# core/ is sans-IO: no event loop, gRPC, etcd client, sockets, threads, processes or clock.
CORE_NEVER_IMPORTS = frozenset(
    {
        "aetcd",
        "asyncio",
        "concurrent",
        "grpc",
        "http",
        "multiprocessing",
        "opentelemetry",
        "prometheus_client",
        "selectors",
        "socket",
        "ssl",
        "subprocess",
        "threading",
        "time",
        "urllib",
        "uvloop",
    }
)


def documented_layers() -> dict[str, frozenset[str]]:
    """layer → the layers it may import, from the table under `## The layers` in docs/design.md."""
    text = DESIGN_DOC.read_text(encoding="utf-8")
    section = re.search(r"^## The layers\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert section, "docs/design.md has no '## The layers' section"
    table: dict[str, frozenset[str]] = {}
    for row in re.findall(r"^\|(.+)\|\s*$", section.group(1), re.MULTILINE):
        cells = [c.strip() for c in row.split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue  # the header and its rule
        layer = re.findall(r"`([^`]+)`", cells[0])[0]
        table[layer] = frozenset(re.findall(r"`([^`]+/)`", cells[1]))
    assert table, "the layers section of docs/design.md has no table"
    return table


def layer_of(module: str) -> str:
    """`router_sidecar.core.sse` → `core/`; `router_sidecar.__main__` → `router_sidecar/`."""
    parts = module.split(".")
    if parts[0] != "router_sidecar":
        return parts[0] + "/"
    if len(parts) == 1 or (PACKAGE / f"{parts[1]}.py").exists():
        return TOP
    return parts[1] + "/"


def module_name(path: Path) -> str:
    relative = path.relative_to(REPO).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path) -> list[str]:
    """Every module `path` imports, absolute (relative imports resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                names.append(".".join([*base, *([node.module] if node.module else [])]))
            else:
                names.append(node.module or "")
    return names


def graph() -> dict[tuple[str, str], set[str]]:
    """(importing layer, imported layer) → the files that make that import, within our own code."""
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.relative_to(REPO).as_posix()
        layer = layer_of(module_name(path))
        for name in imported(path):
            top = name.split(".")[0]
            if top not in ("router_sidecar", "router_testbed", "tests", "bench"):
                continue
            target = layer_of(name)
            if target != layer:
                edges[(layer, target)].add(source)
    return edges


def test_every_module_is_in_a_documented_layer() -> None:
    layers = documented_layers()
    unknown = sorted(
        {
            p.relative_to(REPO).as_posix()
            for p in PACKAGE.rglob("*.py")
            if layer_of(module_name(p)) not in layers
        }
    )
    assert not unknown, f"modules in no layer of docs/design.md#the-layers: {unknown}"


def test_no_import_breaks_the_layering() -> None:
    layers = documented_layers()
    broken = []
    for (layer, target), sources in sorted(graph().items()):
        if target in layers.get(layer, ()):
            continue
        for source in sorted(sources):
            if (source, target) not in KNOWN_BREAKS:
                broken.append(f"{source} ({layer}) imports {target}")
    assert not broken, "imports the layering in docs/design.md#the-layers does not allow:\n" + "\n".join(
        broken
    )


def test_every_documented_allowance_is_used() -> None:
    """The table is the import graph as it is: an allowance no module uses is dropped from it."""
    used = set(graph())
    unused = [
        f"{layer} may import {target}"
        for layer, targets in documented_layers().items()
        for target in sorted(targets)
        if (layer, target) not in used
    ]
    assert not unused, "docs/design.md#the-layers allows imports nothing makes:\n" + "\n".join(unused)


def test_the_known_breaks_are_still_there() -> None:
    edges = graph()
    gone = [
        f"{source} → {target}: {why}"
        for (source, target), why in KNOWN_BREAKS.items()
        if source not in edges.get((layer_of(module_name(REPO / source)), target), set())
    ]
    assert not gone, "remove these from KNOWN_BREAKS, they no longer happen:\n" + "\n".join(gone)


def test_core_does_no_io() -> None:
    found = []
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        for name in imported(path):
            if name.split(".")[0] in CORE_NEVER_IMPORTS:
                found.append(f"{path.relative_to(REPO).as_posix()} imports {name}")
    assert not found, "core/ is sans-IO (docs/design.md#the-layers):\n" + "\n".join(found)
