"""Engine results -> API response bodies (whole responses and streaming chunks), the same for HTTP and
batch files. Every response reports the k it used in `usage` (under a `moe` policy, the mean k and its
per-layer details), and `approximate` where it applies."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from moe_serve.api import protocol as p
from moe_serve.api.prepare import GenerationJob, PoolingJob
from moe_serve.engine.async_engine import SequenceUpdate
from moe_serve.moe_policy import KSpec
from moe_serve.outputs import ClassificationOutput, CompletionOutput, ExpertCounts, RequestOutput, ScoreOutput
from moe_serve.tokenizer import Tokenizer


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    k: int | None,
    approximate: bool | None = None,
    *,
    spec: KSpec | None = None,
    experts: ExpertCounts | None = None,
    cached_tokens: int | None = None,
) -> p.Usage:
    """`spec` and `experts`: the request's k spec and what its tokens took, for the mean k (and, under a
    `moe` policy, the per-layer details). `cached_tokens` (generation only): prompt tokens the prefix cache
    served, reported as OpenAI's `prompt_tokens_details.cached_tokens`."""
    mean = experts.mean if experts is not None else None
    if mean is None and k is not None:
        mean = float(k)  # a fixed k, nothing counted (every token took k)
    details = None
    if spec is not None and spec.top_p is not None and experts is not None:  # adaptive
        details = p.ExpertsDetails(
            policy=spec.policy,
            p=spec.top_p,
            min=spec.lowest,
            max=spec.k,
            per_layer=[p.LayerExperts(layer=layer, mean=m) for layer, m in experts.layer_means().items()],
        )
    return p.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        experts_per_token=k,
        approximate=approximate,
        experts_per_token_mean=mean,
        experts_per_token_details=details,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached_tokens) if cached_tokens is not None else None,
    )


def cached_tokens(results: list[RequestOutput] | None) -> int:
    """Prompt tokens of these requests whose keys and values came from the prefix cache."""
    return sum(r.metrics.cached_tokens for r in results or [] if r.metrics is not None)


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: list[int],
    logprobs: Sequence[float | None],
    tops: Sequence[dict[int, float] | None],
    wanted: int | None,
    offset: int = 0,
) -> p.CompletionLogprobs | None:
    """OpenAI completions `logprobs` (None unless the request asked for them); `offset` is where the first
    token starts in the choice's text (a stream's earlier chunks)."""
    if wanted is None:
        return None

    def alternatives(top: dict[int, float] | None) -> dict[str, float] | None:
        if top is None:
            return None
        out: dict[str, float] = {}
        for token_id, value in top.items():
            text = tokenizer.decode([token_id])
            # Tokens that decode alike (partial UTF-8 bytes) keep their raw token string as the key.
            out[tokenizer.id_to_token(token_id) if text in out or "\ufffd" in text else text] = value
        return out

    tokens = [tokenizer.decode([t]) for t in token_ids]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else []
    return p.CompletionLogprobs(
        tokens=tokens,
        token_logprobs=list(logprobs),
        top_logprobs=[alternatives(top) for top in tops] if wanted else None,
        text_offset=offsets,
    )


def completion_choice(
    tokenizer: Tokenizer,
    job: GenerationJob,
    prompt_token_ids: list[int],
    index: int,
    out: CompletionOutput | None,
    prompt_score: ScoreOutput | None,
) -> p.CompletionChoice:
    """One choice; with echo, the prompt's text and (scored) logprobs come first. `out` is None when
    nothing was generated (echo with max_tokens 0)."""
    text = out.text if out else ""
    ids: list[int] = out.token_ids if out else []
    values: Sequence[float | None] = (out.logprobs or []) if out else []
    tops: Sequence[dict[int, float] | None] = (out.top_logprobs or []) if out else []
    if job.echo:
        text = tokenizer.decode(prompt_token_ids) + text
        if prompt_score is not None:
            ids = prompt_token_ids + ids
            values = [None, *(prompt_score.token_logprobs or []), *values]
            tops = [None, *(prompt_score.top_logprobs or [{}] * (len(prompt_token_ids) - 1)), *tops]
    return p.CompletionChoice(
        index=index,
        text=text,
        logprobs=completion_logprobs(tokenizer, ids, values, tops, job.logprobs),
        finish_reason=out.finish_reason if out else "length",
    )


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float], tops: list[dict[int, float]], wanted: int | None
) -> p.ChatLogprobs | None:
    """OpenAI chat `logprobs.content` (None unless the request asked with `logprobs: true`)."""
    if wanted is None:
        return None

    def entry(token_id: int, value: float) -> p.TopLogprob:
        text = tokenizer.decode([token_id])
        return p.TopLogprob(token=text, logprob=value, bytes=list(text.encode()))

    return p.ChatLogprobs(
        content=[
            p.ChatTokenLogprob(
                **entry(token_id, value).model_dump(),
                top_logprobs=[entry(t, v) for t, v in top.items()] if wanted else [],
            )
            for token_id, value, top in zip(token_ids, logprobs, tops or [{}] * len(token_ids), strict=True)
        ]
    )


def completion_response(
    model: str,
    job: GenerationJob,
    results: list[RequestOutput] | None,
    tokenizer: Tokenizer,
    response_id: str | None = None,
    prompt_scores: list[ScoreOutput] | None = None,
) -> p.CompletionResponse:
    """`results` is None when nothing was generated (echo, max_tokens 0); `prompt_scores` are the echoed
    prompts' logprobs (echo with logprobs)."""
    n = job.params.n
    choices = []
    for prompt_index, request in enumerate(job.requests):
        outputs: list[CompletionOutput | None] = list(results[prompt_index].outputs) if results else [None] * n
        score = prompt_scores[prompt_index] if prompt_scores else None
        for i, out in enumerate(outputs):
            choice = completion_choice(tokenizer, job, request.prompt_token_ids, prompt_index * n + i, out, score)
            choices.append(choice)
    completion_tokens = sum(r.num_generated_tokens for r in results or [])
    # The echoed prompts' scoring ran at the same k spec: its tokens count too.
    experts = ExpertCounts.total([r.experts for r in results or []] + [s.experts for s in prompt_scores or []])
    totals = usage(
        job.prompt_tokens,
        completion_tokens,
        job.reported_k,
        spec=job.k,
        experts=experts,
        cached_tokens=cached_tokens(results),
    )
    body = p.CompletionResponse(model=model, choices=choices, usage=totals)
    if response_id is not None:
        body.id = response_id
    return body


def chat_message(job: GenerationJob, text: str, finish_reason: str | None) -> tuple[p.ChatMessageOut, str | None]:
    """A reply's message and finish reason: with tools, the calls it makes (finish_reason "tool_calls");
    a reply that ended otherwise than "stop" (max_tokens) or holds no call is its text."""
    read = job.tools.read(text) if job.tools is not None and finish_reason == "stop" else None
    if read is None:
        return p.ChatMessageOut(content=text), finish_reason
    content, calls = read
    return p.ChatMessageOut(content=content, tool_calls=calls), "tool_calls"


def chat_response(
    model: str, job: GenerationJob, result: RequestOutput, tokenizer: Tokenizer, response_id: str | None = None
) -> p.ChatCompletionResponse:
    choices = []
    for out in result.outputs:
        message, finish_reason = chat_message(job, out.text, out.finish_reason)
        choices.append(
            p.ChatChoice(
                index=out.index,
                message=message,
                finish_reason=finish_reason,
                logprobs=chat_logprobs(
                    tokenizer, out.token_ids, out.logprobs or [], out.top_logprobs or [], job.logprobs
                ),
            )
        )
    totals = usage(
        job.prompt_tokens,
        result.num_generated_tokens,
        job.reported_k,
        spec=job.k,
        experts=result.experts,
        cached_tokens=cached_tokens([result]),
    )
    body = p.ChatCompletionResponse(model=model, choices=choices, usage=totals)
    if response_id is not None:
        body.id = response_id
    return body


def classify_response(model: str, job: PoolingJob, results: list[ClassificationOutput]) -> p.ClassifyResponse:
    data = [p.Classification(index=i, label=r.label, probs=r.probs) for i, r in enumerate(results)]
    experts = ExpertCounts.total(r.experts for r in results)
    totals = usage(job.prompt_tokens, 0, job.reported_k, job.approximate, spec=job.k, experts=experts)
    return p.ClassifyResponse(model=model, data=data, usage=totals)


def score_response(model: str, job: PoolingJob, results: list[ScoreOutput]) -> p.ScoreResponse:
    data = [
        p.Score(
            index=i,
            total_logprob=r.total_logprob,
            num_tokens=r.num_tokens,
            num_bytes=r.num_bytes,
            bits_per_byte=r.bits_per_byte,
            token_logprobs=r.token_logprobs if job.return_token_logprobs else None,
        )
        for i, r in enumerate(results)
    ]
    experts = ExpertCounts.total(r.experts for r in results)
    totals = usage(job.prompt_tokens, 0, job.reported_k, spec=job.k, experts=experts)
    return p.ScoreResponse(model=model, data=data, usage=totals)


# ---- streaming --------------------------------------------------------------------------------------


def completion_chunk_choice(
    tokenizer: Tokenizer, job: GenerationJob, prompt_index: int, update: SequenceUpdate, offset: int
) -> p.CompletionChunkChoice:
    """`offset`: the length of the text this choice's earlier chunks carried."""
    logprobs = completion_logprobs(
        tokenizer, update.token_ids, update.logprobs, update.top_logprobs, job.logprobs, offset
    )
    return p.CompletionChunkChoice(
        index=prompt_index * job.params.n + update.index,
        text=update.text_delta,
        logprobs=logprobs,
        finish_reason=update.finish_reason,
    )


class ChatChoiceStream:
    """Each streamed chat choice of one request. With tools whose calls are read back, text that is (or may
    become) a tool call is held, not sent: a constrained reply ("required", a named function) whole, an
    "auto" reply from where the model's call marker starts (or may start). When the choice finishes, the
    held text goes out as its tool calls, one chunk with each call whole, or as content if it holds none."""

    def __init__(self, tokenizer: Tokenizer, job: GenerationJob) -> None:
        self.tokenizer = tokenizer
        self.job = job
        self.text: dict[int, str] = {}  # per choice: everything generated so far
        self.sent: dict[int, int] = {}  # ... and how much of it went out as content

    def choice(self, update: SequenceUpdate) -> p.ChatChunkChoice | None:
        """The chunk's choice for an update; None when it has nothing to send yet."""
        job, index = self.job, update.index
        logprobs = chat_logprobs(self.tokenizer, update.token_ids, update.logprobs, update.top_logprobs, job.logprobs)
        if job.tools is None or not job.tools.reads_calls:
            return p.ChatChunkChoice(
                index=index, delta=p.ChatDelta(content=update.text_delta), logprobs=logprobs,
                finish_reason=update.finish_reason,
            )  # fmt: skip
        text = self.text[index] = self.text.get(index, "") + update.text_delta
        sent = self.sent.get(index, 0)
        delta = p.ChatDelta()
        finish_reason = update.finish_reason
        if finish_reason is None:
            upto = self._sendable(text)
            if upto > sent:
                delta.content, self.sent[index] = text[sent:upto], upto
            elif logprobs is None:
                return None
        else:
            message, finish_reason = chat_message(job, text, finish_reason)
            if message.tool_calls:
                delta.tool_calls = [
                    p.ToolCallDelta(index=i, **c.model_dump()) for i, c in enumerate(message.tool_calls)
                ]
            elif len(text) > sent:
                delta.content = text[sent:]
        return p.ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)

    def _sendable(self, text: str) -> int:
        """How much of a running reply can go out as content: none of a constrained one; of an "auto" one,
        what precedes its call marker or any text that may grow into one."""
        tools = self.job.tools
        assert tools is not None
        if tools.format is None:
            return 0
        start = tools.format.start
        found = text.find(start)
        if found >= 0:
            return found
        for keep in range(min(len(start) - 1, len(text)), 0, -1):
            if start.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


def chat_role_choices(n: int) -> list[p.ChatChunkChoice]:
    """The first chunk of a chat stream: each choice's role."""
    return [
        p.ChatChunkChoice(index=i, delta=p.ChatDelta(role="assistant", content=""), finish_reason=None)
        for i in range(n)
    ]


@dataclass(frozen=True, slots=True)
class StreamHeader:
    """What every chunk of one stream shares: its kind, the model as the client named it, one id and one
    created time."""

    kind: Literal["text_completion", "chat.completion.chunk"]
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, model: str, kind: Literal["text_completion", "chat.completion.chunk"]) -> StreamHeader:
        prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
        return cls(kind, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def chunk(
        self, choices: Sequence[p.CompletionChunkChoice | p.ChatChunkChoice], usage: p.Usage | None = None
    ) -> p.StreamChunk:
        chunk_class = p.CompletionChunk if self.kind == "text_completion" else p.ChatCompletionChunk
        fields = {"id": self.id, "created": self.created, "model": self.model, "choices": list(choices)}
        return chunk_class.model_validate({**fields, "usage": usage})  # the choices must be the kind's
