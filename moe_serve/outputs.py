"""Results returned by the offline API (and serialised by the CLI and the HTTP server)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ExpertCounts:
    """Experts the tokens of a result took, summed per MoE layer over the tokens it computed (prompt and
    generated tokens fed back; not those found in the prefix cache). A fixed k counts k per token; under a
    top-p policy each token's own k is counted. Sums, so that results add up (prompts, completions)."""

    tokens: int = 0  # tokens that went through the MoE layers
    per_layer: tuple[tuple[int, int], ...] = ()  # (MoE layer index, experts summed over those tokens)

    @property
    def mean(self) -> float | None:
        """Mean experts per token over every MoE layer (None: nothing computed)."""
        if not self.tokens or not self.per_layer:
            return None
        return sum(n for _, n in self.per_layer) / (self.tokens * len(self.per_layer))

    def layer_means(self) -> dict[int, float]:
        return {layer: n / self.tokens for layer, n in self.per_layer} if self.tokens else {}

    def __add__(self, other: ExpertCounts) -> ExpertCounts:
        if not other.per_layer:
            return self
        if not self.per_layer:
            return other
        merged = tuple((layer, a + b) for (layer, a), (_, b) in zip(self.per_layer, other.per_layer, strict=True))
        return ExpertCounts(self.tokens + other.tokens, merged)

    @classmethod
    def total(cls, counts: Iterable[ExpertCounts | None]) -> ExpertCounts:
        out = cls()
        for c in counts:
            if c is not None:
                out = out + c
        return out


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS or a stop string), "length"
    logprobs: list[float] | None = None  # log-probability of each generated token
    top_logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True)
class SequenceTiming:
    """When one completion was first scheduled and when each of its tokens came (time.monotonic())."""

    first_scheduled_time: float | None
    token_times: list[float]


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    sequences: list[SequenceTiming]  # one per completion
    cached_tokens: int = 0  # of the prompt, whose keys and values came from the prefix cache


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    experts_per_token: int | None  # None for a dense model, or a request with a `moe` policy
    metrics: RequestMetrics | None = None
    experts: ExpertCounts | None = None  # what its tokens took (None for a dense model)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


@dataclass(slots=True)
class ClassificationOutput:
    label: str
    probs: dict[str, float]
    experts_per_token: int | None
    approximate: bool = False  # k not exact for the method (soft_merge below N) or never trained at (validated)
    experts: ExpertCounts | None = None


@dataclass(slots=True)
class ScoreOutput:
    total_logprob: float  # natural log
    num_tokens: int  # tokens scored
    num_bytes: int  # UTF-8 bytes those tokens cover
    bits_per_byte: float
    experts_per_token: int | None
    token_logprobs: list[float] | None = field(default=None)
    top_logprobs: list[dict[int, float]] | None = field(default=None)  # per scored token, when asked for
    experts: ExpertCounts | None = None
