"""What the engine drives and where it gets it: `LoadedModel`, whatever a backend loaded (the torch
backend's moe_serve.artifact.Artifact, the onnxruntime backend's engine.onnx_backend.ExportedModel), the
`Runner` that computes each step (made from it by its backend, engine.backend), and `StepResult`, what a step
produced. Also the SCORE helpers
every runner shares. The engine sees a backend only through these names (engine.backend lists the backends).

Legend: V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from moe_serve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from moe_serve.model_config import ModelConfig
from moe_serve.quality import QualityTable
from moe_serve.tokenizer import Tokenizer


class LoadedModel(Protocol):
    """A model a backend loaded, ready to serve: what it is (its backend makes the runner of its steps)."""

    path: Path  # where it was loaded from (an artifact or an export directory)
    config: ModelConfig
    tokenizer: Tokenizer
    provenance: dict[str, Any]
    quality: QualityTable | None  # the quality-vs-k table the artifact carries, if any

    @property
    def name(self) -> str:
        """The served model's name."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of its activations and KV cache (what the cache budget is counted in)."""
        ...

    @property
    def weight_format(self) -> str | None:
        """The packed format its weights run in (bf16, int8, int4: moe_serve.kernels.packed); None: floats."""
        ...

    @property
    def weights_label(self) -> str | None:
        """Its format and the activations the kernels read it with, as quality rows name them (int8:int8)."""
        ...


class Runner(Protocol):
    """Runs the engine's steps on one model (engine.model_runner.TorchRunner, engine.onnx_runner.OnnxRunner)."""

    def execute(self, output: SchedulerOutput) -> StepResult: ...

    def prompt_seconds(self, num_tokens: int, k: int) -> float:
        """The time one prompt of num_tokens takes through the model (the scheduler's cost calibration)."""
        ...

    def track_expert_load(self) -> None:
        """Start counting the tokens routed to each expert (engine.expert_load reads them after each step)."""
        ...

    def read_expert_load(self) -> dict[int, list[int]]:
        """MoE layer -> tokens routed to each expert since the last read (resets the counts)."""
        ...


@dataclass(slots=True)
class StepResult:
    """Per scheduled item (by its index in SchedulerOutput.scheduled)."""

    sample_items: list[int] = field(default_factory=list)  # items whose sequence needs a next token
    logits: torch.Tensor | None = None  # [len(sample_items), V] fp32, in that order
    prompt_logprobs: dict[int, list[float]] = field(default_factory=dict)  # SCORE: log p of the chunk's next tokens
    prompt_top_logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)  # SCORE: alternatives
    class_probs: dict[int, list[float]] = field(default_factory=dict)  # CLASSIFY
    experts: dict[int, tuple[int, list[int] | None]] = field(default_factory=dict)  # (tokens, experts per MoE layer)


def score_targets(item: ScheduledSequence) -> list[int]:
    """The next prompt token of each position in a SCORE chunk (the last chunk's last position predicts
    nothing)."""
    return item.seq.token_ids[item.start + 1 : item.end + 1]


def score_logprobs(
    logits: torch.Tensor, items: list[ScheduledSequence]
) -> list[tuple[list[float], list[dict[int, float]]]]:
    """logits [N, V]: the rows of the SCORE chunks of `items`, one after the other (each chunk's rows are
    the positions of its `score_targets`) -> per item, log p(target) at each position and, when its request
    asked for them, the `params.logprobs` most likely tokens at each. Batched over the whole step: one
    log_softmax, one gather and one topk over all rows, one copy to the host; Python only splits the lists."""
    counts = [len(score_targets(item)) for item in items]
    targets = [t for item in items for t in score_targets(item)]
    if not targets:
        return [([], []) for _ in items]
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    index = torch.tensor(targets, device=logits.device)[:, None]
    columns = [logprobs.gather(1, index).double()]  # [N, 1]
    top = max(item.seq.params.logprobs or 0 for item in items)
    if top:
        top_values, top_ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)  # sorted, most likely first
        columns += [top_values.double(), top_ids.double()]  # ids exact in float64
    host = torch.cat(columns, dim=1).cpu()  # [N, 1 (+ 2 top)]: one copy to the host
    values = host[:, 0].tolist()
    width = (host.shape[1] - 1) // 2
    tops_values = host[:, 1 : 1 + width].tolist() if width else []
    tops_ids = host[:, 1 + width :].long().tolist() if width else []
    out, row = [], 0
    for item, n in zip(items, counts, strict=True):
        k = item.seq.params.logprobs or 0
        end = row + n
        tops: list[dict[int, float]] = []
        if k:
            tops = [
                dict(zip(i[:k], v[:k], strict=True))
                for i, v in zip(tops_ids[row:end], tops_values[row:end], strict=True)
            ]
        out.append((values[row:end], tops))
        row = end
    return out
