"""The Hugging Face importer's registry and layout: every family a module of moe_serve.exporters.hf defines is
registered by importing the package, each architecture names one family, a taken architecture is refused; and
the exporter modules import one another without a cycle (function-local and TYPE_CHECKING imports counted) and
without taking another module's private names."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

from moe_serve.exporters import hf
from moe_serve.exporters.hf import ARCHITECTURES, HFFamily, families, family_names, register

EXPORTERS = Path(hf.__file__).resolve().parents[1]  # the folder that installs as moe_serve.exporters


def test_every_family_a_module_defines_is_registered_by_importing_the_package() -> None:
    defined = []
    for module in pkgutil.iter_modules(hf.__path__):
        imported = importlib.import_module(f"{hf.__name__}.{module.name}")
        defined += [
            cls
            for _, cls in inspect.getmembers(imported, inspect.isclass)
            if issubclass(cls, HFFamily) and cls is not HFFamily and cls.__module__ == imported.__name__
        ]
    registered = {type(family) for family in families()}
    assert defined and {cls.__qualname__ for cls in defined} - {cls.__qualname__ for cls in registered} == set()
    assert len(registered) == len(defined)


def test_each_architecture_names_one_family_and_the_lists_are_in_display_order() -> None:
    for architecture, family in ARCHITECTURES.items():
        assert architecture in family.architectures
    assert [a for f in families() for a in f.architectures] == list(ARCHITECTURES)
    names = family_names()
    assert len(set(names)) == len(names) and list(names) == sorted(names, key=str.casefold)
    assert {f.name for f in families()} | {alias for f in families() for alias in f.aliases} == set(names)


def test_register_refuses_a_taken_architecture_and_a_family_missing_its_fields() -> None:
    class Again(type(families()[0])):
        name = "Again"

    with pytest.raises(ValueError, match="already registered"):
        register(Again)

    class Bare(HFFamily):
        name = "Bare"
        architectures = ("BareForCausalLM",)

    with pytest.raises(TypeError, match="must set num_experts_keys"):
        register(Bare)
    assert "BareForCausalLM" not in ARCHITECTURES and "Again" not in family_names()


def _modules() -> dict[str, Path]:
    """moe_serve.exporters' module names -> their files."""
    modules = {}
    for path in sorted(EXPORTERS.rglob("*.py")):
        parts = path.relative_to(EXPORTERS).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(("moe_serve.exporters", *parts))] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], list[str]]:
    """The exporter modules `name` imports anywhere in its file, and the private names it takes from others. A
    package whose __init__ imports its modules through pkgutil imports each of them."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges, private = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            edges |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    edges.add(f"{base}.{alias.name}")
                else:
                    if base in modules:
                        edges.add(base)
                    if base.startswith("moe_serve") and alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.append(f"{name}: {alias.name} from {base}")
    if path.name == "__init__.py" and "pkgutil.iter_modules" in path.read_text():
        edges |= {m for m in modules if m.rpartition(".")[0] == name}
    return edges - {name}, private


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import cycle of the graph (module -> the modules it imports), as the modules along it; None if none."""
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = "open"
        for after in sorted(graph[node]):
            if state.get(after) == "open":
                return [*trail, node, after]
            if after not in state and (found := visit(after, [*trail, node])):
                return found
        state[node] = "done"
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name, [])):
            return found
    return None


def test_exporter_modules_import_each_other_without_a_cycle_or_private_names() -> None:
    modules = _modules()
    graph, private = {}, []
    for name, path in modules.items():
        graph[name], taken = _imports(name, path, modules)
        private += taken
    assert private == []
    assert "moe_serve.exporters.hf.family" in graph["moe_serve.exporters.hf.mixtral"]  # the graph is seen
    assert graph["moe_serve.exporters.hf"] >= {"moe_serve.exporters.hf.mixtral"}  # pkgutil's imports too
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
