"""The step loop: admit waiting sequences into free cache slots, run one forward over every running
sequence (prompts being prefilled and sequences being decoded share the batch), sample, finish.

Each step reads as three verbs: schedule (admit), run (model + sampler), post-process (stop checks).
"""

from __future__ import annotations

import time
from collections import deque

import torch

from moe_serve.artifact import Artifact
from moe_serve.config import EngineConfig
from moe_serve.engine.inputs import GenerationRequest, InputProcessor
from moe_serve.engine.kv_cache import KVCache
from moe_serve.engine.model_runner import ModelRunner
from moe_serve.engine.sampler import sample
from moe_serve.engine.sequence import Sequence, SequenceStatus
from moe_serve.errors import ValidationError


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
        self.kv_cache_tokens = config.kv_cache_tokens or config.max_num_seqs * self.max_model_len
        self.cache = KVCache(self.model_config, config.max_num_seqs, self.max_model_len, device, self.runner_dtype)
        self.inputs = InputProcessor.for_artifact(artifact, self.max_model_len, self.kv_cache_tokens)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, request: GenerationRequest) -> list[Sequence]:
        """Queue a request validated by `self.inputs.generation_request`; one sequence per completion."""
        params = request.params
        # Cheap invariants only: the full validation happened once, on the way in.
        if not request.prompt_token_ids or len(request.prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValidationError(
                "request does not fit this engine's context; validate it with engine.inputs", parameter="prompt"
            )
        now = time.monotonic()
        seqs = []
        for index in range(params.n):
            generator = None
            if not params.is_greedy:
                generator = torch.Generator(self.device)
                if params.seed is None:
                    generator.seed()
                else:
                    generator.manual_seed(params.seed + index)
            seq = Sequence(request_id, list(request.prompt_token_ids), params, request.k, generator, arrival_time=now)
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

    @property
    def runner_dtype(self) -> torch.dtype:
        return self.artifact.model.embed_tokens.weight.dtype

    @property
    def num_reserved_tokens(self) -> int:
        """KV positions promised to running sequences (prompt + max_tokens each)."""
        return sum(len(s.prompt_token_ids) + s.params.max_tokens for s in self.running)

    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that got a token (finished ones have status FINISHED)."""
        # Admission: first come, first served, while a slot and the token budget allow.
        reserved = self.num_reserved_tokens
        now = time.monotonic()
        while self.waiting and self.cache.num_free_slots:
            need = len(self.waiting[0].prompt_token_ids) + self.waiting[0].params.max_tokens
            if reserved + need > self.kv_cache_tokens:
                break
            seq = self.waiting.popleft()
            seq.slot = self.cache.allocate()
            seq.status = SequenceStatus.RUNNING
            seq.first_scheduled_time = now
            self.running.append(seq)
            reserved += need
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

        now = time.monotonic()
        for seq, tokens, token, logprob, tops in zip(batch, new_tokens, token_ids, logprobs, top_logprobs, strict=True):
            seq.token_times.append(now)
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
        if seq.slot is not None:
            self.cache.free(seq.slot)
            seq.slot = None
