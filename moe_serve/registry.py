"""Resolves a MODEL argument: an artifact directory, the name of a demo model bundled with the package, or a
Hugging Face model id found in the local hub cache (no network: the hub's own layout, where `huggingface-cli
download` and transformers put checkpoints)."""

from __future__ import annotations

import os
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
    snapshot = hub_snapshot(str(model))
    if snapshot is not None:
        return snapshot
    names = ", ".join(bundled) or "none"
    raise ArtifactError(
        f"no artifact directory '{model}', no bundled model of that name (bundled: {names}) and no Hugging Face "
        f"checkpoint of that id in the local hub cache ({hub_cache_dir()})"
    )


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home) / "hub"


def hub_snapshot(model_id: str) -> Path | None:
    """The checkpoint directory of a model id ("org/name") in the local hub cache: the snapshot its `main`
    ref names, else its only snapshot (None: not there). Several snapshots and no ref is an error naming them."""
    parts = model_id.split("/")
    if not 1 <= len(parts) <= 2 or not all(parts) or any(part in (".", "..") for part in parts):
        return None
    repo = hub_cache_dir() / ("models--" + "--".join(parts))
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    named = snapshots / ref.read_text().strip() if ref.is_file() else None
    if named is not None and named.is_dir():
        return named
    found = sorted(p for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
    if len(found) > 1:
        raise ArtifactError(
            f"{model_id} has {len(found)} snapshots in {snapshots} and no refs/main to choose one: serve the "
            "snapshot directory you mean"
        )
    return found[0] if found else None


def is_bundled(path: Path) -> bool:
    """Whether `path` is one of the bundled demos (read-only package data)."""
    return Path(path).resolve().parent == BUNDLED_DIR.resolve()
