"""Resolves a MODEL argument: an artifact directory, or the name of a demo model bundled with the package."""

from __future__ import annotations

from pathlib import Path

from moe_serve.errors import ArtifactError

BUNDLED_DIR = Path(__file__).parent / "demo_models"


def bundled_models() -> dict[str, Path]:
    """Bundled demo models: name -> artifact directory."""
    if not BUNDLED_DIR.is_dir():
        return {}
    return {p.name: p for p in sorted(BUNDLED_DIR.iterdir()) if (p / "config.json").is_file()}


def resolve_model(model: str | Path) -> Path:
    path = Path(model)
    if path.exists():
        return path
    bundled = bundled_models()
    if str(model) in bundled:
        return bundled[str(model)]
    names = ", ".join(bundled) or "none"
    raise ArtifactError(f"no artifact directory '{model}' and no bundled model of that name (bundled: {names})")


def is_bundled(path: Path) -> bool:
    """Whether `path` is one of the bundled demos (read-only package data)."""
    return Path(path).resolve().parent == BUNDLED_DIR.resolve()
