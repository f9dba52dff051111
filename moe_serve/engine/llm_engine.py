"""The step loop: admit waiting sequences into free cache slots, run one forward over every running
sequence (prompts being prefilled and sequences being decoded share the batch), sample, finish.

Each step reads as three verbs: schedule (admit), run (model + sampler), post-process (stop checks).
"""

from __future__ import annotations

import itertools
from collections import deque

import torch

from moe_serve.artifact import Artifact
from moe_serve.config import EngineConfig
from moe_serve.engine.kv_cache import KVCache
from moe_serve.engine.model_runner import ModelRunner
from moe_serve.engine.sampler import sample
from moe_serve.engine.sequence import Sequence, SequenceStatus
from moe_serve.errors import ValidationError
from moe_serve.sampling_params import SamplingParams, check_experts_per_token


class LLMEngine:
    def __init__(self, artifact: Artifact, config: EngineConfig, device: torch.device) -> None:
        self.artifact = artifact
        self.model_config = artifact.config
        self.tokenizer = artifact.tokenizer
        self.config = config
        self.device = device
        self.runner = ModelRunner(artifact.model, device)
        positions = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or positions, positions)
        self.cache: KVCache | None = None
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._seq_ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------------

    def resolve_experts_per_token(self, value: int | None) -> int:
        """The request's k: validated against the model's range; the default when None."""
        moe = self.model_config.moe
        if moe is None:
            if value is not None:
                raise ValidationError(
                    f"experts_per_token was given but model '{self.artifact.name}' has no MoE layers",
                    parameter="experts_per_token",
                    value=value,
                )
            return 1
        if value is None:
            return moe.default_k
        check_experts_per_token(value, moe.min_k, moe.max_k)
        return value

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> list[Sequence]:
        params.verify()
        if not prompt_token_ids:
            raise ValidationError("prompt must not be empty", parameter="prompt")
        k = self.resolve_experts_per_token(params.experts_per_token)
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValidationError(
                f"prompt has {len(prompt_token_ids)} tokens; this model's context is {self.max_model_len} tokens "
                "(prompt + max_tokens must fit)",
                parameter="prompt",
            )
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValidationError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds this model's "
                f"context of {self.max_model_len} tokens",
                parameter="max_tokens",
            )
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValidationError(f"prompt token ids must be in 0..{vocab - 1}", parameter="prompt")
        seqs = []
        for index in range(params.n):
            generator = None
            if not params.is_greedy:
                generator = torch.Generator(self.device)
                if params.seed is None:
                    generator.seed()
                else:
                    generator.manual_seed(params.seed + index)
            seq = Sequence(next(self._seq_ids), request_id, list(prompt_token_ids), params, k, generator)
            self.waiting.append(seq)
            seqs.append(seq)
        return seqs

    def abort(self, request_id: str) -> None:
        for seq in [s for s in self.waiting if s.request_id == request_id]:
            self.waiting.remove(seq)
            self._finish(seq, "abort")
        for seq in [s for s in self.running if s.request_id == request_id]:
            self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step -------------------------------------------------------------------------------

    def reserve(self, num_slots: int, max_len: int) -> None:
        """Size the cache for an offline batch (only while nothing is running)."""
        num_slots = min(num_slots, self.config.max_num_seqs)
        max_len = min(max_len, self.max_model_len)
        if self.cache is None or (not self.running and (self.cache.num_slots < num_slots or self.cache.max_len < max_len)):
            self.cache = KVCache(self.model_config, num_slots, max_len, self.device, self.runner_dtype)

    @property
    def runner_dtype(self) -> torch.dtype:
        return self.artifact.model.embed_tokens.weight.dtype

    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that got a token (finished ones have status FINISHED)."""
        if self.cache is None:
            self.reserve(self.config.max_num_seqs, self.max_model_len)
        assert self.cache is not None
        while self.waiting and self.cache.num_free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.cache.allocate()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        if not self.running:
            return []

        batch = list(self.running)
        new_tokens = [s.uncached_token_ids for s in batch]
        with torch.inference_mode():
            hidden, token_mask = self.runner.forward(
                new_tokens,
                [s.experts_per_token for s in batch],
                start_positions=[s.num_cached_tokens for s in batch],
                slots=[s.slot for s in batch],  # type: ignore[misc]  # running sequences hold a slot
                cache=self.cache,
            )
            logits = self.runner.last_token_logits(hidden, token_mask)
            token_ids, logprobs, top_logprobs = sample(logits, batch)

        for seq, tokens, token, logprob, tops in zip(batch, new_tokens, token_ids, logprobs, top_logprobs):
            seq.num_cached_tokens += len(tokens)
            seq.output_token_ids.append(token)
            seq.output_logprobs.append(logprob)
            seq.top_logprobs.append(tops)
            self._check_finished(seq)
        return batch

    def _check_finished(self, seq: Sequence) -> None:
        params = seq.params
        if seq.output_token_ids[-1] in self.eos_token_ids and not params.ignore_eos:
            seq.output_token_ids.pop()
            seq.output_logprobs.pop()
            seq.top_logprobs.pop()
            seq.text = self.tokenizer.decode(seq.output_token_ids)
            self._finish(seq, "stop")
            return
        seq.text = self.tokenizer.decode(seq.output_token_ids)
        cut = min((i for i in (seq.text.find(s) for s in params.stop) if i >= 0), default=-1)
        if cut >= 0:
            seq.text = seq.text[:cut]
            self._finish(seq, "stop")
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot is not None and self.cache is not None:
            self.cache.free(seq.slot)
            seq.slot = None
