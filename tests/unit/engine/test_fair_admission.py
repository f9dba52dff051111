"""Admission by work, not by prompt: a client's heavy request (many medium prompts together, or batch work)
queues as long work, held to the waiting limit on its own, so it never makes another client's short request a
429, and an AsyncEngine request's prompts count together (engine.sequence.WorkGroup)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from moe_serve.config import EngineConfig
from moe_serve.engine.async_engine import AsyncEngine
from moe_serve.engine.backend import load_model
from moe_serve.errors import EngineOverloadedError, ValidationError
from moe_serve.sampling_params import SamplingParams

LIMIT = 4


@pytest.fixture
def engine(tiny_model):
    config = EngineConfig(max_waiting=LIMIT, long_prefill_threshold=64, max_model_len=256)
    engine = AsyncEngine.start(load_model(tiny_model(), config), config)
    release = threading.Event()
    step = engine.engine.step

    def held_step():  # the first step waits until the test has submitted: the queue stays as it was
        release.wait(timeout=30)
        return step()

    engine.engine.step = held_step
    yield engine, release
    release.set()
    engine.shutdown()


def test_heavy_work_filling_the_queue_refuses_heavy_work_not_a_short_request(engine) -> None:
    async_engine, release = engine
    inputs = async_engine.inputs
    heavy = [[7 + i] * 40 for i in range(LIMIT)]  # 160 tokens together: long work, though each input is short

    async def scenario() -> list[int]:
        scoring = asyncio.ensure_future(async_engine.score(heavy, 2))
        deadline = time.monotonic() + 30
        while async_engine.engine.num_waiting < LIMIT and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the engine thread has queued the heavy inputs
        await asyncio.sleep(0.05)
        with pytest.raises(EngineOverloadedError, match="long work"):
            async_engine.submit([inputs.generation_request([9] * 40, SamplingParams(max_tokens=1))] * 3)
        (short,) = async_engine.submit([inputs.generation_request([5, 6, 7], SamplingParams(max_tokens=2))])
        release.set()
        output = await short.final()
        scores = await scoring
        assert len(scores) == LIMIT
        return output.outputs[0].token_ids

    assert len(asyncio.run(scenario())) == 2  # the short request was admitted and completed


def test_room_is_checked_before_tokenizing_by_a_lower_bound_of_the_work(engine) -> None:
    """check_room (what the server asks before it tokenizes a request) refuses work certainly long while the
    long class is full, work that may be short only once both classes are full, and more sequences than the
    queue ever holds as a 400 (a 429 would be retried without end)."""
    async_engine, release = engine
    inputs = async_engine.inputs
    heavy = [[7 + i] * 40 for i in range(LIMIT)]

    async def scenario() -> None:
        scoring = asyncio.ensure_future(async_engine.score(heavy, 2))
        deadline = time.monotonic() + 30
        while async_engine.engine.num_waiting < LIMIT and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        with pytest.raises(EngineOverloadedError, match="long work"):
            async_engine.check_room(2, 65)  # over the threshold of 64 tokens: certainly long
        async_engine.check_room(LIMIT, 64)  # may be short: the short class has room
        streams = async_engine.submit([inputs.generation_request([5, 6, 7], SamplingParams(max_tokens=1))] * LIMIT)
        with pytest.raises(EngineOverloadedError, match="4 sequences are waiting and this request adds 1"):
            async_engine.check_room(1, 3)  # both classes full now
        async_engine.check_room(LIMIT + 1, 3)  # never admitted, but refused by submit (a 400, below)
        release.set()
        for stream in streams:
            await stream.final()
        await scoring

    asyncio.run(scenario())


def test_a_request_larger_than_the_queue_is_a_validation_error_not_an_overload(engine) -> None:
    async_engine, release = engine
    release.set()
    request = async_engine.inputs.generation_request([5, 6, 7], SamplingParams(max_tokens=1, n=LIMIT + 1))

    async def scenario() -> None:
        with pytest.raises(ValidationError, match=f"{LIMIT + 1} sequences"):
            async_engine.submit([request])

    asyncio.run(scenario())
