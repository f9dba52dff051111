"""Hugging Face checkpoints served as they are: `moe-serve serve DIR` on a Hugging Face directory (or a model id
found in the local hub cache, moe_serve.registry.hub_snapshot) exports it on first use into a cache and serves
the export, as the ONNX cache does for `--backend onnxruntime`.

The cache is ~/.cache/moe-serve/hf (or $MOE_SERVE_HF_CACHE), one artifact per checkpoint under a key of its
files' names and contents and the artifact format: a changed checkpoint gets a new export, never a stale one.
Finding the key reads the whole checkpoint once; each file's digest is remembered beside the cache under the
file's size, modification time and inode, so a later start of an unchanged checkpoint reads none of it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from tqdm.auto import tqdm

from moe_serve import __version__
from moe_serve.artifact import CONFIG_FILE, FORMAT, FORMAT_VERSION, sha256_file
from moe_serve.exporters.base import ExportError, ExportOptions
from moe_serve.exporters.hf import export_hf
from moe_serve.registry import bundled_models, hub_snapshot

logger = logging.getLogger(__name__)

DIGESTS_FILE = "digests.json"  # path -> [size, mtime_ns, inode, sha256] of the checkpoint files hashed


def cache_dir() -> Path:
    return Path(os.environ.get("MOE_SERVE_HF_CACHE") or Path.home() / ".cache" / "moe-serve" / "hf")


def is_hf_checkpoint(path: Path) -> bool:
    """A directory with a Hugging Face config.json (an "architectures" list or a "model_type", and not a
    moe-serve artifact's)."""
    try:
        config = json.loads((path / CONFIG_FILE).read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    if not isinstance(config, dict) or config.get("format") == FORMAT:
        return False
    return isinstance(config.get("architectures"), list) or isinstance(config.get("model_type"), str)


def hf_source(model: str | Path) -> Path | None:
    """The Hugging Face checkpoint a MODEL argument names (a directory, or a model id in the hub cache when no
    such path or bundled demo exists); None for anything else."""
    path = Path(model)
    if path.is_dir():
        return path if is_hf_checkpoint(path) else None
    if path.exists() or str(model) in bundled_models():
        return None
    snapshot = hub_snapshot(str(model))
    return snapshot if snapshot is not None and is_hf_checkpoint(snapshot) else None


def servable_artifact(model: str | Path, *, progress: bool = True) -> str:
    """The model as given, or for a Hugging Face checkpoint its cached export (made now if missing)."""
    src = hf_source(model)
    return str(model) if src is None else str(cached_hf_export(src, progress=progress))


def cached_hf_export(src: Path, *, progress: bool = True) -> Path:
    """The export of a Hugging Face checkpoint directory in the cache, made on first use."""
    files = _checkpoint_files(src)
    digests = _Digests(cache_dir() / DIGESTS_FILE)
    source = {
        "files": {path.name: digests.sha256(path, progress) for path in files},
        "format_version": FORMAT_VERSION,
        "exporter": __version__,  # a release whose exporter folds differently exports again
    }
    digests.save()
    key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16]
    name = src.parent.parent.name.removeprefix("models--").split("--", 1)[-1] if _in_hub(src) else src.name
    dst = cache_dir() / key / name  # the export keeps the checkpoint's name: the served model's name
    if not dst.is_dir():
        logger.warning("exporting the Hugging Face checkpoint %s to %s (once; later starts reuse it)", src, dst)
        try:
            export_hf(src, dst, ExportOptions(progress=progress))  # written aside and renamed into place
        except (ExportError, OSError):
            if not dst.is_dir():  # not another process exporting the same checkpoint at the same time
                raise
    return dst


def _in_hub(src: Path) -> bool:
    """A snapshot of the hub's layout (models--org--name/snapshots/REVISION): named by its model id."""
    return src.parent.name == "snapshots" and src.parent.parent.name.startswith("models--")


def _checkpoint_files(src: Path) -> list[Path]:
    """Every file the export may read: the directory's own files (a hub snapshot's are links into its blobs),
    hidden ones (a download's .cache) left out."""
    files = sorted(p for p in src.iterdir() if not p.name.startswith(".") and p.is_file())
    if not any(p.suffix == ".safetensors" for p in files):
        raise ExportError(f"{src} is a Hugging Face checkpoint without safetensors files: nothing to serve")
    return files


class _Digests:
    """sha256 of files, remembered by (size, mtime_ns, inode) of the file a path resolves to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._known: dict[str, list] = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            self._known = {}
        self._changed = False

    def sha256(self, path: Path, progress: bool) -> str:
        real = path.resolve()
        stat = real.stat()
        stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
        known = self._known.get(str(real))
        if isinstance(known, list) and len(known) == 4 and known[:3] == stamp and isinstance(known[3], str):
            return known[3]
        with tqdm(
            total=stat.st_size, unit="B", unit_scale=True, desc=f"hashing {path.name}", disable=not progress
        ) as bar:
            digest = sha256_file(real, bar.update)
        self._known[str(real)] = [*stamp, digest]
        self._changed = True
        return digest

    def save(self) -> None:
        """Written aside and renamed: a crash leaves the old file or the new one. A cache that cannot be written
        costs only the hashing next time."""
        if not self._changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".digests-")
            with os.fdopen(fd, "w") as f:
                json.dump(self._known, f)
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("could not remember the checkpoint digests in %s: %s", self.path, exc)
