"""Hugging Face MoE directories -> moe-serve artifacts (`moe-serve export hf SRC DST`), one module per family.

Weights are mapped by name and experts are stacked into [N, out, in] banks. Each model keeps its routing
convention (its family's `router`); the trained `num_experts_per_tok` becomes the default k, and requests may
choose any k in 1..N (a group-limited router: up to what its groups kept hold).

The families are a registry by architecture name (family.py: the template `HFFamily`, `register`, `families`,
`family_names`). Importing this package imports every module in it, and each family module registers its
families, so adding a family is one module with a `@register` HFFamily subclass overriding what differs, and
its test; tests/exporters/test_hf_family_lists.py then asks the documents to list it. The q/k row reorders a
family's rotary layout needs are reorder.py's.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from pathlib import Path
from typing import Any

import torch

from moe_serve.exporters.base import (
    DEFAULT_OPTIONS,
    ExportError,
    ExportOptions,
    SafetensorsCheckpoint,
    read_json,
    write,
)
from moe_serve.exporters.hf.family import (
    ARCHITECTURES,
    TEXT_MODELS,
    HFFamily,
    families,
    family_names,
    family_of,
    register,
)
from moe_serve.model_config import ModelConfig
from moe_serve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def _register_built_in_families() -> None:
    """Import every module of this package: each family module registers its families, so a new family is its
    module alone (the others register nothing)."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_register_built_in_families()


def convert_config(
    hf: dict[str, Any], tokenizer: Tokenizer | None = None, chat_template: str | None = None
) -> ModelConfig:
    """A Hugging Face config.json (as a dict) -> ModelConfig."""
    _, family = family_of(hf)
    return family.model_config(family.with_defaults(hf), tokenizer, chat_template)


def convert_weights(
    hf: dict[str, Any], config: ModelConfig, checkpoint: SafetensorsCheckpoint, *, progress: bool = True
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under canonical names, experts stacked; every key and shape checked."""
    _, family = family_of(hf)
    return family.state_dict(family.with_defaults(hf), config, checkpoint, progress=progress)


def export_hf(src: str | Path, dst: str | Path, options: ExportOptions = DEFAULT_OPTIONS) -> Path:
    """Export a Hugging Face MoE directory. Everything is read and checked before DST is written."""
    src = Path(src)
    if not src.is_dir():
        raise ExportError(f"{src} is not a directory")
    hf, prefix = _text_model(read_json(src / "config.json"))
    name, family = family_of(hf)
    hf = family.with_defaults(hf)
    if not (src / "tokenizer.json").is_file():
        raise ExportError(
            f"{src} has no tokenizer.json (only fast tokenizers in tokenizers' JSON format are carried over)"
        )
    tokenizer = Tokenizer.from_file(src / "tokenizer.json")
    config = convert_config(hf, tokenizer, _chat_template(src))
    checkpoint = SafetensorsCheckpoint.from_directory(src)
    if prefix:
        checkpoint = checkpoint.under(prefix)
    state = convert_weights(hf, config, checkpoint, progress=options.progress)
    provenance = {
        "exporter": "exporters.hf",
        "source_architecture": name,
        "source_sha256": checkpoint.sha256(),
        "trained_experts_per_token": hf["num_experts_per_tok"],
        "folded": "experts stacked into [N, out, in] banks; routing convention kept "
        f"({config.moe.router.describe() if config.moe else None})",
    }
    return write(src, dst, config, state, tokenizer, provenance, options)


def _text_model(hf: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A multimodal config.json whose text model is a registered family (its `text_models`) -> that text model's
    config (as the family's architecture) and the prefix of its tensors in the checkpoint; any other config as it
    is, with no prefix. Only text is served: the vision tower and projector are not read."""
    for name in hf.get("architectures") or []:
        if name in TEXT_MODELS:
            text, prefix = TEXT_MODELS[name]
            if not isinstance(hf.get("text_config"), dict):
                raise ExportError(f"config.json: {name} needs a text_config object")
            logger.warning("%s: exporting its text model only (images are not served)", name)
            return {**hf["text_config"], "architectures": [text]}, prefix
    return hf, ""


def _chat_template(src: Path) -> str | None:
    if (src / "chat_template.jinja").is_file():
        return (src / "chat_template.jinja").read_text()
    if (src / "tokenizer_config.json").is_file():
        template = read_json(src / "tokenizer_config.json").get("chat_template")
        return template if isinstance(template, str) else None
    return None


__all__ = [
    "ARCHITECTURES",
    "TEXT_MODELS",
    "HFFamily",
    "convert_config",
    "convert_weights",
    "export_hf",
    "families",
    "family_names",
    "family_of",
    "register",
]
