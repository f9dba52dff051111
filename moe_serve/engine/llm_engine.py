"""The engine: requests in, one step at a time, results out. A step reads as four verbs: schedule (the
scheduler picks which sequences and how many tokens, and the step's own decisions go into that plan: each
"auto" sequence's k), execute (the runner's one token-packed forward), post-process (sample, detokenize,
stop, finish) and observe (the step's time refits the scheduler's cost model and auto k's controller).

Isolation: anything tied to one sequence (its sampling settings, its stop strings, its inputs) can only
finish that sequence with an error; the step goes on for the others.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from moe_serve.config import EngineConfig
from moe_serve.engine.auto_k import AutoKClock, AutoKConfig, AutoKController
from moe_serve.engine.backend import make_runner
from moe_serve.engine.block_manager import BlockManager
from moe_serve.engine.detokenizer import IncrementalDetokenizer
from moe_serve.engine.inputs import GenerationRequest, InputProcessor
from moe_serve.engine.kv_cache import bytes_per_token, cache_shape, router_state_sizes
from moe_serve.engine.runner import LoadedModel, Runner, StepResult
from moe_serve.engine.sampler import Sampled, sample
from moe_serve.engine.scheduler import Scheduler, SchedulerConfig
from moe_serve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from moe_serve.engine.sequence import Sequence, SequenceKind, SequenceStatus, WorkGroup
from moe_serve.errors import NonFiniteError, ValidationError
from moe_serve.kernels import ops
from moe_serve.moe_policy import KSpec
from moe_serve.sampling_params import SamplingParams

CALIBRATION_TOKENS = 512  # the longer of the two timed dummy prompts at start-up

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, artifact: LoadedModel, config: EngineConfig, device: torch.device) -> None:
        self.artifact = artifact
        self.model_config = artifact.config
        self.tokenizer = artifact.tokenizer
        self.config = config
        self.device = device
        positions = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or positions, positions)
        dtype = artifact.dtype
        budget = config.kv_cache_memory
        if config.kv_cache_tokens is not None:
            budget = min(budget, config.kv_cache_tokens * bytes_per_token(self.model_config, dtype))
        shape = cache_shape(self.model_config, dtype, budget, config.block_size)
        self.runner: Runner = make_runner(artifact, device, shape, config)
        self.cache_shape = shape
        self.blocks = BlockManager(
            shape.num_blocks, config.block_size, config.enable_prefix_caching, shape.layout.reaches
        )
        scheduler_config = SchedulerConfig(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_join_stall,
            long_prefill_threshold=config.long_prefill_threshold,
            long_prefill_chunk=config.long_prefill_chunk,
            max_long_prefills=config.max_long_prefills,
            long_prefill_alone_seconds=config.long_prefill_alone_ms / 1000,
        )
        self.scheduler = Scheduler(scheduler_config, self.blocks)
        self._calibrate_costs(config)
        kv_budget = config.kv_cache_tokens or budget // bytes_per_token(self.model_config, dtype)
        self.inputs = InputProcessor(
            artifact.name,
            self.model_config,
            self.tokenizer,
            self.max_model_len,
            shape.sequence_tokens,
            kv_budget,
            config.block_size,
            config.max_num_batched_tokens,
            config.backend,
            auto_k=config.target_itl_ms is not None,
        )
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.requests: dict[str, list[Sequence]] = {}
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}
        self.auto_k = self._auto_k_controller()
        self._auto_k_clock = AutoKClock(self.auto_k) if self.auto_k is not None else None

    def _calibrate_costs(self, config: EngineConfig) -> None:
        """How a prompt's cost grows with its length (attention), from a short and a long dummy prompt, so
        that the first long prompt joining running decodes is already chunked to bound their stall."""
        if router_state_sizes(self.model_config):  # its routers read state from the cache: no cache-free pass
            return
        long = min(CALIBRATION_TOKENS, config.max_num_batched_tokens, self.max_model_len)
        k = self.model_config.moe.default_k if self.model_config.moe else 1
        # max(1, ...): a step budget under 8 tokens still times a one-token prompt (calibrate skips long <= short)
        self.scheduler.costs.calibrate(lambda n: self.runner.prompt_seconds(n, k), max(1, long // 8), long)

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, request: GenerationRequest, group: WorkGroup | None = None
    ) -> list[Sequence]:
        """Queue a request validated by `self.inputs.generation_request`; one sequence per completion. `group`:
        the work it counts with (the other prompts of its client request; default: its own prompt)."""
        params = request.params
        # Cheap invariants only: the full validation happened once, on the way in.
        if not request.prompt_token_ids or len(request.prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValidationError(
                "request does not fit this engine's context; validate it with engine.inputs", parameter="prompt"
            )
        seqs = []
        for index in range(params.n):
            generator = None
            if not params.is_greedy:
                generator = torch.Generator(self.device)
                if params.seed is None:
                    generator.seed()
                else:
                    generator.manual_seed(params.seed + index)
            seq = self._new(request_id, index, request.prompt_token_ids, request.k, SequenceKind.GENERATE, params)
            seq.group = group
            seq.generator = generator
            seq.matcher = request.grammar.matcher() if request.grammar is not None else None
            self._detokenizers[id(seq)] = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
            )
            seqs.append(seq)
        return self._queue(request_id, seqs)

    def add_inputs(
        self,
        request_id: str,
        token_ids: list[list[int]],
        k: int | KSpec,
        kind: SequenceKind,
        top_logprobs: int = 0,
        group: WorkGroup | None = None,
    ) -> list[Sequence]:
        """Queue inputs to score (log-likelihood of each token, and the `top_logprobs` most likely tokens at
        each position when asked) or classify, all at one k (or k spec, resolved by engine.inputs). Their
        prompt work counts together (`group`; default: a group of these inputs)."""
        params = SamplingParams(max_tokens=1, logprobs=top_logprobs or None)
        if group is None:
            group = WorkGroup(sum(len(ids) for ids in token_ids))
        seqs = [self._new(request_id, i, ids, k, kind, params) for i, ids in enumerate(token_ids)]
        for seq in seqs:
            seq.group = group
        return self._queue(request_id, seqs)

    def _new(
        self,
        request_id: str,
        index: int,
        token_ids: list[int],
        k: int | KSpec,
        kind: SequenceKind,
        params: SamplingParams,
    ) -> Sequence:
        seq = Sequence(request_id, index, list(token_ids), len(token_ids), KSpec.of(k), kind, params)
        seq.arrival_time = time.monotonic()
        return seq

    def _queue(self, request_id: str, seqs: list[Sequence]) -> list[Sequence]:
        if request_id in self.requests:
            raise ValidationError(f"request id {request_id!r} is already running", parameter="request_id")
        self.requests[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)
        return seqs

    def abort(self, request_id: str) -> None:
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def release(self, request_id: str) -> None:
        """Forget a finished request (its sequences stay with whoever holds them)."""
        self.requests.pop(request_id, None)

    # ---- the step -------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Share of the KV-cache blocks held by sequences."""
        return self.blocks.num_used_blocks / max(self.blocks.num_blocks, 1)

    def _auto_k_controller(self) -> AutoKController | None:
        """What picks the k of experts_per_token "auto" requests each step (None without --target-itl-ms,
        or for a model without MoE layers)."""
        moe = self.model_config.moe
        if self.config.target_itl_ms is None or moe is None:
            return None
        return AutoKController(
            AutoKConfig.from_ms(
                self.config.target_itl_ms,
                self.config.target_ttft_ms,
                min_k=moe.min_k,
                max_k=moe.max_k,
                max_waiting=self.config.max_waiting,
            )
        )

    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that changed (a token, a result, or finished)."""
        output, started = self._schedule()
        if not output.scheduled:
            return []
        result, failed = self._execute(output)
        changed, sampled_at = self._post_process(output, result, failed)
        self._observe(output, result, started, sampled_at, time.monotonic())
        return changed

    def _schedule(self) -> tuple[SchedulerOutput, float]:
        """The step's plan and when it starts: which sequences, how many tokens, and the per-step decisions
        written into the plan (the k of each "auto" sequence for this step, in its scheduled item)."""
        output = self.scheduler.schedule()
        started = time.monotonic()
        for item in output.scheduled:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = started
        if self._auto_k_clock is not None and output.scheduled:
            self._auto_k_clock.begin_step(started, output.scheduled)
        return output, started

    def _post_process(
        self, output: SchedulerOutput, result: StepResult, failed: list[tuple[ScheduledSequence, BaseException]]
    ) -> tuple[list[Sequence], float]:
        """What the step's results do to its sequences: experts counted, the scheduler told, failures
        finished, next tokens sampled and appended (stops and lengths checked), scores and class
        probabilities stored. -> the sequences that changed, and when the tokens were sampled."""
        for i, (tokens, per_layer) in result.experts.items():
            item = output.scheduled[i]
            item.seq.add_experts(tokens, per_layer, item.k_spec.k)
        # A failed item's keys of this step may be unwritten: its blocks must not reach the prefix cache.
        self.scheduler.update(output, failed=[item.seq for item, _ in failed])
        changed = [self._fail(item.seq, exc) for item, exc in failed]
        samples = [output.scheduled[i].seq for i in result.sample_items]
        logits, greedy = result.logits, None
        if logits is not None and samples:
            greedy, finite = ops.greedy_rows(logits)  # one read of the logits: argmax and finiteness
            if not bool(finite.all()):
                for seq, ok in zip(samples, finite.tolist(), strict=True):
                    if not ok:
                        changed.append(self._fail(seq, self._non_finite("logits")))
                samples = [seq for seq, ok in zip(samples, finite.tolist(), strict=True) if ok]
                logits, greedy = logits[finite], greedy[finite]
        sampled = sample(logits, samples, self.eos_token_ids, greedy)
        now = time.monotonic()
        for row, seq in enumerate(samples):
            error = sampled.errors.get(row)
            token = sampled.token_ids[row]
            if error is not None or token is None:
                changed.append(self._fail(seq, error or RuntimeError("no token was sampled")))
                continue
            self._append(seq, token, sampled, row, now)
            changed.append(seq)
        for i, values in result.prompt_logprobs.items():
            seq = output.scheduled[i].seq
            if seq.is_finished:
                continue
            if not all(v is None or math.isfinite(v) for v in values):
                changed.append(self._fail(seq, self._non_finite("prompt log-probabilities")))
                continue
            seq.prompt_logprobs += values
            seq.prompt_top_logprobs += result.prompt_top_logprobs.get(i, [])
            if seq.num_computed_tokens == seq.num_tokens:
                self._finish(seq, "stop")
                changed.append(seq)
        for i, probs in result.class_probs.items():
            seq = output.scheduled[i].seq
            if not all(math.isfinite(v) for v in probs):
                changed.append(self._fail(seq, self._non_finite("class probabilities")))
                continue
            seq.class_probs = probs
            self._finish(seq, "stop")
            changed.append(seq)
        return changed, now

    def _observe(
        self, output: SchedulerOutput, result: StepResult, started: float, sampled_at: float, ended: float
    ) -> None:
        """What the step's timing teaches: the scheduler's cost model, and auto k's latency controller."""
        self.scheduler.costs.observe(output, ended - started)
        self.scheduler.step_took(ended - started)
        if self._auto_k_clock is not None:
            idle = not self.scheduler.has_unfinished()
            self._auto_k_clock.end_step(output, result.sample_items, sampled_at, ended, self.num_waiting, idle)

    def _execute(self, output: SchedulerOutput) -> tuple[StepResult, list[tuple[ScheduledSequence, BaseException]]]:
        """Run the step; if it fails, run each sequence alone so that only the ones that fail alone fail."""
        try:
            return self.runner.execute(output), []
        except Exception:
            logger.exception("a step of %d sequences failed; running them one at a time", len(output.scheduled))
        merged, failed = StepResult(), []  # type: tuple[StepResult, list[tuple[ScheduledSequence, BaseException]]]
        logits: list[torch.Tensor] = []
        for i, item in enumerate(output.scheduled):
            try:
                alone = self.runner.execute(SchedulerOutput([item]))
            except Exception as exc:
                failed.append((item, exc))
                continue
            if alone.sample_items and alone.logits is not None:
                merged.sample_items.append(i)
                logits.append(alone.logits)
            if alone.prompt_logprobs:
                merged.prompt_logprobs[i] = alone.prompt_logprobs[0]
                merged.prompt_top_logprobs[i] = alone.prompt_top_logprobs.get(0, [])
            if alone.class_probs:
                merged.class_probs[i] = alone.class_probs[0]
            if alone.experts:
                merged.experts[i] = alone.experts[0]
        merged.logits = torch.cat(logits) if logits else None
        return merged, failed

    def _append(self, seq: Sequence, token: int, sampled: Sampled, row: int, now: float) -> None:
        seq.token_times.append(now)
        params = seq.params
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            self._finish(seq, "stop")
            return
        if seq.matcher is not None and not seq.matcher.consume(token):  # the mask allowed it: a grammar fault
            self._fail(seq, RuntimeError(f"the structured output's grammar failed: {seq.matcher.error}"))
            return
        seq.token_ids.append(token)
        if params.logprobs is not None:
            logprob = sampled.logprobs[row]
            assert logprob is not None, "the sampler computes a log-probability for every row that asks"
            seq.output_logprobs.append(logprob)
            seq.top_logprobs.append(sampled.top_logprobs[row])
        detokenizer = self._detokenizers[id(seq)]
        stop = detokenizer.add(token)
        seq.text = detokenizer.text
        if stop is not None or (seq.matcher is not None and seq.matcher.is_stopped):  # the grammar is complete
            self._finish(seq, "stop")
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")

    def stable_text_length(self, seq: Sequence) -> int:
        """How much of a running sequence's text can be streamed: no later token can change it."""
        if seq.is_finished:
            return len(seq.text)
        return self._detokenizers[id(seq)].stable_text_length()

    def _non_finite(self, what: str) -> NonFiniteError:
        return NonFiniteError(
            f"model '{self.artifact.name}' produced non-finite {what} (NaN or inf) for this input: its weights "
            "overflow on it, in this dtype"
        )

    def _fail(self, seq: Sequence, exc: BaseException) -> Sequence:
        logger.warning("sequence %s/%d failed: %s", seq.request_id, seq.index, exc)
        self._finish(seq, "error", exc)
        return seq

    def _finish(self, seq: Sequence, reason: str, error: BaseException | None = None) -> None:
        self.scheduler.finish(seq, reason, error)
        self._detokenizers.pop(id(seq), None)
        assert seq.status is SequenceStatus.FINISHED
