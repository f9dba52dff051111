"""The parity check the family imports share (tests/exporters/test_hf_families.py, test_hf_deepseek.py): an
exported model against transformers on the same directory, through one whole prefill, a prefill in chunks and
decode, at a given k; and the module fixtures it runs on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moe_serve import LLM, EngineConfig, SamplingParams
from moe_serve.exporters.base import ExportOptions
from moe_serve.exporters.hf import export_hf

NO_PROGRESS = ExportOptions(progress=False)
PROMPT, NEW, TOP = 20, 16, 5  # prompt and generated tokens, alternatives compared
CHUNK = 8  # the chunked engine's step budget: the prompt is prefilled in chunks of 8, 8 and 4 tokens
LOGITS_ATOL = 1e-4  # fp32 (measured: at most 7.4e-6 over every family)
LOGPROB_ATOL = 1e-4  # fp32 log-probabilities of the top tokens (measured: at most 5.7e-6)

LoadModel = Callable[[Path, int], torch.nn.Module]  # (HF directory, k) -> transformers' model at that k


def export_all(root: Path, names, save: Callable[..., Path], first_seed: int) -> dict[str, tuple[Path, Path]]:
    """name -> (HF directory, artifact directory), each model saved by save(name, directory, seed=...)."""
    out = {}
    for seed, name in enumerate(names, start=first_seed):
        src = save(name, root / f"{name}-hf", seed=seed)
        out[name] = (src, export_hf(src, root / f"{name}-artifact", NO_PROGRESS))
    return out


class Engines(dict):
    """name -> (an engine that prefills a prompt in one step, one that prefills it in chunks of CHUNK), each
    made when a test first asks for it."""

    def __init__(self, exported: dict[str, tuple[Path, Path]]) -> None:
        super().__init__()
        self.exported = exported

    def __missing__(self, name: str) -> tuple[LLM, LLM]:
        artifact = self.exported[name][1]
        self[name] = (LLM(artifact), LLM(artifact, EngineConfig(max_num_batched_tokens=CHUNK)))
        return self[name]


def transformers_reference(model: torch.nn.Module, prompt: torch.Tensor, new: int = NEW):
    """transformers' greedy tokens after `prompt` [1, P] (the whole sequence), their log-probability rows, and
    every position's logits in one forward."""
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
        logits = model(out.sequences).logits[0]
    expected = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
    return out.sequences, expected, logits


def assert_generates(llm: LLM, prompt: list[int], k: int, tokens: list[int], expected: list[torch.Tensor]) -> None:
    """Greedy tokens equal `tokens`; each one's log-probability and the top TOP alternatives within LOGPROB_ATOL."""
    params = SamplingParams(max_tokens=len(tokens), temperature=0, ignore_eos=True, experts_per_token=k, logprobs=TOP)
    got = llm.generate([prompt], params)[0].outputs[0]
    assert got.token_ids == tokens
    for step, (token, logprob, top, want) in enumerate(
        zip(got.token_ids, got.logprobs, got.top_logprobs, expected, strict=True)
    ):
        assert abs(logprob - want[token].item()) <= LOGPROB_ATOL, (step, logprob, want[token].item())
        best = sorted(top, key=lambda t: -top[t])[:TOP]
        assert best == want.topk(TOP).indices.tolist(), step
        assert max(abs(top[t] - want[t].item()) for t in best) <= LOGPROB_ATOL, step


def record_prefills(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The prompt tokens of each engine step that prefills (decode-only steps add nothing)."""
    prefills: list[int] = []
    execute = llm.engine.runner.execute

    def recording(output):
        if output.num_prefill_tokens:
            prefills.append(output.num_prefill_tokens)
        return execute(output)

    monkeypatch.setattr(llm.engine.runner, "execute", recording)
    return prefills


def check_parity(
    engines: tuple[LLM, LLM], model: torch.nn.Module, k: int, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every position's logits within LOGITS_ATOL in one forward; then greedy tokens and top log-probabilities
    through a whole prefill, and through chunks of CHUNK (each step recorded), then decode."""
    prompt = torch.randint(0, 300, (1, PROMPT), generator=torch.Generator().manual_seed(seed))
    sequence, expected, logits = transformers_reference(model, prompt)
    whole, chunked = engines
    with torch.inference_mode():
        hidden, _ = whole.engine.runner.forward_padded(sequence.tolist(), [k])
        torch.testing.assert_close(whole.artifact.model.lm_logits(hidden)[0], logits, atol=LOGITS_ATOL, rtol=0)
    for llm, chunks in ((whole, [PROMPT]), (chunked, [CHUNK, CHUNK, PROMPT - 2 * CHUNK])):
        prefills = record_prefills(llm, monkeypatch)
        assert_generates(llm, prompt[0].tolist(), k, sequence[0, PROMPT:].tolist(), expected)
        assert prefills == chunks  # the prompt went through in one step or in chunks, then decode steps
