"""The serving loop: one engine thread per model steps the LLMEngine while asyncio callers submit
requests (generation, scoring, classification), stream their results, and cancel them.

Thread model: only the engine thread touches the LLMEngine's state (requests reach it through a locked
inbox); results go back to each caller's asyncio queue with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moe_serve.config import EngineConfig
from moe_serve.engine import pooling
from moe_serve.engine.backend import engine_device
from moe_serve.engine.expert_load import ExpertLoad
from moe_serve.engine.inputs import GenerationRequest, InputProcessor
from moe_serve.engine.llm_engine import LLMEngine
from moe_serve.engine.runner import LoadedModel
from moe_serve.engine.sequence import Sequence, SequenceKind, WorkGroup
from moe_serve.errors import EngineOverloadedError, EngineStoppedError, ValidationError
from moe_serve.moe_policy import KSpec
from moe_serve.outputs import (
    ClassificationOutput,
    CompletionOutput,
    ExpertCounts,
    RequestMetrics,
    RequestOutput,
    ScoreOutput,
    SequenceTiming,
)

logger = logging.getLogger(__name__)

SWITCH_INTERVAL = 0.001  # seconds: the GIL switch interval while an engine thread runs (AsyncEngine.__init__)


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
    experts: ExpertCounts | None = None  # experts its tokens took (all completions), once finished


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    seqs: list[Sequence] = field(default_factory=list)
    sent_chars: list[int] = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)
    reported_finish: list[bool] = field(default_factory=list)

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass(slots=True)
class _Submission:
    request_id: str
    stream: _Stream
    request: GenerationRequest | None = None  # generation
    token_ids: list[list[int]] | None = None  # scoring or classification
    k: int | KSpec = 0
    kind: SequenceKind = SequenceKind.GENERATE
    top_logprobs: int = 0  # scoring: alternatives per position
    group: WorkGroup | None = None  # the work its prompts count with (engine.sequence.WorkGroup)

    @property
    def num_sequences(self) -> int:
        return self.request.params.n if self.request is not None else len(self.token_ids or ())


class GenerationStream:
    """One admitted generation request. Iterate it for its updates; closing it early, or dropping it without
    reading it to the end, aborts the request in the engine."""

    def __init__(self, engine: AsyncEngine, submission: _Submission) -> None:
        self._engine = engine
        self._submission = submission
        self._done = False
        # Called with each update's count of new tokens as it is read (the server's token counter).
        self.on_tokens: Callable[[int], None] | None = None

    @property
    def request(self) -> GenerationRequest:
        assert self._submission.request is not None
        return self._submission.request

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> RequestUpdate:
        if self._done:
            raise StopAsyncIteration
        try:
            update = await self._submission.stream.queue.get()
        except BaseException:
            self.abort()  # cancelled: the client is gone
            raise
        if isinstance(update, BaseException):
            self._done = True
            raise update
        self._done = update.finished
        if self.on_tokens is not None:
            self.on_tokens(sum(len(u.token_ids) for u in update.updates))
        return update

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self._submission.request_id)

    def __del__(self) -> None:  # never read (the response never started): the engine stops its work
        try:
            self.abort()
        except Exception:  # noqa: BLE001  # interpreter shutdown
            pass

    async def final(self) -> RequestOutput:
        """Read the stream to its end: every completion, whole."""
        request = self.request
        outputs = [CompletionOutput(i, "", [], None, [], []) for i in range(request.params.n)]
        metrics = experts = None
        async for update in self:
            for u in update.updates:
                out = outputs[u.index]
                out.text += u.text_delta
                out.token_ids += u.token_ids
                out.logprobs += u.logprobs  # type: ignore[operator]  # lists, set above
                out.top_logprobs += u.top_logprobs  # type: ignore[operator]
                out.finish_reason = u.finish_reason or out.finish_reason
            if update.finished:
                metrics, experts = update.metrics, update.experts
        reported_k = self._engine.engine.model_config.reported_k(request.k)
        return RequestOutput(
            self._submission.request_id, None, request.prompt_token_ids, outputs, reported_k, metrics, experts
        )


class AsyncEngine:
    """What a server needs from one model: validated inputs (`inputs`), streaming generation,
    classification and scoring, queue and cache figures, expert load, shutdown."""

    def __init__(self, engine: LLMEngine, *, track_expert_load: bool = False) -> None:
        self.engine = engine
        self.max_waiting = engine.config.max_waiting
        self.expert_load = ExpertLoad(engine.runner) if track_expert_load and engine.model_config.moe else None
        self._lock = threading.Condition()
        self._inbox: list[_Submission] = []
        self._aborts: list[str] = []
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._exit = False
        # Waiting sequences of long work in the scheduler's queue, as the engine thread last counted them (it
        # alone reads the queue); short and long work are each held to max_waiting, so that one client's heavy
        # work filling the queue never makes another's short request a 429.
        self._waiting_long = 0
        self._threshold = engine.config.long_prefill_threshold
        # The engine thread shares the GIL with the serving threads (the event loop, request preparation), and
        # each of its tensor ops gives the GIL up and must win it back: beside a thread running Python, every
        # op can wait a whole switch interval. 1 ms instead of Python's 5 (process-wide, only ever lowered):
        # a step of 20 ops took 136 ms beside a thread tokenizing per text at 5 ms, 33 ms at 1 ms, 5 ms alone
        # (benchmarks/gil_contention.py).
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
        self._thread = threading.Thread(target=self._run, name=f"engine-{engine.artifact.name}", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, model: LoadedModel, config: EngineConfig, *, track_expert_load: bool = False) -> AsyncEngine:
        """An engine for a model loaded for `config`'s backend (the front ends load with
        moe_serve.exporters.onnx.load_servable), its thread started."""
        engine = LLMEngine(model, config, engine_device(config))
        return cls(engine, track_expert_load=track_expert_load)

    @property
    def artifact(self) -> LoadedModel:
        return self.engine.artifact

    # ---- state seen by the server ---------------------------------------------------------------

    @property
    def inputs(self) -> InputProcessor:
        return self.engine.inputs

    @property
    def kv_cache_usage(self) -> float:
        return self.engine.kv_cache_usage

    @property
    def kv_cache_bytes(self) -> tuple[int, int]:
        """(allocated, in use by sequences): the pool is allocated once, from the configured budget."""
        shape, blocks = self.engine.cache_shape, self.engine.blocks
        return shape.num_bytes, blocks.num_used_blocks * shape.bytes_per_block

    @property
    def prefix_cache(self) -> tuple[int, int]:
        """(prompt tokens looked up, tokens found) in the prefix cache so far."""
        stats = self.engine.blocks.stats
        return stats.queried_tokens, stats.hit_tokens

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        """Sequences not yet running: in the scheduler's queue and not yet handed to it."""
        return self.engine.num_waiting + sum(s.num_sequences for s in self._inbox)

    def _num_waiting_of(self, long: bool) -> int:
        """Sequences not yet running of one class: long work, or the rest (called under the lock)."""
        queued = sum(
            s.num_sequences for s in self._inbox if (s.group is not None and s.group.is_long(self._threshold)) == long
        )
        waiting_long = self._waiting_long
        return queued + (waiting_long if long else max(self.engine.num_waiting - waiting_long, 0))

    @property
    def auto_k(self) -> int | None:
        """The k that experts_per_token "auto" requests run with now (None: no --target-itl-ms, or dense)."""
        return self.engine.auto_k.current_k if self.engine.auto_k is not None else None

    @property
    def num_requests(self) -> int:
        """Requests not finished yet."""
        return len(self._streams) + len(self._inbox)

    def new_request_id(self) -> str:
        return f"{self.engine.artifact.name}-{next(self._ids)}"

    # ---- generation -----------------------------------------------------------------------------

    def submit(self, requests: list[GenerationRequest], background: bool = False) -> list[GenerationStream]:
        """Admit requests now, all or none (EngineOverloadedError, EngineStoppedError; ValidationError for
        more sequences than the queue ever holds): call this before a response starts, so that a refusal can
        still be a 429, 503 or 400. Iterate each stream for its updates.
        The requests are one piece of work (the prompts of one client request): their prompt tokens count
        together, and `background` (batch work) puts it behind interactive work whatever its size."""
        group = WorkGroup(sum(len(r.prompt_token_ids) for r in requests), background)
        submissions = self._submit([{"request": r, "group": group} for r in requests])
        return [GenerationStream(self, s) for s in submissions]

    # ---- classification and scoring -------------------------------------------------------------

    async def classify(
        self, token_ids: list[list[int]], k: int | KSpec, background: bool = False
    ) -> list[ClassificationOutput]:
        seqs = await self._pool(token_ids, k, SequenceKind.CLASSIFY, background=background)
        return [pooling.classification_output(self.engine.model_config, seq) for seq in seqs]

    async def score(
        self,
        token_ids: list[list[int]],
        k: int | KSpec,
        keep_token_logprobs: bool = False,
        top_logprobs: int = 0,
        background: bool = False,
    ) -> list[ScoreOutput]:
        seqs = await self._pool(token_ids, k, SequenceKind.SCORE, top_logprobs, background)
        config, tokenizer = self.engine.model_config, self.engine.tokenizer
        return [pooling.score_output(config, tokenizer, seq, keep_token_logprobs) for seq in seqs]

    async def _pool(
        self,
        token_ids: list[list[int]],
        k: int | KSpec,
        kind: SequenceKind,
        top_logprobs: int = 0,
        background: bool = False,
    ) -> list[Sequence]:
        """Inputs run through the engine's steps like prompts, one piece of work (background: batch work);
        their sequences once all are finished."""
        group = WorkGroup(sum(len(ids) for ids in token_ids), background)
        work = {"token_ids": token_ids, "k": k, "kind": kind, "top_logprobs": top_logprobs, "group": group}
        (submission,) = self._submit([work])
        try:
            update = await submission.stream.queue.get()
        except BaseException:
            self.abort(submission.request_id)  # cancelled (client gone): stop the work at once
            raise
        if isinstance(update, BaseException):
            raise update
        return submission.stream.seqs

    # ---- lifecycle ------------------------------------------------------------------------------

    def _submit(self, works: list[dict[str, Any]]) -> list[_Submission]:
        """Queue work for the engine thread, all of it or none: it is refused whole when the queue is full."""
        loop = asyncio.get_running_loop()
        submissions = [_Submission(self.new_request_id(), _Stream(asyncio.Queue(), loop), **work) for work in works]
        count = sum(s.num_sequences for s in submissions)
        long = any(s.group is not None and s.group.is_long(self._threshold) for s in submissions)
        with self._lock:
            self._refuse_if_full(count, [long])
            for submission in submissions:
                self._inbox.append(submission)
                self._streams[submission.request_id] = submission.stream
            self._lock.notify()
        return submissions

    def check_room(self, count: int, min_prompt_tokens: int) -> None:
        """Refuse interactive work now (EngineOverloadedError, EngineStoppedError) that `submit`, `classify` or
        `score` would refuse, before its inputs are tokenized: `count` sequences whose prompts together have at least
        `min_prompt_tokens` tokens. Clients refused with 429 retry, and a server that tokenized 130,000
        tokens of text to refuse them each time spent the engine thread's time on it (the GIL). Work not
        certainly long is refused only when both classes are full; `_submit` checks again, exactly."""
        if count > self.max_waiting:
            return  # never admitted, but a 400 (_refuse_if_full), after preparation names what else is wrong
        long = WorkGroup(min_prompt_tokens).is_long(self._threshold)
        with self._lock:
            self._refuse_if_full(count, [True] if long else [False, True])

    def _refuse_if_full(self, count: int, classes: list[bool]) -> None:
        """Raise unless `count` more sequences fit the waiting limit of one of the classes (long work or not)
        the work may be of (called under the lock)."""
        if self._stopping:
            raise EngineStoppedError("the server is shutting down")
        if count > self.max_waiting:  # a 400, not a 429 that a client (or a batch) would retry without end
            raise ValidationError(
                f"this request is {count} sequences (its prompts or inputs, times n), more than this server ever "
                f"queues at once ({self.max_waiting}, --max-waiting)"
            )
        waiting, long = min((self._num_waiting_of(long), long) for long in classes)
        if waiting + count > self.max_waiting:
            kind = "sequences of long work (prompts together over --long-prefill-threshold)" if long else "sequences"
            raise EngineOverloadedError(
                f"{waiting} {kind} are waiting and this request adds {count} (limit {self.max_waiting})"
            )

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
            self._lock.notify()

    def shutdown(self) -> None:
        """Stop the engine thread; requests not finished fail with EngineStoppedError (a 503), new ones
        are refused with it. Idempotent."""
        with self._lock:
            self._stopping = True
            self._exit = True
            self._lock.notify()
        self._thread.join(timeout=10)
        with self._lock:  # the thread is gone (or stuck in a step): what it held ends here
            left = {s.request_id: s.stream for s in self._inbox} | self._streams
            self._inbox, self._streams = [], {}
        for stream in left.values():
            stream.put(EngineStoppedError("the server stopped before this request finished"))

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._inbox or self._aborts or self.engine.has_unfinished() or self._exit):
                    self._lock.wait()
                if self._exit:
                    return
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
            for request_id in aborts:
                self.engine.abort(request_id)
                self._streams.pop(request_id, None)
            for submission in inbox:
                self._add(submission)
            self._waiting_long = self.engine.scheduler.num_waiting_long()
            if self.engine.has_unfinished():
                try:
                    changed = self.engine.step()
                except Exception as exc:  # not tied to one sequence: every running request learns of it
                    logger.exception("engine step failed; failing the running requests")
                    self._fail_running(exc)
                    continue
                self._publish(changed)
                if self.expert_load is not None:
                    self.expert_load.collect()
                self._waiting_long = self.engine.scheduler.num_waiting_long()  # after the step's admissions

    def _add(self, submission: _Submission) -> None:
        stream = submission.stream
        if submission.request_id not in self._streams:  # aborted before it started
            return
        try:
            if submission.request is not None:
                stream.seqs = self.engine.add_request(submission.request_id, submission.request, submission.group)
            else:
                assert submission.token_ids is not None
                stream.seqs = self.engine.add_inputs(
                    submission.request_id,
                    submission.token_ids,
                    submission.k,
                    submission.kind,
                    submission.top_logprobs,
                    submission.group,
                )
        except Exception as exc:  # validated already; anything else still reaches the caller
            self._streams.pop(submission.request_id, None)
            stream.put(exc)
            return
        n = len(stream.seqs)
        stream.sent_chars, stream.sent_tokens, stream.reported_finish = [0] * n, [0] * n, [False] * n

    def _publish(self, changed: list[Sequence]) -> None:
        for request_id in {s.request_id for s in changed}:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            finished = all(s.is_finished for s in stream.seqs)
            error = next((s.error for s in stream.seqs if s.error is not None), None)
            if error is not None:
                self.engine.abort(request_id)  # the request's other sequences end with it
                self._streams.pop(request_id, None)
                stream.put(error)
                continue
            if stream.seqs and stream.seqs[0].kind is not SequenceKind.GENERATE:
                if finished:
                    self._streams.pop(request_id, None)
                    self.engine.release(request_id)
                    stream.put(RequestUpdate(request_id, [], True))
                continue
            updates = [u for i, seq in enumerate(stream.seqs) if (u := self._delta(stream, i, seq)) is not None]
            if finished:
                self._streams.pop(request_id, None)
                self.engine.release(request_id)
            if updates or finished:
                metrics = experts = None
                if finished:
                    metrics = _request_metrics(stream.seqs)
                    layers = self.engine.model_config.moe_layers
                    experts = ExpertCounts.total(s.experts(layers) for s in stream.seqs) if layers else None
                stream.put(RequestUpdate(request_id, updates, finished, metrics, experts))

    def _delta(self, stream: _Stream, index: int, seq: Sequence) -> SequenceUpdate | None:
        if stream.reported_finish[index]:
            return None
        text_end = max(self.engine.stable_text_length(seq), stream.sent_chars[index])
        start, outputs = stream.sent_tokens[index], seq.output_token_ids
        delta = seq.text[stream.sent_chars[index] : text_end]
        if not delta and start == len(outputs) and not seq.is_finished:
            return None
        stream.sent_chars[index] = text_end
        stream.sent_tokens[index] = len(outputs)
        stream.reported_finish[index] = seq.is_finished
        wants = seq.params.logprobs is not None
        return SequenceUpdate(
            index=index,
            text_delta=delta,
            token_ids=outputs[start:],
            logprobs=seq.output_logprobs[start:] if wants else [],
            top_logprobs=seq.top_logprobs[start:] if wants else [],
            finish_reason=seq.finish_reason if seq.is_finished else None,
        )

    def _fail_running(self, exc: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.put(exc)
        self._streams.clear()


def _request_metrics(seqs: list[Sequence]) -> RequestMetrics:
    timings = [SequenceTiming(s.first_scheduled_time, list(s.token_times)) for s in seqs]
    return RequestMetrics(seqs[0].arrival_time, timings, seqs[0].num_cached_tokens)
