"""SCORE log-probabilities are built for the whole step at once: one lm_logits, one log_softmax,
one gather and one topk over every scored row of the step, and the same numbers as per position."""

from __future__ import annotations

import torch

from moe_serve.engine.model_runner import TorchRunner
from moe_serve.engine.runner import score_logprobs, score_targets
from moe_serve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from moe_serve.engine.sequence import Sequence, SequenceKind
from moe_serve.sampling_params import SamplingParams

V, D = 11, 4


def scored(name: str, tokens: list[int], start: int, n: int, top: int | None) -> ScheduledSequence:
    seq = Sequence(name, 0, tokens, len(tokens), 1, SequenceKind.SCORE, SamplingParams(max_tokens=1, logprobs=top))
    return ScheduledSequence(seq, start, n)


class CountingModel:
    """lm_logits = hidden @ W, counting its calls."""

    def __init__(self) -> None:
        self.weight = torch.randn(D, V, generator=torch.Generator().manual_seed(0))
        self.calls = 0

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return hidden @ self.weight


def reference(logits: torch.Tensor, targets: list[int], top: int | None) -> tuple[list[float], list[dict]]:
    """Position by position, as the Python loop did."""
    values, tops = [], []
    for row, target in zip(logits, targets, strict=True):
        logprobs = torch.log_softmax(row, -1)
        values.append(logprobs[target].item())
        if top:
            v, i = logprobs.topk(top)
            tops.append(dict(zip(i.tolist(), v.tolist(), strict=True)))
    return values, tops


def test_one_lm_head_pass_for_every_scored_chunk_of_the_step_with_the_same_numbers() -> None:
    items = [
        scored("a", [1, 2, 3, 4, 5, 6], 0, 4, None),  # a first chunk: 4 targets, no alternatives
        scored("b", [7, 8, 9, 1, 2], 2, 3, 3),  # the last chunk: 2 targets (its last position predicts nothing)
        scored("c", [3, 3, 3], 2, 1, 2),  # only the last position: nothing to score
        scored("d", [5, 4, 3, 2, 1, 0, 10], 0, 7, 5),
    ]
    runner = TorchRunner.__new__(TorchRunner)
    runner.model = CountingModel()  # type: ignore[assignment]
    lens = tuple(item.num_tokens for item in items)
    hidden = torch.randn(sum(lens), D, generator=torch.Generator().manual_seed(1))
    result = runner._results(SchedulerOutput(items), hidden, lens)
    assert runner.model.calls == 1  # type: ignore[attr-defined]
    start = 0
    for i, item in enumerate(items):
        targets = score_targets(item)
        logits = hidden[start : start + len(targets)] @ runner.model.weight  # type: ignore[attr-defined]
        values, tops = reference(logits, targets, item.seq.params.logprobs)
        assert len(result.prompt_logprobs[i]) == len(values)
        assert torch.allclose(torch.tensor(result.prompt_logprobs[i]), torch.tensor(values), atol=1e-6)
        assert len(result.prompt_top_logprobs[i]) == len(tops)
        for got, want in zip(result.prompt_top_logprobs[i], tops, strict=True):
            assert list(got) == list(want)  # the same tokens, most likely first
            assert torch.allclose(torch.tensor(list(got.values())), torch.tensor(list(want.values())))
        start += item.num_tokens


def test_nothing_to_score_gives_empty_lists() -> None:
    item = scored("c", [3, 3, 3], 2, 1, 2)
    assert score_logprobs(torch.zeros(0, V), [item]) == [([], [])]
