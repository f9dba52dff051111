"""What every exporter shares: reading safetensors checkpoints (single file or sharded with an index),
hashing the source, and the error type. Exporters run offline; the runtime never imports them."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from moe_serve.artifact import save_artifact
from moe_serve.errors import MoEServeError
from moe_serve.kernels.packed import WeightFormat
from moe_serve.model_config import ModelConfig
from moe_serve.tokenizer import Tokenizer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin")


class ExportError(MoEServeError):
    """The source cannot be exported; the message names the file, key or field."""


@dataclass(frozen=True, slots=True)
class ExportOptions:
    dtype: torch.dtype | None = None  # storage dtype (None: as in the source)
    progress: bool = True  # a progress bar while weights are converted
    overwrite: bool = False  # replace an existing destination
    weights: WeightFormat | None = (
        None  # store the packable weights as bf16, int8 or int4 (None: floats, as dtype says)
    )


DEFAULT_OPTIONS = ExportOptions()


def write(
    src: str | Path,
    dst: str | Path,
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    tokenizer: Tokenizer,
    provenance: dict,
    options: ExportOptions,
) -> Path:
    """Write the artifact (aside, then renamed into place) with the options' dtype and overwrite rule (never
    over a directory that holds SRC)."""
    return save_artifact(
        dst,
        config,
        state,
        tokenizer,
        provenance=provenance,
        dtype=options.dtype,
        weights=options.weights,
        overwrite=options.overwrite,
        sources=(Path(src),),
    )


class SafetensorsCheckpoint:
    """Tensor names -> lazily read tensors, across one or several safetensors files."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        self._prefix = ""  # of every stored name (under): names here are without it
        self._file_of: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for path in files:
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():
                        self._file_of[name] = path
                        self._shapes[name] = tuple(f.get_slice(name).get_shape())
            except Exception as exc:  # safetensors' own header errors
                raise ExportError(f"cannot read {path}: {exc}") from None

    @classmethod
    def from_directory(cls, directory: Path) -> SafetensorsCheckpoint:
        """A Hugging Face style directory: model.safetensors, or shards listed in model.safetensors.index.json."""
        if (directory / INDEX_FILE).is_file():
            try:
                weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise ExportError(f"{directory / INDEX_FILE} is not a valid safetensors index: {exc}") from None
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (directory / f).is_file()]
            if missing:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise ExportError(f"missing shard {missing[0]} listed in {INDEX_FILE}{more}")
            return cls([directory / f for f in files])
        if (directory / SINGLE_FILE).is_file():
            return cls([directory / SINGLE_FILE])
        _refuse_pickles(directory)
        raise ExportError(f"{directory} has no {SINGLE_FILE} or {INDEX_FILE}")

    def under(self, prefix: str) -> SafetensorsCheckpoint:
        """The tensors whose names start with `prefix`, named without it (a multimodal checkpoint's text model)."""
        view = SafetensorsCheckpoint([])
        view.files, view._prefix = self.files, self._prefix + prefix
        view._file_of = {n[len(prefix) :]: f for n, f in self._file_of.items() if n.startswith(prefix)}
        view._shapes = {n[len(prefix) :]: s for n, s in self._shapes.items() if n.startswith(prefix)}
        return view

    def keys(self) -> Iterable[str]:
        return self._file_of.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Read one tensor; a missing name or a shape other than `shape` raises ExportError naming it."""
        stored = self._prefix + name  # as the files name it
        if name not in self._file_of:
            raise ExportError(f"checkpoint tensor '{stored}' is missing")
        if shape is not None and self._shapes[name] != tuple(shape):
            raise ExportError(
                f"checkpoint tensor '{stored}' has shape {list(self._shapes[name])}, expected {list(shape)}"
            )
        with safe_open(str(self._file_of[name]), framework="pt") as f:
            return f.get_tensor(self._prefix + name)

    def sha256(self) -> str:
        """One digest over the checkpoint files, in name order."""
        digest = hashlib.sha256()
        for path in sorted(self.files):
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
        return digest.hexdigest()


def _refuse_pickles(directory: Path) -> None:
    pickled = [name for name in PICKLE_FILES if (directory / name).exists()]
    if pickled:
        raise ExportError(
            f"{directory} holds only a pickle checkpoint ({pickled[0]}); only safetensors are read "
            "(convert it with transformers' save_pretrained(..., safe_serialization=True) where you trust it)"
        )


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise ExportError(f"{path.parent} has no {path.name}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ExportError(f"{path} is not valid JSON: {exc}") from None


TRAINING_CHECKPOINT = "checkpoint.safetensors"
TRAINING_CONFIG = "training_config.json"


class TrainingCheckpoint(SafetensorsCheckpoint):
    """A recipe's output directory: checkpoint.safetensors (the method's official key layout) and
    training_config.json (method, hyperparameters, command, seed, split, metrics)."""

    def __init__(self, directory: Path, method: str) -> None:
        directory = Path(directory)
        if not directory.is_dir():
            raise ExportError(f"{directory} is not a directory")
        if not (directory / TRAINING_CHECKPOINT).is_file():
            _refuse_pickles(directory)
            raise ExportError(f"{directory} has no {TRAINING_CHECKPOINT}")
        self.record = read_json(directory / TRAINING_CONFIG)
        found = self.record.get("method")
        if found != method:
            raise ExportError(f"{directory} is a {found!r} checkpoint ({TRAINING_CONFIG} method), not {method!r}")
        self.model_config = self.record.get("model") or {}
        super().__init__([directory / TRAINING_CHECKPOINT])

    def hyper(self, name: str):
        if name not in self.model_config:
            raise ExportError(f"{TRAINING_CONFIG} has no model.{name}")
        return self.model_config[name]

    def provenance(self, exporter: str, folded: str) -> dict:
        keys = (
            *("recipe", "command", "seed", "steps", "split", "optimizer", "weight_decay", "autocast", "precision"),
            *("router_aux_loss_coef", "router_z_loss_coef", "hyperrouter_embedding_lr_scale", "metrics"),
            *("threads", "cpu_bf16_units", "train_seconds", "seeds"),
        )
        return {
            "exporter": exporter,
            "source_sha256": self.sha256(),
            "folded": folded,
            **{k: self.record[k] for k in keys if k in self.record},
        }
