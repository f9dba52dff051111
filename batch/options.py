"""What `moe-serve batch` is asked to do (its command-line options derive from these fields)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moe_serve.errors import ValidationError
from moe_serve.options import option
from moe_serve.validation import check_int


@dataclass(frozen=True, slots=True)
class BatchOptions:
    input: str = option(None, "OpenAI Batch JSONL file", flags=("-i",))
    output: str = option(None, "results JSONL (appended; a rerun resumes)", flags=("-o",))
    model: str | None = option(None, "default model (a line's body.model wins)")
    models: str | None = option(
        None, "comma-separated further models (paths or bundled names) lines may name; default: --model and the demos"
    )
    k: str | None = option(None, "comma-separated experts_per_token sweep: every line answered once per k")
    chunk_size: int = option(64, "requests answered together (the engine batches them)")
    quality: bool = option(
        False, "write accuracy, macro-F1 and bits per byte against k into OUTPUT.<model>.quality.json"
    )
    write_artifact: bool = option(False, "with --quality: also merge them into each artifact's own quality.json")
    ray: str | None = option(
        None,
        "shard over a Ray cluster at ADDRESS (no ADDRESS: start a local Ray)",
        nargs="?",
        const="local",
        metavar="ADDRESS",
    )
    ray_workers: int = option(2, "Ray actors, one CPU each")

    def __post_init__(self) -> None:
        for name in ("input", "output"):
            if not getattr(self, name):
                raise ValidationError(f"--{name} is required", parameter=name)
        check_int("chunk_size", self.chunk_size, 1)
        check_int("ray_workers", self.ray_workers, 1)

    @property
    def extra_models(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in (self.models or "").split(",") if m.strip())

    @property
    def input_path(self) -> Path:
        return Path(self.input)

    @property
    def output_path(self) -> Path:
        return Path(self.output)
