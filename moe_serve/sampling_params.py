"""Per-request generation settings. `verify()` re-checks every engine invariant, so the engine is safe to
call without the HTTP layer; errors name the offending parameter."""

from __future__ import annotations

from dataclasses import dataclass

from moe_serve.errors import ValidationError
from moe_serve.options import option
from moe_serve.validation import check_int, check_number

# The range of every field, checked here (the engine's own invariants: SamplingParams is safe to build
# without the HTTP layer) and declared from these same constants in the HTTP schema (moe_serve.api.protocol).
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**63 - 1  # + n - 1 must still fit torch's generator seed (below 2**64)
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 512


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
        check_number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        check_number("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise ValidationError("top_p must be greater than 0, got 0", parameter="top_p", value=0)
        check_int("top_k", self.top_k, 0, MAX_TOP_K)
        check_int("n", self.n, 1, MAX_N)
        if self.seed is not None:
            check_int("seed", self.seed, 0, MAX_SEED)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValidationError("stop must be a list of non-empty strings", parameter="stop", value=self.stop)
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise ValidationError(
                f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters",
                parameter="stop",
            )
        if self.experts_per_token is not None:
            check_int("experts_per_token", self.experts_per_token, 1)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
