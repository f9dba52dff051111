"""The serving loop: one engine thread per model steps the LLMEngine while asyncio callers submit
requests, stream their tokens, and cancel them. Classification and scoring requests that arrive
together are batched into one forward.

Thread model: only the engine thread touches the LLMEngine's state (requests reach it through a
locked inbox); results go back to each caller's asyncio queue with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from moe_serve.artifact import Artifact, load_artifact
from moe_serve.config import EngineConfig
from moe_serve.engine import pooling
from moe_serve.engine.expert_load import ExpertLoad
from moe_serve.engine.inputs import GenerationRequest, InputProcessor
from moe_serve.engine.llm_engine import LLMEngine
from moe_serve.engine.sequence import Sequence
from moe_serve.errors import EngineOverloadedError, EngineStoppedError
from moe_serve.outputs import (
    ClassificationOutput,
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    ScoreOutput,
    SequenceTiming,
)
from moe_serve.registry import resolve_model

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SequenceUpdate:
    """What one completion gained in a step: a text delta and the new tokens (streaming unit)."""

    index: int
    text_delta: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None


@dataclass(slots=True)
class RequestUpdate:
    request_id: str
    updates: list[SequenceUpdate]
    finished: bool
    metrics: RequestMetrics | None = None  # timings, once finished


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    seqs: list[Sequence]
    sent_chars: list[int]
    sent_tokens: list[int]
    reported_finish: list[bool]


@dataclass(slots=True)
class _PoolingJob:
    kind: str  # classify | score
    token_ids: list[list[int]]
    ks: list[int]
    keep_token_logprobs: bool
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class AsyncEngine:
    """What a server needs from one model: validated inputs (`inputs`), streaming generation,
    classification and scoring, queue and cache figures, expert load, drain and shutdown."""

    def __init__(self, engine: LLMEngine, *, track_expert_load: bool = False) -> None:
        self.engine = engine
        self.max_waiting = engine.config.max_waiting
        self.expert_load = ExpertLoad(engine.artifact.model) if track_expert_load and engine.model_config.moe else None
        self._lock = threading.Condition()
        self._inbox: list[tuple[str, GenerationRequest, _Stream]] = []
        self._aborts: list[str] = []
        self._jobs: list[_PoolingJob] = []
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._exit = False
        self._thread = threading.Thread(target=self._run, name=f"engine-{engine.artifact.name}", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, model: str, config: EngineConfig, *, track_expert_load: bool = False) -> AsyncEngine:
        """Load an artifact (a directory or a bundled name) and start its engine thread."""
        device = config.torch_device()
        artifact = load_artifact(
            resolve_model(model), device=device, dtype=config.torch_dtype(), verify_checksums=config.verify_checksums
        )
        return cls(LLMEngine(artifact, config, device), track_expert_load=track_expert_load)

    @property
    def artifact(self) -> Artifact:
        return self.engine.artifact

    # ---- state seen by the server ---------------------------------------------------------------

    @property
    def inputs(self) -> InputProcessor:
        return self.engine.inputs

    @property
    def kv_cache_usage(self) -> float:
        """KV-cache tokens reserved by running sequences, as a share of the budget."""
        return self.engine.num_reserved_tokens / self.engine.kv_cache_tokens

    @property
    def num_running(self) -> int:
        return len(self.engine.running)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.waiting) + len(self._inbox)

    @property
    def num_requests(self) -> int:
        """Requests not finished yet (streams and pooling jobs)."""
        return len(self._streams) + len(self._inbox) + len(self._jobs)

    def new_request_id(self) -> str:
        return f"{self.engine.artifact.name}-{next(self._ids)}"

    # ---- generation -----------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest, request_id: str | None = None) -> AsyncIterator[RequestUpdate]:
        """Stream a request's updates; leaving the iteration early (client gone) aborts it at once."""
        request_id = request_id or self.new_request_id()
        n = request.params.n
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop(), [], [0] * n, [0] * n, [False] * n)
        with self._lock:
            self._admit_check()
            self._inbox.append((request_id, request, stream))
            self._streams[request_id] = stream
            self._lock.notify()
        finished = False
        try:
            while True:
                update = await stream.queue.get()
                if isinstance(update, BaseException):
                    raise update
                yield update
                if update.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def generate_final(self, request: GenerationRequest, request_id: str | None = None) -> RequestOutput:
        """Run a request to completion and return all its completions at once."""
        n = request.params.n
        outputs = [CompletionOutput(i, "", [], None, [], []) for i in range(n)]
        metrics = None
        async for update in self.generate(request, request_id):
            for u in update.updates:
                out = outputs[u.index]
                out.text += u.text_delta
                out.token_ids += u.token_ids
                out.logprobs += u.logprobs  # type: ignore[operator]  # lists, set above
                out.top_logprobs += u.top_logprobs  # type: ignore[operator]
                out.finish_reason = u.finish_reason or out.finish_reason
            if update.finished:
                metrics = update.metrics
        reported_k = self.engine.model_config.reported_k(request.k)
        return RequestOutput(request_id or "", None, request.prompt_token_ids, outputs, reported_k, metrics)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
            self._lock.notify()

    # ---- classification and scoring -------------------------------------------------------------

    async def classify(self, token_ids: list[list[int]], ks: list[int]) -> list[ClassificationOutput]:
        return await self._pool("classify", token_ids, ks, False)

    async def score(
        self, token_ids: list[list[int]], ks: list[int], keep_token_logprobs: bool = False
    ) -> list[ScoreOutput]:
        return await self._pool("score", token_ids, ks, keep_token_logprobs)

    async def _pool(self, kind: str, token_ids: list[list[int]], ks: list[int], keep: bool) -> Any:
        loop = asyncio.get_running_loop()
        job = _PoolingJob(kind, token_ids, ks, keep, loop.create_future(), loop)
        with self._lock:
            self._admit_check()
            self._jobs.append(job)
            self._lock.notify()
        return await job.future

    # ---- lifecycle ------------------------------------------------------------------------------

    def _admit_check(self) -> None:
        if self._stopping:
            raise EngineStoppedError("the server is shutting down")
        if self.num_waiting + len(self._jobs) >= self.max_waiting:
            raise EngineOverloadedError(
                f"{self.num_waiting + len(self._jobs)} requests are waiting (limit {self.max_waiting})"
            )

    async def drain(self, timeout: float = 30.0) -> None:
        """Refuse new requests and wait until those in flight are done."""
        with self._lock:
            self._stopping = True
        deadline = time.monotonic() + timeout
        while self.num_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._exit = True
            self._lock.notify()
        self._thread.join(timeout=10)

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._inbox or self._aborts or self._jobs or self.engine.has_unfinished() or self._exit):
                    self._lock.wait()
                if self._exit:
                    return
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                jobs, self._jobs = self._jobs, []
            for request_id in aborts:
                self.engine.abort(request_id)
                self._streams.pop(request_id, None)
            for request_id, request, stream in inbox:
                try:
                    stream.seqs = self.engine.add_request(request_id, request)
                except Exception as exc:  # validated already; anything else still reaches the caller
                    self._streams.pop(request_id, None)
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
            if jobs:
                self._run_pooling(jobs)
            if self.engine.has_unfinished():
                try:
                    stepped = self.engine.step()
                except Exception as exc:
                    logger.exception("engine step failed; failing the running requests")
                    self._fail_all(exc)
                    continue
                self._publish(stepped)
                if self.expert_load is not None:
                    self.expert_load.collect()

    def _run_pooling(self, jobs: list[_PoolingJob]) -> None:
        """All classify jobs in one batched call, all score jobs in another."""
        runner, batch_size = self.engine.runner, self.engine.config.max_num_seqs
        for kind in ("classify", "score"):
            batch = [j for j in jobs if j.kind == kind]
            if not batch:
                continue
            token_ids = [ids for j in batch for ids in j.token_ids]
            ks = [k for j in batch for k in j.ks]
            try:
                if kind == "classify":
                    results: list[Any] = pooling.classify(runner, token_ids, ks, batch_size)
                else:
                    keep = any(j.keep_token_logprobs for j in batch)
                    results = pooling.score(runner, self.engine.tokenizer, token_ids, ks, batch_size, keep)
            except Exception as exc:
                logger.exception("%s batch failed", kind)
                for j in batch:
                    j.loop.call_soon_threadsafe(_set_exception, j.future, exc)
                continue
            start = 0
            for j in batch:
                part = results[start : start + len(j.token_ids)]
                start += len(j.token_ids)
                if kind == "score" and not j.keep_token_logprobs:
                    for out in part:
                        out.token_logprobs = None
                j.loop.call_soon_threadsafe(_set_result, j.future, part)
        if self.expert_load is not None:
            self.expert_load.collect()

    def _publish(self, stepped: list[Sequence]) -> None:
        touched = {s.request_id for s in stepped}
        for request_id in touched:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            updates = []
            for index, seq in enumerate(stream.seqs):
                update = self._delta(stream, index, seq)
                if update is not None:
                    updates.append(update)
            finished = all(s.is_finished for s in stream.seqs)
            if finished:
                self._streams.pop(request_id, None)
            if updates or finished:
                metrics = _request_metrics(stream.seqs) if finished else None
                message = RequestUpdate(request_id, updates, finished, metrics)
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, message)

    @staticmethod
    def _delta(stream: _Stream, index: int, seq: Sequence) -> SequenceUpdate | None:
        if stream.reported_finish[index]:
            return None
        text = seq.text
        if not seq.is_finished:
            # Hold back what a stop string or an unfinished UTF-8 character may still change.
            hold = max((len(s) - 1 for s in seq.params.stop), default=0)
            safe = len(text) - hold
            while safe > 0 and text[safe - 1] == "\ufffd":
                safe -= 1
            text = text[: max(safe, stream.sent_chars[index])]
        start = stream.sent_tokens[index]
        delta = text[stream.sent_chars[index] :]
        if not delta and start == len(seq.output_token_ids) and not seq.is_finished:
            return None
        stream.sent_chars[index] = len(text)
        stream.sent_tokens[index] = len(seq.output_token_ids)
        stream.reported_finish[index] = seq.is_finished
        return SequenceUpdate(
            index=index,
            text_delta=delta,
            token_ids=seq.output_token_ids[start:],
            logprobs=seq.output_logprobs[start:],
            top_logprobs=seq.top_logprobs[start:],
            finish_reason=seq.finish_reason if seq.is_finished else None,
        )

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
        self._streams.clear()


def _request_metrics(seqs: list[Sequence]) -> RequestMetrics:
    timings = [SequenceTiming(s.first_scheduled_time, list(s.token_times)) for s in seqs]
    return RequestMetrics(seqs[0].arrival_time, timings)


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
