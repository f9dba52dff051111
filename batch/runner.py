"""`moe-serve batch`: a batch file run (or resumed) on the shared runner (moe_serve.batch.core), each result
appended and flushed to the output file as it completes; the ids already in that file are what a rerun
skips."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tqdm.auto import tqdm

from moe_serve.api import protocol as p
from moe_serve.api.errors import ApiError
from moe_serve.batch.core import LineError, PrefillWindow, answer, error_result, run_items
from moe_serve.batch.jsonl import BatchItem, LineResult, append, completed_ids, error_line, read_inputs
from moe_serve.config import EngineConfig, RequestLimits
from moe_serve.engine.async_engine import AsyncEngine
from moe_serve.errors import MoEServeError, ValidationError
from moe_serve.exporters.onnx.cache import load_servable
from moe_serve.registry import bundled_models
from moe_serve.validation import check_int

T = TypeVar("T")


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
    """Each model's serving engine, started once per process (a Ray worker holds its own pool): the
    runner's LineModels for a batch file, where a line names its model by path or bundled name."""

    def __init__(self, engine_config: EngineConfig, limits: RequestLimits | None = None) -> None:
        # Back-pressure comes from the number of items in flight, never from a 429.
        self.engine_config = dataclasses.replace(engine_config, max_waiting=1 << 30)
        self.limits = limits or RequestLimits()
        self.prefill = PrefillWindow()  # its lines' prompt tokens in the engines at once
        self._engines: dict[str, AsyncEngine] = {}

    def get(self, name: str) -> AsyncEngine:
        if name not in self._engines:
            self._engines[name] = AsyncEngine.start(load_servable(name, self.engine_config), self.engine_config)
        return self._engines[name]

    def resolve(self, request: p.ModelRequest, item: BatchItem) -> tuple[str, AsyncEngine, p.ModelRequest]:
        if item.model is None:
            message = "model is required (in the body or with --model)"
            raise LineError(ApiError(400, message, "invalid_request_error", "model"))
        try:
            return item.model, self.get(item.model), request
        except MoEServeError as exc:
            raise LineError(ApiError(404, str(exc), "not_found_error", "model")) from None

    async def prepare(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)

    def close(self) -> None:
        for engine in self._engines.values():
            engine.shutdown()
        self._engines.clear()


def process_chunk(pool: EnginePool, items: list[BatchItem]) -> list[LineResult]:
    """Answer a chunk of items together (the engine batches them), in input order: a Ray worker's unit."""

    async def run() -> list[LineResult]:
        return list(await asyncio.gather(*(answer(pool, item) for item in items)))

    return asyncio.run(run())


ChunkRunner = Callable[[list[list[BatchItem]]], Iterable[list[LineResult]]]


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
    """Run (or resume) a batch file, `chunk_size` items in flight (or in chunks of that size on
    `chunk_runner`). Lines may name `default_model`, `models` and the bundled demos. Returns the summary
    and the result lines written by this run."""
    started = time.monotonic()
    check_int("chunk_size", chunk_size, 1)
    if output_path.is_dir():
        raise ValidationError(f"output {output_path} is a directory; give a file path", parameter="output")
    parsed = read_inputs(input_path, default_model=default_model, ks=ks, allow_label=True)
    done = completed_ids(output_path)
    summary = Summary(lines=parsed.num_lines, duplicates=parsed.duplicates)
    pending = [i for i in parsed.items if i.line_id not in done]
    allowed = {*models, *([default_model] if default_model else []), *bundled_models()}
    refused = [_refused(item, allowed) for item in pending if item.model is not None and item.model not in allowed]
    pending = [i for i in pending if i.model is None or i.model in allowed]
    fresh_errors = [line for line in map(error_line, parsed.problems) if line["id"] not in done]
    summary.skipped = len(parsed.items) - len(pending) - len(refused)
    written: list[dict] = []
    pool = None
    try:
        output_path.parent.mkdir(parents=True, exist_ok=True)
        with (
            open(output_path, "a", encoding="utf-8") as out,
            tqdm(total=len(pending), desc="batch", unit="req", disable=not progress) as bar,
        ):
            for line in fresh_errors + [r.line for r in refused]:
                append(out, line)
                written.append(line)
                summary.errors += 1

            def sink(result: LineResult) -> None:
                append(out, result.line)
                written.append(result.line)
                summary.requests += 1
                summary.errors += not result.is_ok
                summary.prompt_tokens += result.prompt_tokens
                summary.completion_tokens += result.completion_tokens
                bar.update(1)
                rate = (summary.prompt_tokens + summary.completion_tokens) / max(time.monotonic() - started, 1e-9)
                bar.set_postfix(tok_s=f"{rate:.0f}", refresh=False)

            if chunk_runner is not None:
                chunks = [pending[start : start + chunk_size] for start in range(0, len(pending), chunk_size)]
                for results in chunk_runner(chunks):
                    for result in results:
                        sink(result)
            else:
                pool = EnginePool(engine_config or EngineConfig())
                answer_one = lambda item: answer(pool, item)  # noqa: E731
                asyncio.run(run_items(pending, answer_one, sink, window=lambda: chunk_size))
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


def _refused(item: BatchItem, allowed: set[str]) -> LineResult:
    message = (
        f"model {item.model!r} is not available to this batch; lines may name {', '.join(sorted(allowed)) or 'none'} "
        "(the command's --model and --models, and the bundled demos)"
    )
    return error_result(item, ApiError(404, message, "not_found_error", "model"))
