"""Request and response models, in the OpenAI documentation's field order; moe-serve extensions fenced.

OpenAI and vLLM fields whose behaviour is not implemented (NOT_IMPLEMENTED) are refused with a 400 that
names them, unless they carry the value that means "off"; never accepted and ignored. Names that neither
API defines are logged and ignored, as vLLM does (clients add their own bookkeeping fields).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_serializer,
    model_validator,
)

from moe_serve.errors import ValidationError
from moe_serve.structured_output import StructuredKind, StructuredOutput

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing.TypeIs from Python 3.13
from moe_serve.moe_policy import MoEPolicy
from moe_serve.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TOKEN_LIST,
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
# A JSON number (an integer is a number: `1` is 1.0), never a string or a boolean: as strict as the int fields.
Finite = Annotated[StrictFloat, Field(allow_inf_nan=False)]
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]], Field(min_length=1)]


def _no_null_tokens(prompt: Any) -> Any:
    """A null in a token-id prompt, named by its place: the union of prompt shapes would otherwise report only
    that the prompt is not a string. lm-evaluation-harness's rolling perplexity sends one as the prefix token
    of a model with neither BOS nor EOS."""
    if not isinstance(prompt, list):
        return prompt
    for i, item in enumerate(prompt):
        places = (
            [(f"prompt[{i}][{j}]", t) for j, t in enumerate(item)]
            if isinstance(item, list)
            else [(f"prompt[{i}]", item)]
        )
        for place, token in places:
            if token is None:
                raise ValueError(
                    f"{place} is null, not a token id (lm-evaluation-harness sends null as the prefix token of a "
                    "model without BOS or EOS: give it custom_prefix_token_id)"
                )
    return prompt


# A request's k: a number of experts, or "auto" (the server picks k under its latency target).
RequestK = Annotated[StrictInt, Field(ge=1)] | Literal["auto"]

logger = logging.getLogger(__name__)

# Per-request bounds on lists whose every item is work before anything is generated: rendering a chat template
# over 20,000 messages took seconds, decoding 200,000 ids delayed other requests by one. A
# conversation or a token list longer than these is refused with a 400 naming the field and the bound.
MAX_MESSAGES = 2048  # chat completions and /tokenize
MAX_DETOKENIZE_TOKENS = 1 << 16  # /detokenize


# Field -> the values that mean "not used" (what this server does anyway). The README's field table
# mirrors this one.
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "length_penalty": (None, 1, 1.0),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "spaces_between_special_tokens": (None, True),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "suffix": (None, ""),
    # vLLM's choice of grammar backend and JSON whitespace: llguidance compiles every grammar here, and JSON is
    # compact (moe_serve.engine.grammar).
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "logits_processors": (None,),
    # Completions take no tools (chat does).
    "tools": (None, []),
    "tool_choice": (None, "none"),
    # OpenAI's deprecated forms of tools and tool_choice.
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    # vLLM's per-request chat template: only the artifact's own template renders here.
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    # Fields of the completions request that chat requests do not implement.
    "best_of": (None, 1),
    "echo": (None, False),
}


def _refuse_not_implemented(fields: dict[str, Any]) -> None:
    for name, value in fields.items():
        # Equal and of the same type: `true` is not 1, `0` is not `false`.
        if name in NOT_IMPLEMENTED and not any(
            type(value) is type(off) and value == off for off in NOT_IMPLEMENTED[name]
        ):
            raise ValidationError(
                f"{name} is not implemented by this server; leave it out (see the README's field table)", parameter=name
            )


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_unknown(self) -> _Request:
        unknown = sorted(set(self.model_extra or ()) - set(NOT_IMPLEMENTED))
        if unknown:
            logger.info("ignoring unknown request fields: %s", ", ".join(unknown))
        return self


class StreamOptions(BaseModel):
    """OpenAI's and vLLM's stream options: include_usage is implemented; vLLM's continuous_usage_stats (usage
    in every chunk) is refused unless false, and an unknown option is refused by name (never ignored)."""

    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False

    @model_validator(mode="after")
    def _refuse_continuous_usage(self) -> StreamOptions:
        if self.continuous_usage_stats:
            raise ValueError(
                "stream_options.continuous_usage_stats is not implemented by this server (usage comes in the "
                "last chunk, with include_usage); leave it out"
            )
        return self


class MoEPolicyRequest(BaseModel):
    """moe-serve's `moe`: an adaptive k policy (moe_serve.moe_policy.MoEPolicy, which checks the same ranges
    and min <= max; errors name `moe.<field>`)."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field would otherwise change nothing, silently

    policy: Literal["top_p"]
    p: Annotated[Finite, Field(gt=0, le=1)]
    min: Annotated[StrictInt, Field(ge=1)] | None = None
    max: Annotated[StrictInt, Field(ge=1)] | None = None

    def to_policy(self) -> MoEPolicy:
        return MoEPolicy(self.policy, self.p, self.min, self.max)


# A function's or a json_schema's name, as OpenAI restricts it.
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]


class JsonSchemaFormat(BaseModel):
    """response_format's json_schema: the schema the reply must validate against (always enforced: strict
    or not, the grammar allows only what the schema does)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: FunctionName
    description: Text | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormatText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]

    def to_structured_output(self) -> list[StructuredOutput]:
        return []


class ResponseFormatJsonObject(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_object"]

    def to_structured_output(self) -> list[StructuredOutput]:
        return [StructuredOutput.json_object("response_format")]


class ResponseFormatJsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat

    def to_structured_output(self) -> list[StructuredOutput]:
        return [StructuredOutput.json_schema(self.json_schema.schema_, "response_format")]


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema, Field(discriminator="type")
]


class StructuredOutputsRequest(BaseModel):
    """vLLM's structured_outputs: exactly one of json (a schema), regex, choice, grammar (Lark or GBNF) and
    json_object. vLLM's other options (whitespace_pattern, structural_tag, backend choices) are refused by
    name: this server's JSON is compact and llguidance compiles every grammar."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)  # refused below, by name

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: StrictBool | None = None

    @model_validator(mode="after")
    def _refuse_other_options(self) -> StructuredOutputsRequest:
        if self.model_extra:
            raise ValueError(
                f"{', '.join(sorted(self.model_extra))}: not implemented by this server (it takes json, regex, "
                "choice, grammar or json_object; its JSON is compact)"
            )
        return self

    def to_structured_output(self) -> StructuredOutput:
        fields: dict[StructuredKind, Any] = {"json": self.json_, "regex": self.regex, "choice": self.choice}
        fields |= {"grammar": self.grammar, "json_object": self.json_object or None}
        given = [
            StructuredOutput.of(kind, value, f"structured_outputs.{kind}")
            for kind, value in fields.items()
            if value is not None
        ]
        if len(given) != 1:
            raise ValidationError(
                "structured_outputs takes exactly one of json, regex, choice, grammar and json_object",
                parameter="structured_outputs",
            )
        return given[0]


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
    user: Text | None = None
    presence_penalty: Annotated[Finite, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = None
    frequency_penalty: Annotated[Finite, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = None
    logit_bias: (
        Annotated[
            dict[
                Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                Annotated[Finite, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)],
            ],
            Field(max_length=MAX_TOKEN_LIST),
        ]
        | None
    ) = None
    # --- vLLM's extensions, and moe-serve's (OpenAI clients send them through extra_body) ---
    experts_per_token: RequestK | None = None
    moe: MoEPolicyRequest | None = None
    top_k: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_K)] | None = None
    min_p: Annotated[Finite, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[Finite, Field(gt=0, le=MAX_REPETITION_PENALTY)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    stop_token_ids: (
        Annotated[list[Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]], Field(max_length=MAX_TOKEN_LIST)] | None
    ) = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    ignore_eos: StrictBool | None = None
    # Structured outputs: OpenAI's response_format; vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    def refuse_unsupported(self) -> None:
        _refuse_not_implemented(self.model_extra or {})

    def structured_output(self) -> StructuredOutput | None:
        """The one constraint the request's fields ask for (None: free text); two of them are a 400."""
        given: list[StructuredOutput] = []
        if self.response_format is not None:
            given += self.response_format.to_structured_output()
        if self.structured_outputs is not None:
            given.append(self.structured_outputs.to_structured_output())
        guided: dict[StructuredKind, Any] = {"json": self.guided_json, "regex": self.guided_regex}
        guided["choice"] = self.guided_choice
        guided["grammar"] = self.guided_grammar
        given += [
            StructuredOutput.of(kind, value, f"guided_{kind}") for kind, value in guided.items() if value is not None
        ]
        if len(given) > 1:
            names = " and ".join(o.parameter for o in given)
            raise ValidationError(f"give one structured output, not several ({names})", parameter=given[1].parameter)
        return given[0] if given else None

    def to_sampling_params(self, max_tokens_cap: int, logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters. `max_tokens: 0` (completions with echo: the prompt is only scored) is
        validated as 1; prepare_completion then generates nothing."""
        self.refuse_unsupported()
        if self.max_tokens is not None and self.max_tokens > max_tokens_cap:
            raise ValidationError(
                f"max_tokens must be at most {max_tokens_cap}, got {self.max_tokens}", parameter="max_tokens"
            )
        given = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        if given.get("max_tokens") == 0:
            given["max_tokens"] = 1
        if self.stop is not None:
            given["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        moe = self.moe.to_policy() if self.moe is not None else None
        return SamplingParams(
            **given,
            logprobs=logprobs,
            experts_per_token=self.experts_per_token,
            moe=moe,
            structured_output=self.structured_output(),
        )


_SAMPLING_FIELDS = (
    "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "ignore_eos", "presence_penalty", "frequency_penalty",
    "logit_bias", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "include_stop_str_in_output",
    "skip_special_tokens",
)  # fmt: skip


class CompletionRequest(_SamplingFields):
    model: Text | None = None
    prompt: Annotated[Text | list[Text] | TokenIds | list[TokenIds], BeforeValidator(_no_null_tokens)]
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None  # 0 only with echo: score the prompt
    echo: StrictBool = False  # the prompt precedes the completion (with its logprobs: None for the first token)
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: StrictInt | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise ValidationError(
                "max_tokens 0 needs echo: true (the prompt scored, nothing generated)", parameter="max_tokens"
            )
        if self.echo and self.stream:
            raise ValidationError("echo is not supported with stream: true", parameter="echo")
        if self.best_of not in (None, 1):
            raise ValidationError("best_of > 1 is not implemented by this server (use n)", parameter="best_of")

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValidationError("prompt must not be empty", parameter="prompt")
        if _is_token_ids(prompt):
            return [list(prompt)]
        return list(prompt)


def _is_token_ids(prompt: list[str] | list[int] | list[list[int]]) -> TypeIs[list[int]]:
    """One token-id prompt, not a batch (each item of a validated prompt list is of the same kind)."""
    return all(isinstance(t, int) for t in prompt)


class TextPart(BaseModel):
    """OpenAI's content part; only text (an image or audio part is refused by its type)."""

    type: Literal["text"]
    text: Text


class ToolCallFunction(BaseModel):
    name: Text
    arguments: Text  # a JSON object, as text (OpenAI's shape)


class ToolCall(BaseModel):
    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[TextPart] | None = None  # None only for an assistant message of tool calls
    name: Text | None = None  # OpenAI's participant name; templates may use it (the bundled LMs' speaker)
    tool_calls: list[ToolCall] | None = None  # an assistant message's calls
    tool_call_id: Text | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may leave it out)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id, the id of the call it answers")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it (transformers' shape): text parts joined by newlines, as
        vLLM does; tool calls with their arguments as objects (templates write them with `tojson`); `name`,
        `tool_calls` and `tool_call_id` only when given, so templates can test for them."""
        content = self.content
        if not isinstance(content, str):
            content = "\n".join(p.text for p in content) if content is not None else ""
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _arguments(c)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(call: ToolCall) -> Any:
    """A call's arguments as an object for the template (as vLLM passes them); text that is not JSON as is."""
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


class FunctionSpec(BaseModel):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (None: any object)
    strict: StrictBool | None = None  # arguments are always held to the schema where a grammar applies


class ToolSpec(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: FunctionName


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


MAX_TOOLS = 128


class ChatCompletionRequest(_SamplingFields):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    tools: list[ToolSpec] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    def to_sampling_params(self, max_tokens_cap: int, logprobs: int | None = None) -> SamplingParams:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().to_sampling_params(max_tokens_cap, (self.top_logprobs or 0) if self.logprobs else None)


class ClassifyRequest(_Request):
    model: Text | None = None
    input: Text | list[Text]
    experts_per_token: RequestK | None = None
    moe: MoEPolicyRequest | None = None


class ScoreRequest(_Request):
    model: Text | None = None
    input: Text | list[Text]
    experts_per_token: RequestK | None = None
    moe: MoEPolicyRequest | None = None
    return_token_logprobs: StrictBool = False


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt as the completions endpoint reads it (BOS added where the model wants it,
    `add_special_tokens: false` leaves it out), or messages rendered by the chat template."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self

    def refuse_unsupported(self) -> None:
        _refuse_not_implemented(self.model_extra or {})  # vLLM's chat_template, tools, ...: not accepted here


class DetokenizeRequest(_Request):
    model: Text | None = None
    tokens: Annotated[list[Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]], Field(max_length=MAX_DETOKENIZE_TOKENS)]


# A request that names a model and a k (what a `name:k<k>` model name applies to), as one type variable: a
# function that resolves one hands back the same request class.
ModelRequest = TypeVar("ModelRequest", bound=CompletionRequest | ChatCompletionRequest | ClassifyRequest | ScoreRequest)


# ---- responses ----------------------------------------------------------------------------------


class LayerExperts(BaseModel):
    layer: int  # the MoE layer's index in the model
    mean: float  # experts per token in that layer


class ExpertsDetails(BaseModel):
    """With a `moe` policy: the policy as resolved against the model, and the mean k of each MoE layer."""

    policy: str
    p: float
    min: int
    max: int
    per_layer: list[LayerExperts]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # completions and chat (OpenAI's shape)
    # The fixed k used (None: a dense model, a `moe` policy, or experts_per_token "auto", whose k the server
    # chose step by step: see experts_per_token_mean).
    experts_per_token: int | None
    approximate: bool | None = None  # k not exact for the method, or never trained at
    # Mean experts per token over the tokens computed and every MoE layer (k for a fixed k; under "auto", the
    # mean of the k each step ran the request's tokens with; None: dense).
    experts_per_token_mean: float | None = None
    experts_per_token_details: ExpertsDetails | None = None  # with a `moe` policy


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing predicts it)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]  # where each token starts in the choice's text


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
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


# ---- streamed chunks (server-sent events) ---------------------------------------------------------


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class ToolCallDelta(ToolCall):
    """A tool call in a stream: each is sent whole, in one chunk (OpenAI's shape, with its index)."""

    index: int


class ChatDelta(BaseModel):
    """What a chunk adds to a choice's message: the role once (the stream's first chunk), then content. An
    absent part is left out of the chunk, as OpenAI's deltas do."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _present_parts(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class StreamChunk(BaseModel):
    """What every chunk of one stream shares; `usage` is carried by the last chunk only, when asked for
    (stream_options.include_usage), and left out of the others."""

    id: str
    object: Literal["text_completion", "chat.completion.chunk"]
    created: int
    model: str
    usage: Usage | None = None

    def wire(self) -> dict[str, Any]:
        """The chunk as sent."""
        return self.model_dump(exclude=None if self.usage is not None else {"usage"})


class CompletionChunk(StreamChunk):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChunkChoice]


class ChatCompletionChunk(StreamChunk):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


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
    parent: str | None = None  # for a `name:k<k>` variant: the model it fixes k of
    task: str
    num_experts: int | None
    experts_per_token: dict[str, int] | None  # {"default", "min", "max"}
    router: str | None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """What lm-evaluation-harness and vLLM's clients read instead of loading the tokenizer locally."""

    model: str
    tokenizer_class: str
    vocab_size: int
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    model_max_length: int
    chat_template: str | None
    chat_stop: list[str]  # what a chat request's `stop` defaults to (moe-serve's extension)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
