"""The package's import graph as the layout rules read it (tests/test_layout.py): every module the wheel
installs, by its import name (the stage folders too: server/ is moe_serve.server, as pyproject.toml maps
it), and every import in it, of every form: top level, inside functions, and under TYPE_CHECKING.

An edge a -> b means a's source names b in an import statement: `import b`, `from b import x`, or
`from pkg import b` where pkg.b is a module. Relative imports are resolved. Importing a.b.c also runs
the parent packages' __init__ modules, but that is not counted as an edge: a package's __init__ that
re-exports its modules would otherwise make every one of them a cycle with it.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXCLUDED_PARTS = ("demo_models",)  # data folders inside the package


@dataclass(frozen=True, slots=True)
class Edge:
    source: str  # the importing module
    target: str  # the imported module
    line: int  # where in the source

    def __str__(self) -> str:
        return f"{self.source}:{self.line} -> {self.target}"


def installed_modules(root: Path = ROOT) -> dict[str, Path]:
    """Import name -> file of every module the wheel installs (pyproject.toml's package-dir mapping)."""
    package_dir = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules: dict[str, Path] = {}
    for package, folder in package_dir.items():
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root / folder).with_suffix("")
            if any(part in EXCLUDED_PARTS for part in relative.parts):
                continue
            parts = list(relative.parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def imports_of(name: str, source: str, is_package: bool, known: set[str]) -> Iterator[Edge]:
    """The edges from module `name` (its `source`) to modules in `known`, every import form included."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _nearest(alias.name, known)
                if target is not None and target != name:
                    yield Edge(name, target, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(name, is_package, node)
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else _nearest(base, known)
                if target is not None and target != name:
                    yield Edge(name, target, node.lineno)


def _absolute(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = name.split(".") if is_package else name.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


def _nearest(module: str, known: set[str]) -> str | None:
    """The module itself when it is known, else its nearest known package (an attribute import)."""
    while module and module not in known:
        module = module.rpartition(".")[0]
    return module or None


def import_graph(root: Path = ROOT) -> dict[str, list[Edge]]:
    modules = installed_modules(root)
    known = set(modules)
    return {
        name: sorted(set(imports_of(name, path.read_text(), path.name == "__init__.py", known)), key=str)
        for name, path in modules.items()
    }


def cycles(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            edge = next(edges, None)
            if edge is not None:
                target = edge.target
                if target not in graph:
                    continue
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph[target])))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found
