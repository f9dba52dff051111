"""Results returned by the offline API (and serialised by the CLI and the HTTP server)."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    experts_per_token: int | None  # None for a dense model
    metrics: RequestMetrics | None = None

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


@dataclass(slots=True)
class ClassificationOutput:
    label: str
    probs: dict[str, float]
    experts_per_token: int | None
    approximate: bool = False  # soft_merge with k < N: a top-k merge, not exact SMEAR


@dataclass(slots=True)
class ScoreOutput:
    total_logprob: float  # natural log
    num_tokens: int  # tokens scored
    num_bytes: int  # UTF-8 bytes those tokens cover
    bits_per_byte: float
    experts_per_token: int | None
    token_logprobs: list[float] | None = field(default=None)
    top_logprobs: list[dict[int, float]] | None = field(default=None)  # per scored token, when asked for
