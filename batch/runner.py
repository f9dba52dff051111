"""Runs a batch file: every line prepared and answered exactly as over HTTP (moe_serve.api), on the same
serving engine (AsyncEngine, continuous batching), appended line by line so that a rerun resumes."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pydantic
from tqdm.auto import tqdm

from moe_serve.api import protocol as p
from moe_serve.api import responses
from moe_serve.api.errors import ApiError, api_error
from moe_serve.api.prepare import prepare_chat, prepare_completion, prepare_pooling
from moe_serve.batch.jsonl import BatchItem, append, completed_keys, error_key, read_inputs, response_line
from moe_serve.config import EngineConfig, RequestLimits
from moe_serve.engine.async_engine import AsyncEngine
from moe_serve.errors import MoEServeError, ValidationError
from moe_serve.registry import bundled_models
from moe_serve.validation import check_int

REQUEST_MODELS: dict[str, type[pydantic.BaseModel]] = {
    "/v1/completions": p.CompletionRequest,
    "/v1/chat/completions": p.ChatCompletionRequest,
    "/v1/classify": p.ClassifyRequest,
    "/v1/score": p.ScoreRequest,
}


@dataclass(slots=True)
class Summary:
    lines: int = 0
    requests: int = 0
    skipped: int = 0
    errors: int = 0
    duplicates: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0


class EnginePool:
    """Each model's serving engine, started once per process (a Ray worker holds its own pool)."""

    def __init__(self, engine_config: EngineConfig, limits: RequestLimits | None = None) -> None:
        # A chunk is queued whole: back-pressure comes from the chunk size, never from a 429.
        self.engine_config = dataclasses.replace(engine_config, max_waiting=1 << 30)
        self.limits = limits or RequestLimits()
        self._engines: dict[str, AsyncEngine] = {}

    def get(self, name: str) -> AsyncEngine:
        if name not in self._engines:
            self._engines[name] = AsyncEngine.load(name, self.engine_config)
        return self._engines[name]

    def close(self) -> None:
        for engine in self._engines.values():
            engine.shutdown()
        self._engines.clear()


async def answer(pool: EnginePool, item: BatchItem) -> dict:
    """One item's output line: the response body as HTTP would give it, or its error envelope."""
    if item.model is None:
        return _error(
            item, ApiError(400, "model is required (in the body or with --model)", "invalid_request_error", "model")
        )
    try:
        engine = pool.get(item.model)
    except MoEServeError as exc:
        return _error(item, ApiError(404, str(exc), "not_found_error", "model"))
    body = dict(item.body)
    if item.k is not None:
        body["experts_per_token"] = item.k
    try:
        request = REQUEST_MODELS[item.url].model_validate(body)
        return await _run(engine, pool.limits, item, request)
    except (MoEServeError, pydantic.ValidationError) as exc:
        return _error(item, api_error(exc))


async def _run(engine: AsyncEngine, limits: RequestLimits, item: BatchItem, request: pydantic.BaseModel) -> dict:
    name, inputs = item.model or "", engine.inputs
    if isinstance(request, p.CompletionRequest | p.ChatCompletionRequest):
        is_chat = isinstance(request, p.ChatCompletionRequest)
        job = prepare_chat(inputs, request, limits) if is_chat else prepare_completion(inputs, request, limits)  # type: ignore[arg-type]
        results, scores = await job.gather(engine, engine.submit(job.requests) if job.generate else [])
        if is_chat:
            body = responses.chat_response(name, job, results[0], inputs.tokenizer, item.line_id)  # type: ignore[index]
        else:
            body = responses.completion_response(name, job, results, inputs.tokenizer, item.line_id, scores)
        completion_tokens = sum(r.num_generated_tokens for r in results or [])
        return response_line(item, 200, body.model_dump(), job.prompt_tokens, completion_tokens)
    pooled = prepare_pooling(inputs, request, limits)  # type: ignore[arg-type]
    if pooled.kind == "classify":
        data = responses.classify_response(name, pooled, await engine.classify(pooled.token_ids, pooled.k))
    else:
        data = responses.score_response(
            name, pooled, await engine.score(pooled.token_ids, pooled.k, pooled.return_token_logprobs)
        )
    return response_line(item, 200, data.model_dump(), pooled.prompt_tokens, 0)


def _error(item: BatchItem, error: ApiError) -> dict:
    return response_line(item, error.status, error.body())


def process_chunk(pool: EnginePool, items: list[BatchItem]) -> list[dict]:
    """Answer a chunk of items together (the engine batches them), in input order."""

    async def run() -> list[dict]:
        return list(await asyncio.gather(*(answer(pool, item) for item in items)))

    return asyncio.run(run())


ChunkRunner = Callable[[list[list[BatchItem]]], Iterable[list[dict]]]


def run_batch(
    input_path: Path,
    output_path: Path,
    *,
    default_model: str | None = None,
    models: tuple[str, ...] = (),
    ks: list[int] | None = None,
    engine_config: EngineConfig | None = None,
    chunk_size: int = 64,
    progress: bool = True,
    chunk_runner: ChunkRunner | None = None,
) -> tuple[Summary, list[dict]]:
    """Run (or resume) a batch file. Lines may name `default_model`, `models` and the bundled demos.
    Returns the summary and the result lines written by this run."""
    started = time.monotonic()
    check_int("chunk_size", chunk_size, 1)
    if output_path.is_dir():
        raise ValidationError(f"output {output_path} is a directory; give a file path", parameter="output")
    items, error_lines, duplicates = read_inputs(input_path, default_model, ks)
    done = completed_keys(output_path)
    summary = Summary(lines=len({i.line for i in items}) + len(error_lines), duplicates=duplicates)
    pending = [i for i in items if i.key not in done]
    allowed = {*models, *([default_model] if default_model else []), *bundled_models()}
    refused = [_refused(item, allowed) for item in pending if item.model is not None and item.model not in allowed]
    pending = [i for i in pending if i.model is None or i.model in allowed]
    fresh_errors = [e for e in error_lines if error_key(e["error"]["line"]) not in done]
    summary.skipped = len(items) - len(pending) - len(refused)
    chunks = [pending[start : start + chunk_size] for start in range(0, len(pending), chunk_size)]
    pool = None
    if chunk_runner is None:
        pool = EnginePool(engine_config or EngineConfig())
        chunk_runner = lambda chunks_: (process_chunk(pool, c) for c in chunks_)  # noqa: E731
    written: list[dict] = []
    try:
        output_path.parent.mkdir(parents=True, exist_ok=True)
        with (
            open(output_path, "a", encoding="utf-8") as out,
            tqdm(total=len(pending), desc="batch", unit="req", disable=not progress) as bar,
        ):
            for line in fresh_errors + refused:
                line.pop("_tokens", None)
                append(out, line)
                summary.errors += 1
                written.append(line)
            for lines in chunk_runner(chunks):
                for line in lines:
                    prompt_tokens, completion_tokens = line.pop("_tokens", (0, 0))
                    summary.prompt_tokens += prompt_tokens
                    summary.completion_tokens += completion_tokens
                    summary.errors += line["response"]["status_code"] != 200
                    append(out, line)
                    written.append(line)
                summary.requests += len(lines)
                bar.update(len(lines))
                rate = (summary.prompt_tokens + summary.completion_tokens) / max(time.monotonic() - started, 1e-9)
                bar.set_postfix(tok_s=f"{rate:.0f}")
    except OSError as exc:  # a full disk, a read-only file system, no permission: what is written stays
        raise MoEServeError(
            f"cannot write {output_path}: {exc.strerror or exc} ({len(written)} result lines written by this run; "
            "a rerun resumes after them)"
        ) from None
    finally:
        if pool is not None:
            pool.close()
    summary.seconds = time.monotonic() - started
    return summary, written


def _refused(item: BatchItem, allowed: set[str]) -> dict:
    message = (
        f"model {item.model!r} is not available to this batch; lines may name {', '.join(sorted(allowed)) or 'none'} "
        "(the command's --model and --models, and the bundled demos)"
    )
    return _error(item, ApiError(404, message, "not_found_error", "model"))
