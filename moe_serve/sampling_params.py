"""Per-request generation settings. `verify()` re-checks every engine invariant, so the engine is safe to
call without the HTTP layer; errors name the offending parameter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from moe_serve.errors import ValidationError
from moe_serve.moe_policy import AUTO, MoEPolicy
from moe_serve.options import option
from moe_serve.structured_output import StructuredOutput
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
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's range, [-2, 2]
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's range, [-100, 100]
MAX_TOKEN_LIST = 1024  # logit_bias entries, stop_token_ids


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
    experts_per_token: int | str | None = option(
        None,
        'the request\'s k, active experts per token, or "auto" (the server picks k under its --target-itl-ms) '
        "(default: the model's)",
        flags=("-k",),
        type="k",
    )
    moe: MoEPolicy | None = option(
        None, "an adaptive k policy instead of experts_per_token: MoEPolicy or {'policy': 'top_p', 'p': ...}", cli=False
    )
    ignore_eos: bool = option(False, "keep generating past the end-of-text token")
    presence_penalty: float = option(0.0, "subtract this from the logit of every token already generated (-2..2)")
    frequency_penalty: float = option(0.0, "subtract this times its count from each generated token's logit (-2..2)")
    repetition_penalty: float = option(
        1.0, "divide positive logits (multiply negative ones) of prompt and generated tokens by this (1: off)"
    )
    min_p: float = option(0.0, "drop tokens less likely than min_p times the most likely one (0: off)")
    logit_bias: dict[int, float] = option(
        help="token id -> a bias added to its logit (-100..100)", factory=dict, cli=False
    )
    min_tokens: int = option(0, "generate at least this many tokens before EOS or stop_token_ids can end it")
    stop_token_ids: list[int] = option(help="token ids that end generation, like EOS", factory=list, cli=False)
    include_stop_str_in_output: bool = option(False, "keep the stop string that ended the text in the output")
    skip_special_tokens: bool = option(True, "leave special tokens out of the output text")
    structured_output: StructuredOutput | None = option(
        None, "the constraint the generated text must satisfy (a JSON schema, a regex, choices, a grammar)", cli=False
    )

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.logit_bias, dict):  # JSON keys are strings: {"50256": -100}
            # Still unchecked: a key that is not a decimal string stays as it is, and verify() refuses it.
            self.logit_bias = cast(dict[int, float], {_token_key(k): v for k, v in self.logit_bias.items()})
        self.moe = MoEPolicy.of(self.moe)  # a mapping from JSON or Python; checked as it is built
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
        if self.experts_per_token is not None and self.experts_per_token != AUTO:
            check_int("experts_per_token", self.experts_per_token, 1)
        if self.moe is not None and not isinstance(self.moe, MoEPolicy):
            raise ValidationError("moe must be a MoEPolicy", parameter="moe")
        if self.moe is not None and self.experts_per_token is not None:
            auto = self.experts_per_token == AUTO
            what = 'experts_per_token "auto" (the server picks k)' if auto else "experts_per_token (a fixed k)"
            raise ValidationError(
                f"give either {what} or moe (a policy choosing k per token), not both", parameter="moe"
            )
        check_number("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        check_number("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        check_number("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY)
        if self.repetition_penalty == 0:
            raise ValidationError("repetition_penalty must be greater than 0, got 0", parameter="repetition_penalty")
        check_number("min_p", self.min_p, 0.0, 1.0)
        check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        for name in ("include_stop_str_in_output", "skip_special_tokens", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise ValidationError(f"{name} must be true or false", parameter=name)
        self._verify_token_lists()
        self._verify_structured_output()

    def _verify_structured_output(self) -> None:
        """The grammar decides where a structured output ends: settings that would overrule it are refused."""
        output = self.structured_output
        if output is None:
            return
        if not isinstance(output, StructuredOutput):
            raise ValidationError("structured_output must be a StructuredOutput", parameter="structured_output")
        for name, value, off in (("ignore_eos", self.ignore_eos, False), ("min_tokens", self.min_tokens, 0)):
            if value != off:
                raise ValidationError(
                    f"{name} cannot be combined with {output.parameter}: the grammar decides where the output ends",
                    parameter=name,
                )

    def _verify_token_lists(self) -> None:
        """Types and sizes here; that the ids exist in the vocabulary is the engine's check (it knows it)."""
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_TOKEN_LIST:
            raise ValidationError(
                f"logit_bias must map at most {MAX_TOKEN_LIST} token ids to biases", parameter="logit_bias"
            )
        for token_id, bias in self.logit_bias.items():
            check_int("logit_bias", token_id, 0, 2**31 - 1)
            check_number("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > MAX_TOKEN_LIST:
            raise ValidationError(f"stop_token_ids takes at most {MAX_TOKEN_LIST} ids", parameter="stop_token_ids")
        for token_id in self.stop_token_ids:
            check_int("stop_token_ids", token_id, 0, 2**31 - 1)

    @property
    def adjusts_logits(self) -> bool:
        """Whether sampling must change this row's logits before choosing (greedy rows included)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _token_key(key: object) -> object:
    """ "50256" -> 50256 (left as it is when not a decimal string: verify() then names logit_bias)."""
    return int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 11 else key
