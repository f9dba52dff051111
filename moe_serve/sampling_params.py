"""Per-request generation settings. `verify()` re-checks every engine invariant, so the engine is safe to
call without the HTTP layer; errors name the offending parameter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_serve.errors import ValidationError


def check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    """Raise ValidationError unless `value` is an int (not a bool) in [low, high]."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValidationError(f"{name} must be an integer, got {value!r}", parameter=name, value=value)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValidationError(f"{name} must be {bound}, got {value}", parameter=name, value=value)


def check_experts_per_token(value: Any, min_k: int, max_k: int) -> None:
    check_int("experts_per_token", value, min_k, max_k)


@dataclass(slots=True)
class SamplingParams:
    """Args:
    max_tokens: tokens to generate at most.
    temperature: 0 means greedy.
    top_p, top_k: nucleus and top-k (tokens) filtering; top_k = 0 disables it.
    seed: makes a request's sampled text reproducible, whatever it is batched with.
    stop: strings that end generation; the output is cut before the first occurrence.
    n: completions per prompt.
    logprobs: also return the log-probability of each generated token (and this many alternatives).
    experts_per_token: the request's k (None: the model's default).
    ignore_eos: keep generating past the end-of-text token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    logprobs: int | None = None
    experts_per_token: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.verify()

    def verify(self) -> None:
        check_int("max_tokens", self.max_tokens, 1)
        _check_number("temperature", self.temperature, 0.0, None)
        _check_number("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise ValidationError("top_p must be greater than 0, got 0", parameter="top_p", value=0)
        check_int("top_k", self.top_k, 0)
        check_int("n", self.n, 1, 128)
        if self.seed is not None:
            check_int("seed", self.seed, 0)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, 20)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValidationError("stop must be a list of non-empty strings", parameter="stop", value=self.stop)
        if self.experts_per_token is not None:
            check_int("experts_per_token", self.experts_per_token, 1)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _check_number(name: str, value: Any, low: float, high: float | None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(f"{name} must be a number, got {value!r}", parameter=name, value=value)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValidationError(f"{name} must be {bound}, got {value}", parameter=name, value=value)
