"""mypy over every module the wheel installs, by its import name: `python -m tests.check_types` (part of
`make lint`). The stage folders install under `moe_serve` (server/ is moe_serve.server: pyproject.toml's
package-dir), a mapping mypy cannot follow, so the check runs on a tree of links laid out as the wheel is
(.mypy-tree/moe_serve/..., rebuilt each run from tests/import_graph.installed_modules) and prints mypy's
findings with the repository's own paths. Extra arguments go to mypy; the configuration is pyproject.toml's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.import_graph import ROOT, installed_modules

TREE = ROOT / ".mypy-tree"


def build_tree() -> dict[str, str]:
    """Links to every installed module at its import path under TREE -> {tree path prefix: real path prefix}
    for each file, to translate mypy's output back."""
    shutil.rmtree(TREE, ignore_errors=True)
    back: dict[str, str] = {}
    for name, path in installed_modules().items():
        parts = name.split(".")
        target = (
            TREE.joinpath(*parts, "__init__.py")
            if path.name == "__init__.py"
            else TREE.joinpath(*parts[:-1], parts[-1] + ".py")
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(path, target)
        back[str(target.relative_to(ROOT))] = str(path.relative_to(ROOT))
    return back


def main(argv: list[str]) -> int:
    back = build_tree()
    command = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        *argv,
        str(TREE.relative_to(ROOT) / "moe_serve"),
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    for line in (result.stdout + result.stderr).splitlines():
        path, sep, rest = line.partition(":")
        print(back.get(path, path) + sep + rest)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
