"""Per-request generation settings. `verify()` re-checks every engine invariant, so the engine is safe to
call without the HTTP layer; errors name the offending parameter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_serve.errors import ValidationError
from moe_serve.options import option


def check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    """Raise ValidationError unless `value` is an int (not a bool) in [low, high]."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValidationError(f"{name} must be an integer, got {value!r}", parameter=name, value=value)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValidationError(f"{name} must be {bound}, got {value}", parameter=name, value=value)


@dataclass(slots=True)
class SamplingParams:
    """How one request generates; `verify()` runs on construction. Each field's help is its documentation."""

    max_tokens: int = option(16, "tokens to generate at most")
    temperature: float = option(1.0, "sampling temperature; 0 is greedy")
    top_p: float = option(1.0, "nucleus sampling: keep the smallest set of tokens whose probability reaches top_p")
    top_k: int = option(0, "keep the top_k most likely tokens (0: all)")
    seed: int | None = option(None, "makes the sampled text reproducible, whatever the request is batched with")
    stop: list[str] = option(
        help="a string that ends generation (repeatable); the output is cut before it", factory=list, action="append"
    )
    n: int = option(1, "completions per prompt", flags=("-n",))
    logprobs: int | None = option(None, "also return each generated token's log-probability and this many alternatives")
    experts_per_token: int | None = option(
        None, "the request's k, active experts per token (default: the model's)", flags=("-k",)
    )
    ignore_eos: bool = option(False, "keep generating past the end-of-text token")

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
