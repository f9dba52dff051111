"""Per-sequence state: WAITING -> RUNNING -> FINISHED (RUNNING -> WAITING again when preempted).

A sequence is one completion of a request (n sequences for n completions), a prompt to score, or an input
to classify. The scheduler only compares `num_computed_tokens` with `num_tokens`: that one rule covers a
prompt's prefill (in chunks), a prefix-cache hit, decoding, and recomputation after preemption.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from moe_serve.engine.grammar import GrammarMatcher
from moe_serve.moe_policy import KSpec
from moe_serve.outputs import ExpertCounts
from moe_serve.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SequenceKind(Enum):
    GENERATE = "generate"  # sample tokens after the prompt
    SCORE = "score"  # log-likelihood of the prompt's tokens; nothing is generated
    CLASSIFY = "classify"  # class probabilities of the whole input in one step (bidirectional; no KV cache)


@dataclass(slots=True, eq=False)
class WorkGroup:
    """Sequences whose prompt work counts as one piece: all the prompts of one client request (a completion
    request's prompts, a score request's inputs) or a batch file's lines. The scheduler treats a sequence as
    long work while its group's prompt tokens together exceed `long_prefill_threshold`, or while the group is
    background work (a batch file), so many medium prompts in one request queue as one long prompt would:
    behind short interactive requests, in chunks whose cost is bounded, never ahead of them."""

    prompt_tokens: int  # the prompt tokens of every sequence of the group, together (a prompt shared by n
    # completions counted once)
    background: bool = False  # batch work (the Batch API, `moe-serve batch`): long work whatever its size

    def is_long(self, threshold: int) -> bool:
        """Long work: background, or prompts together of more than `threshold` tokens."""
        return self.background or self.prompt_tokens > threshold


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    index: int  # which completion of its request
    token_ids: list[int]  # the prompt, then the generated tokens
    num_prompt_tokens: int
    k_spec: KSpec  # the request's k: a fixed k, a top-p policy or "auto" (an int given here becomes a fixed k)
    kind: SequenceKind = SequenceKind.GENERATE
    params: SamplingParams = field(default_factory=SamplingParams)
    group: WorkGroup | None = None  # the work it counts with (None: its own prompt alone)
    generator: torch.Generator | None = None
    matcher: GrammarMatcher | None = None  # a structured output's grammar: which tokens may come next
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose keys and values are in the cache
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache at admission
    # One block table per KV group (engine.kv_cache.KVLayout; one group for most models), empty while it holds
    # no blocks; the entries a group gave back are RELEASED (BlockManager.release_unreachable).
    block_tables: list[list[int]] = field(default_factory=list)
    num_released_blocks: list[int] = field(default_factory=list)  # per group: leading entries given back
    block_hashes: list[int] = field(default_factory=list)  # of the full blocks in each table, in order
    # Results.
    output_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)  # SCORE: log p(token_i | tokens_<i), i >= 1
    prompt_top_logprobs: list[dict[int, float]] = field(default_factory=list)  # SCORE with params.logprobs
    class_probs: list[float] | None = None  # CLASSIFY
    text: str = ""
    finish_reason: str | None = None  # stop, length, abort, error
    error: BaseException | None = None  # why it finished with finish_reason "error"
    # Times (time.monotonic()), for latency metrics.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    # Tokens it computed and, under a policy, the experts they took per MoE layer: added after each step.
    expert_tokens: int = 0
    experts_per_layer: list[int] = field(default_factory=list)
    auto_experts: int = 0  # experts_per_token "auto": the sum over steps of the step's k times its tokens

    def __post_init__(self) -> None:
        self.k_spec = KSpec.of(self.k_spec)

    @property
    def k(self) -> int:
        """The most experts a token may take (its fixed k, or its policy's max)."""
        return self.k_spec.k

    def add_experts(self, tokens: int, per_layer: list[int] | None, step_k: int) -> None:
        """A step's count: its tokens, and under a policy the experts they took per MoE layer (a fixed k's
        follow from the tokens: see `experts`; under "auto", step_k, the k the step ran it with, in every
        layer)."""
        self.expert_tokens += tokens
        if self.k_spec.auto:
            self.auto_experts += step_k * tokens
            return
        if per_layer is None or not self.k_spec.adaptive:
            return
        if not self.experts_per_layer:
            self.experts_per_layer = [0] * len(per_layer)
        self.experts_per_layer = [a + b for a, b in zip(self.experts_per_layer, per_layer, strict=True)]

    def experts(self, moe_layers: tuple[int, ...]) -> ExpertCounts | None:
        """What its tokens took so far (None for a model without MoE layers)."""
        if not moe_layers:
            return None
        if self.k_spec.adaptive:
            per_layer = self.experts_per_layer or [0] * len(moe_layers)
        elif self.k_spec.auto:
            per_layer = [self.auto_experts] * len(moe_layers)
        else:
            per_layer = [self.k * self.expert_tokens] * len(moe_layers)
        return ExpertCounts(self.expert_tokens, tuple(zip(moe_layers, per_layer, strict=True)))

    @property
    def block_table(self) -> list[int]:
        """The first group's block table: the only one of a model with one KV group."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def cache_salt(self) -> int:
        """What else than the tokens the cached keys and values depend on: the request's k spec. An "auto"
        sequence's blocks may hold keys computed at several k (k changes between steps): they are shared
        only among "auto" sequences, never with a fixed k or a policy, whose results must not depend on load."""
        return hash(("k", "auto")) if self.k_spec.auto else hash(("k", self.k_spec))

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logits(self) -> bool:
        """Logits at every prompt position (scoring, prompt logprobs): no prefix-cache shortcut then."""
        return self.kind is SequenceKind.SCORE

    @property
    def uses_kv_cache(self) -> bool:
        return self.kind is not SequenceKind.CLASSIFY
