"""Batch work yields to interactive work: every line a batch runs (any endpoint: completions, chat, classify,
score) is background work in the engine, and the prompt tokens its lines keep in the engine at once are bounded
(core.PrefillWindow), not only their count."""

from __future__ import annotations

import asyncio

import pytest

from moe_serve.batch import core
from moe_serve.batch.core import PrefillWindow
from moe_serve.batch.jsonl import BatchItem
from moe_serve.config import RequestLimits


def test_the_window_holds_lines_until_their_tokens_fit_and_runs_a_larger_one_alone() -> None:
    window = PrefillWindow(lambda: 100)
    log: list[str] = []

    async def line(name: str, tokens: int, release: asyncio.Event) -> None:
        async with window.hold(tokens):
            log.append(f"+{name}")
            await release.wait()
        log.append(f"-{name}")

    async def scenario() -> None:
        a, b, c = asyncio.Event(), asyncio.Event(), asyncio.Event()
        tasks = [asyncio.ensure_future(line("a", 60, a)), asyncio.ensure_future(line("b", 60, b))]
        tasks.append(asyncio.ensure_future(line("huge", 500, c)))
        await asyncio.sleep(0.01)
        assert log == ["+a"] and window.in_flight == 60  # b's 60 would pass the window
        a.set()
        await asyncio.sleep(0.01)
        assert log == ["+a", "-a", "+b"]
        b.set()
        await asyncio.sleep(0.01)
        assert log[-2:] == ["-b", "+huge"] and window.in_flight == 500  # larger than the window: alone
        c.set()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())
    assert window.in_flight == 0


class RecordingEngine:
    """What a line asks of the engine, recorded (each call's `background`)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []
        self.inputs = None

    def submit(self, requests, background: bool = False):
        self.calls.append(("submit", background))
        return []

    async def score(self, token_ids, k, keep_token_logprobs=False, top_logprobs=0, background=False):
        self.calls.append(("score", background))
        return []

    async def classify(self, token_ids, k, background=False):
        self.calls.append(("classify", background))
        return []


@pytest.mark.parametrize("url", ["/v1/completions", "/v1/chat/completions", "/v1/score", "/v1/classify"])
def test_every_endpoint_a_batch_line_names_runs_as_background_work(monkeypatch, url: str) -> None:
    engine = RecordingEngine()

    class Job:
        prompt_tokens, generate, requests, kind, token_ids, k, return_token_logprobs = 7, True, [], None, [], 2, False

        async def gather(self, engine, streams, background=False):
            engine.calls.append(("gather", background))
            raise RuntimeError("stop here: what reached the engine is recorded")

    job = Job()
    job.kind = "classify" if url == "/v1/classify" else "score"

    class Models:
        limits = RequestLimits()
        prefill = PrefillWindow()

        def resolve(self, request, item):
            return "m", engine, request

        async def prepare(self, fn, *args):
            return job

    def stop(*args):
        raise RuntimeError("stop here: what reached the engine is recorded")

    monkeypatch.setattr(core.responses, "score_response", stop)
    monkeypatch.setattr(core.responses, "classify_response", stop)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if "chat" in url else {"model": "m"}
    body |= {"prompt": "hi"} if url == "/v1/completions" else {"input": "hi"} if url != "/v1/chat/completions" else {}
    item = BatchItem(line=1, custom_id="x", url=url, body=body, model="m", k=None)
    asyncio.run(core.answer(Models(), item))
    assert engine.calls and all(background for _, background in engine.calls), engine.calls
