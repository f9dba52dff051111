"""Offline Python API: LLM(model).generate / .classify / .score, batched, with k per request."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from moe_serve.config import EngineConfig
from moe_serve.engine import pooling
from moe_serve.engine.backend import engine_device, load_model
from moe_serve.engine.inputs import GenerationRequest
from moe_serve.engine.llm_engine import LLMEngine
from moe_serve.engine.runner import LoadedModel
from moe_serve.engine.sequence import Sequence, SequenceKind
from moe_serve.errors import ValidationError
from moe_serve.moe_policy import KSpec, MoEPolicy
from moe_serve.outputs import ClassificationOutput, CompletionOutput, ExpertCounts, RequestOutput, ScoreOutput
from moe_serve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Load an artifact (a directory, or a bundled demo name; for the onnxruntime backend an export directory)
    and run it offline, or run a model already loaded for the backend (moe_serve.exporters.onnx.load_servable,
    which the command line uses, exports an artifact for onnxruntime first).

    Example:
        llm = LLM("path/to/artifact")
        outs = llm.generate(["ROMEO.", "JULIET."], [SamplingParams(max_tokens=32, experts_per_token=1),
                                                   SamplingParams(max_tokens=32, experts_per_token=4)])
    """

    def __init__(
        self, model: str | Path | LoadedModel, engine_config: EngineConfig | None = None, **kwargs: Any
    ) -> None:
        self.engine_config = engine_config or EngineConfig(**kwargs)
        self.artifact = load_model(model, self.engine_config) if isinstance(model, str | Path) else model
        self.config = self.artifact.config
        self.tokenizer = self.artifact.tokenizer
        self.engine = LLMEngine(self.artifact, self.engine_config, engine_device(self.engine_config))
        self.inputs = self.engine.inputs
        self._ids = itertools.count()

    # ---- generation -----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); one SamplingParams for all or one per prompt."""
        self.inputs.require_task("causal_lm", "generate")
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        # Everything is validated before anything runs.
        requests = [
            self.inputs.generation_request(self._encode_prompt(p), params)
            for p, params in zip(prompt_list, params_list, strict=True)
        ]
        outputs = self.run(requests, use_tqdm=use_tqdm)
        for output, prompt in zip(outputs, prompt_list, strict=True):
            output.prompt = prompt if isinstance(prompt, str) else None
        return outputs

    def run(self, requests: list[GenerationRequest], *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run validated requests (from `self.inputs.generation_request`) to completion, batched together."""
        total = sum(r.params.max_tokens * r.params.n for r in requests)
        ids = self._run(lambda rid, i: self.engine.add_request(rid, requests[i]), len(requests), total, use_tqdm)
        return [
            RequestOutput(
                request_id=rid,
                prompt=None,
                prompt_token_ids=request.prompt_token_ids,
                outputs=[_completion(s) for s in seqs],
                experts_per_token=self.config.reported_k(request.k),
                experts=ExpertCounts.total(s.experts(self.config.moe_layers) for s in seqs)
                if self.config.moe_layers
                else None,
            )
            for request, (rid, seqs) in zip(requests, ids, strict=True)
        ]

    def _run(self, add, count: int, total: int, use_tqdm: bool) -> list[tuple[str, list[Sequence]]]:
        """Queue `count` requests with add(request_id, i), step the engine until all finish, return them."""
        added: list[tuple[str, list[Sequence]]] = []
        try:
            for i in range(count):
                rid = f"offline-{next(self._ids)}"
                added.append((rid, add(rid, i)))
            with tqdm(total=total, disable=not use_tqdm, desc="generate", unit="tok") as bar:
                while self.engine.has_unfinished():
                    bar.update(len(self.engine.step()))
        except BaseException:
            for rid, _ in added:  # leave the engine clean for the next call, whatever went wrong in this one
                self.engine.abort(rid)
            raise
        finally:
            for rid, _ in added:
                self.engine.release(rid)
        for _, seqs in added:
            for seq in seqs:
                if seq.error is not None:
                    raise seq.error
        return added

    # ---- classification and scoring -------------------------------------------------------------

    def classify(
        self,
        texts: str | SequenceABC[str],
        experts_per_token: int | SequenceABC[int] | None = None,
        *,
        moe: MoEPolicy | Mapping[str, Any] | None = None,
    ) -> list[ClassificationOutput]:
        """`moe`: an adaptive k policy for every input, instead of experts_per_token."""
        self.inputs.require_task("sequence_classification", "classify")
        text_list = _as_text_list(texts, "input")
        ks = self._resolve_ks(experts_per_token, moe, len(text_list))
        encoded = self.inputs.encode_texts(text_list, "input")
        token_ids = [self.inputs.check_classify_input(ids, i) for i, ids in enumerate(encoded)]
        added = self._run(
            lambda rid, i: self.engine.add_inputs(rid, [token_ids[i]], ks[i], SequenceKind.CLASSIFY),
            len(token_ids),
            0,
            False,
        )
        return [pooling.classification_output(self.config, seqs[0]) for _, seqs in added]

    def score(
        self,
        texts: str | SequenceABC[str],
        experts_per_token: int | SequenceABC[int] | None = None,
        *,
        moe: MoEPolicy | Mapping[str, Any] | None = None,
        return_token_logprobs: bool = False,
    ) -> list[ScoreOutput]:
        """Log-likelihood of each text under the LM. Every token after the first is scored; models with
        add_bos_token start the text with BOS, so all of the text's own tokens are scored. `moe`: an
        adaptive k policy for every text, instead of experts_per_token."""
        self.inputs.require_task("causal_lm", "score")
        text_list = _as_text_list(texts, "input")
        ks = self._resolve_ks(experts_per_token, moe, len(text_list))
        token_ids = [self.inputs.check_score_input(ids) for ids in self.inputs.encode_texts(text_list, "input")]
        added = self._run(
            lambda rid, i: self.engine.add_inputs(rid, [token_ids[i]], ks[i], SequenceKind.SCORE),
            len(token_ids),
            0,
            False,
        )
        return [pooling.score_output(self.config, self.tokenizer, seqs[0], return_token_logprobs) for _, seqs in added]

    # ---- helpers --------------------------------------------------------------------------------

    def _resolve_ks(
        self, value: int | SequenceABC[int] | None, moe: MoEPolicy | Mapping[str, Any] | None, count: int
    ) -> list[KSpec]:
        policy = MoEPolicy.of(moe)
        if isinstance(value, SequenceABC) and not isinstance(value, str):
            if len(value) != count:
                raise ValidationError(
                    f"experts_per_token has {len(value)} entries for {count} inputs", parameter="experts_per_token"
                )
            return [self.inputs.resolve(v, policy) for v in value]
        return [self.inputs.resolve(value, policy)] * count

    def _encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.inputs.encode_text(prompt, "prompt")
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValidationError("a token-id prompt must be a non-empty list of integers", parameter="prompt")
        return list(prompt)


def _completion(seq: Sequence) -> CompletionOutput:
    wants = seq.params.logprobs is not None
    return CompletionOutput(
        index=seq.index,
        text=seq.text,
        token_ids=list(seq.output_token_ids),
        finish_reason=seq.finish_reason,
        logprobs=list(seq.output_logprobs) if wants else None,
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
