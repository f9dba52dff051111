"""Request and response models, in the OpenAI documentation's field order; moe-serve extensions fenced.

Unknown fields are accepted and logged (clients send many optional OpenAI fields); fields whose
behaviour is not implemented are refused with a 400 that names them rather than silently ignored.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from moe_serve.errors import ValidationError
from moe_serve.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_SEED,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    SamplingParams,
)


def _utf8(value: str) -> str:
    """JSON can carry lone surrogates ("\\ud800") that no tokenizer can encode: refused here, by name."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"is not valid text: a lone surrogate at position {exc.start}") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_utf8)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]], Field(min_length=1)]

logger = logging.getLogger(__name__)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_unknown(self) -> _Request:
        if self.model_extra:
            logger.info("ignoring unknown request fields: %s", ", ".join(sorted(self.model_extra)))
        return self


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Sampling fields; a field left out takes SamplingParams' default (the one place defaults live). The
    ranges are SamplingParams' own (moe_serve.sampling_params), declared here so the schema shows them."""

    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Finite, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[Finite, Field(gt=0, le=1)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: (
        Annotated[NonEmptyText, Field(max_length=MAX_STOP_LENGTH)]
        | Annotated[
            list[Annotated[NonEmptyText, Field(max_length=MAX_STOP_LENGTH)]], Field(max_length=MAX_STOP_STRINGS)
        ]
        | None
    ) = None
    seed: Annotated[StrictInt, Field(ge=0, le=MAX_SEED)] | None = None
    presence_penalty: Finite = 0.0
    frequency_penalty: Finite = 0.0
    user: Text | None = None
    # --- moe-serve extensions (OpenAI clients send them through extra_body) ---
    experts_per_token: Annotated[StrictInt, Field(ge=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_K)] | None = None
    ignore_eos: StrictBool | None = None

    def refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValidationError(f"{name} is not supported by this server; send 0 or leave it out", parameter=name)
        if self.model_extra and "moe" in self.model_extra:
            raise ValidationError(
                "adaptive 'moe' policies are not supported yet; use experts_per_token", parameter="moe"
            )

    def to_sampling_params(self, max_tokens_cap: int, logprobs: int | None = None) -> SamplingParams:
        self.refuse_unsupported()
        if self.max_tokens is not None and self.max_tokens > max_tokens_cap:
            raise ValidationError(
                f"max_tokens must be at most {max_tokens_cap}, got {self.max_tokens}", parameter="max_tokens"
            )
        given = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        if self.stop is not None:
            given["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return SamplingParams(**given, logprobs=logprobs, experts_per_token=self.experts_per_token)


_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "ignore_eos")


class CompletionRequest(_SamplingFields):
    model: Text | None = None
    prompt: Text | list[Text] | TokenIds | list[TokenIds]
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: StrictInt | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise ValidationError("echo is not supported by this server", parameter="echo")
        if self.best_of not in (None, 1):
            raise ValidationError("best_of is not supported by this server (use n)", parameter="best_of")

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValidationError("prompt must not be empty", parameter="prompt")
        if all(isinstance(t, int) for t in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text


class ChatCompletionRequest(_SamplingFields):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None

    def to_sampling_params(self, max_tokens_cap: int, logprobs: int | None = None) -> SamplingParams:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().to_sampling_params(max_tokens_cap, (self.top_logprobs or 0) if self.logprobs else None)


class ClassifyRequest(_Request):
    model: Text | None = None
    input: Text | list[Text]
    experts_per_token: Annotated[StrictInt, Field(ge=1)] | None = None


class ScoreRequest(_Request):
    model: Text | None = None
    input: Text | list[Text]
    experts_per_token: Annotated[StrictInt, Field(ge=1)] | None = None
    return_token_logprobs: StrictBool = False


# ---- responses ----------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    experts_per_token: int | None  # the k used (None: a dense model)
    approximate: bool | None = None  # soft_merge with k < N


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Classification(BaseModel):
    index: int
    label: str
    probs: dict[str, float]


class ClassifyResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[Classification]
    usage: Usage


class Score(BaseModel):
    index: int
    total_logprob: float
    num_tokens: int
    num_bytes: int
    bits_per_byte: float
    token_logprobs: list[float] | None = None


class ScoreResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[Score]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moe-serve"
    task: str
    num_experts: int | None
    experts_per_token: dict[str, int] | None  # {"default", "min", "max"}
    router: str | None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
