"""Offline Python API: LLM(model).generate / .classify / .score, batched, with k per request."""

from __future__ import annotations

import math
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from moe_serve.artifact import Artifact, load_artifact
from moe_serve.config import EngineConfig
from moe_serve.engine.llm_engine import LLMEngine
from moe_serve.engine.pooling import class_probabilities, token_logprobs
from moe_serve.errors import ValidationError
from moe_serve.outputs import ClassificationOutput, CompletionOutput, RequestOutput, ScoreOutput
from moe_serve.registry import resolve_model
from moe_serve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Load an artifact (a directory, or a bundled demo name) and run it offline.

    Example:
        llm = LLM("path/to/artifact")
        outs = llm.generate(["ROMEO.", "JULIET."], [SamplingParams(max_tokens=32, experts_per_token=1),
                                                   SamplingParams(max_tokens=32, experts_per_token=4)])
    """

    def __init__(self, model: str | Path, engine_config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.engine_config = engine_config or EngineConfig(**kwargs)
        device = self.engine_config.torch_device()
        self.artifact: Artifact = load_artifact(
            resolve_model(model),
            device=device,
            dtype=self.engine_config.torch_dtype(),
            verify_checksums=self.engine_config.verify_checksums,
        )
        self.config = self.artifact.config
        self.tokenizer = self.artifact.tokenizer
        self.engine = LLMEngine(self.artifact, self.engine_config, device)

    # ---- generation -----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); one SamplingParams for all or one per prompt."""
        self._require_task("causal_lm", "generate")
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        prompt_ids = [self._encode_prompt(p) for p in prompt_list]
        for ids, params in zip(prompt_ids, params_list):  # validate everything before running anything
            self.engine.check_request(ids, params)
        requests = []
        try:
            for index, (ids, params) in enumerate(zip(prompt_ids, params_list)):
                requests.append(self.engine.add_request(str(index), ids, params))
            total = sum(p.max_tokens * p.n for p in params_list)
            with tqdm(total=total, disable=not use_tqdm, desc="generate", unit="tok") as bar:
                while self.engine.has_unfinished():
                    bar.update(len(self.engine.step()))
        except BaseException:
            # Leave the engine clean for the next call, whatever went wrong in this one.
            for index in range(len(requests)):
                self.engine.abort(str(index))
            raise
        return [
            RequestOutput(
                request_id=str(index),
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=ids,
                outputs=[_completion(i, s) for i, s in enumerate(seqs)],
                experts_per_token=seqs[0].experts_per_token if self.config.moe else None,
            )
            for index, (prompt, ids, seqs) in enumerate(zip(prompt_list, prompt_ids, requests))
        ]

    # ---- classification and scoring -------------------------------------------------------------

    def classify(self, texts: str | SequenceABC[str], experts_per_token: int | SequenceABC[int] | None = None) -> list[ClassificationOutput]:
        self._require_task("sequence_classification", "classify")
        text_list = _as_text_list(texts, "input")
        ks = self._resolve_ks(experts_per_token, len(text_list))
        token_ids = [self.engine.encode_text(t, "input") for t in text_list]
        assert self.config.classifier is not None
        labels = self.config.classifier.labels
        moe = self.config.moe
        probs = class_probabilities(self.engine.runner, token_ids, ks, self.engine_config.max_num_seqs)
        results = []
        for k, row in zip(ks, probs):
            best = max(range(len(labels)), key=row.__getitem__)
            approximate = bool(moe and moe.is_approximate(k))
            results.append(ClassificationOutput(labels[best], dict(zip(labels, row)), k if moe else None, approximate))
        return results

    def score(
        self,
        texts: str | SequenceABC[str],
        experts_per_token: int | SequenceABC[int] | None = None,
        *,
        return_token_logprobs: bool = False,
    ) -> list[ScoreOutput]:
        """Log-likelihood of each text under the LM. Every token after the first is scored; models with
        add_bos_token start the text with BOS, so all of the text's own tokens are scored."""
        self._require_task("causal_lm", "score")
        text_list = _as_text_list(texts, "input")
        ks = self._resolve_ks(experts_per_token, len(text_list))
        sequences = []
        for text in text_list:
            ids = self.engine.encode_text(text, "input")
            if len(ids) < 2:
                raise ValidationError(
                    "input must have at least 2 tokens to be scored (the first token has no context)", parameter="input"
                )
            sequences.append(ids)
        results = []
        for ids, k, per_token in zip(sequences, ks, token_logprobs(self.engine.runner, sequences, ks, self.engine_config.max_num_seqs)):
            results.append(score_output(self.tokenizer, ids, per_token, k if self.config.moe else None, return_token_logprobs))
        return results

    # ---- helpers --------------------------------------------------------------------------------

    def _require_task(self, task: str, method: str) -> None:
        if self.config.task != task:
            raise ValidationError(f"{method} needs a {task} model; '{self.artifact.name}' is {self.config.task}", parameter="model")

    def _resolve_ks(self, value: int | SequenceABC[int] | None, count: int) -> list[int]:
        if isinstance(value, SequenceABC) and not isinstance(value, str):
            if len(value) != count:
                raise ValidationError(f"experts_per_token has {len(value)} entries for {count} inputs", parameter="experts_per_token")
            return [self.engine.resolve_experts_per_token(v) for v in value]
        return [self.engine.resolve_experts_per_token(value)] * count  # type: ignore[arg-type]

    def _encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.engine.encode_text(prompt, "prompt")
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValidationError("a token-id prompt must be a non-empty list of integers", parameter="prompt")
        return list(prompt)



def score_output(tokenizer: Any, ids: list[int], per_token: list[float], k: int | None, keep_tokens: bool) -> ScoreOutput:
    """Totals for one scored sequence; bytes are those of the scored tokens (special tokens count 0)."""
    num_bytes = len(tokenizer.decode(ids[1:]).encode("utf-8"))
    total = float(sum(per_token))
    return ScoreOutput(
        total_logprob=total,
        num_tokens=len(ids) - 1,
        num_bytes=num_bytes,
        bits_per_byte=-total / math.log(2) / max(num_bytes, 1),
        experts_per_token=k,
        token_logprobs=per_token if keep_tokens else None,
    )


def _completion(index: int, seq: Any) -> CompletionOutput:
    return CompletionOutput(
        index=index,
        text=seq.text,
        token_ids=list(seq.output_token_ids),
        finish_reason=seq.finish_reason,
        logprobs=list(seq.output_logprobs),
        top_logprobs=list(seq.top_logprobs) if seq.params.logprobs else None,
    )


def _as_prompt_list(prompts: Prompt | SequenceABC[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, SequenceABC) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # type: ignore[arg-type]  # a single token-id prompt
    if not isinstance(prompts, SequenceABC) or len(prompts) == 0:
        raise ValidationError("prompts must be a non-empty list", parameter="prompt")
    return list(prompts)  # type: ignore[arg-type]


def _as_text_list(texts: str | SequenceABC[str], parameter: str) -> list[str]:
    if isinstance(texts, str):
        return [texts]
    if not isinstance(texts, SequenceABC) or len(texts) == 0:
        raise ValidationError(f"{parameter} must be a non-empty list of strings", parameter=parameter)
    return list(texts)


def _as_params_list(params: SamplingParams | SequenceABC[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValidationError(f"got {len(params)} SamplingParams for {count} prompts", parameter="sampling_params")
    return list(params)
