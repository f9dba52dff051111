"""Engine results -> API response bodies (whole responses and streaming chunks), the same for HTTP and
batch files. Every response reports the k it used in `usage`, and `approximate` where it applies."""

from __future__ import annotations

import time
import uuid
from typing import Any

from moe_serve.api import protocol as p
from moe_serve.api.prepare import GenerationJob, PoolingJob
from moe_serve.engine.async_engine import SequenceUpdate
from moe_serve.outputs import ClassificationOutput, RequestOutput, ScoreOutput
from moe_serve.tokenizer import Tokenizer


def usage(prompt_tokens: int, completion_tokens: int, k: int | None, approximate: bool | None = None) -> p.Usage:
    return p.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        experts_per_token=k,
        approximate=approximate,
    )


def completion_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float], tops: list[dict[int, float]], wanted: int | None
) -> p.CompletionLogprobs | None:
    """OpenAI completions `logprobs` (None unless the request asked for them)."""
    if wanted is None:
        return None

    def alternatives(top: dict[int, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for token_id, value in top.items():
            text = tokenizer.decode([token_id])
            # Tokens that decode alike (partial UTF-8 bytes) keep their raw token string as the key.
            out[tokenizer.id_to_token(token_id) if text in out or "\ufffd" in text else text] = value
        return out

    return p.CompletionLogprobs(
        tokens=[tokenizer.decode([t]) for t in token_ids],
        token_logprobs=logprobs,
        top_logprobs=[alternatives(top) for top in tops] if wanted else None,
    )


def completion_response(
    model: str, job: GenerationJob, results: list[RequestOutput], tokenizer: Tokenizer, response_id: str | None = None
) -> p.CompletionResponse:
    n = job.params.n
    choices = [
        p.CompletionChoice(
            index=prompt_index * n + out.index,
            text=out.text,
            logprobs=completion_logprobs(
                tokenizer, out.token_ids, out.logprobs or [], out.top_logprobs or [], job.logprobs
            ),
            finish_reason=out.finish_reason,
        )
        for prompt_index, result in enumerate(results)
        for out in result.outputs
    ]
    completion_tokens = sum(r.num_generated_tokens for r in results)
    body = p.CompletionResponse(
        model=model, choices=choices, usage=usage(job.prompt_tokens, completion_tokens, job.reported_k)
    )
    if response_id is not None:
        body.id = response_id
    return body


def chat_response(
    model: str, job: GenerationJob, result: RequestOutput, response_id: str | None = None
) -> p.ChatCompletionResponse:
    choices = [
        p.ChatChoice(index=out.index, message=p.ChatMessageOut(content=out.text), finish_reason=out.finish_reason)
        for out in result.outputs
    ]
    totals = usage(job.prompt_tokens, result.num_generated_tokens, job.reported_k)
    body = p.ChatCompletionResponse(model=model, choices=choices, usage=totals)
    if response_id is not None:
        body.id = response_id
    return body


def classify_response(model: str, job: PoolingJob, results: list[ClassificationOutput]) -> p.ClassifyResponse:
    data = [p.Classification(index=i, label=r.label, probs=r.probs) for i, r in enumerate(results)]
    return p.ClassifyResponse(
        model=model, data=data, usage=usage(job.prompt_tokens, 0, job.reported_k, job.approximate)
    )


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
    return p.ScoreResponse(model=model, data=data, usage=usage(job.prompt_tokens, 0, job.reported_k))


# ---- streaming --------------------------------------------------------------------------------------


def completion_chunk_choice(
    tokenizer: Tokenizer, job: GenerationJob, prompt_index: int, update: SequenceUpdate
) -> dict:
    logprobs = completion_logprobs(tokenizer, update.token_ids, update.logprobs, update.top_logprobs, job.logprobs)
    return {
        "index": prompt_index * job.params.n + update.index,
        "text": update.text_delta,
        "logprobs": logprobs.model_dump() if logprobs else None,
        "finish_reason": update.finish_reason,
    }


def chat_chunk_choice(update: SequenceUpdate) -> dict:
    return {"index": update.index, "delta": {"content": update.text_delta}, "finish_reason": update.finish_reason}


def chat_role_choices(n: int) -> list[dict]:
    """The first chunk of a chat stream: each choice's role."""
    return [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None} for i in range(n)]


def chunk_header(model: str, kind: str) -> dict[str, Any]:
    """The fields every chunk of one stream shares; kind is "text_completion" or "chat.completion.chunk"."""
    prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model}
