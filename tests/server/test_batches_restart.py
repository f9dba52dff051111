"""A Batch API job survives `kill -9`: the server (a real `moe-serve serve` process) is killed while a batch
is part done, restarted on the same --data-dir, and finishes it with every line answered exactly once, the
answers stored before the kill kept, and each answer the one the interactive endpoint gives."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import free_port
from tests.server.test_batches_api import wait

NUM_LINES = 200
BODY = {"model": "tiny-lm", "max_tokens": 16, "temperature": 0, "ignore_eos": True}


def start(model: Path, port: int, data_dir: Path, log: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "moe_serve", "serve", str(model), "--port", str(port), "--data-dir", str(data_dir),
        "--batch-max-in-flight", "8", "--log-level", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(log, "ab"))  # noqa: SIM115
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"the server did not start: {log.read_text()}")


@pytest.mark.slow
def test_a_batch_resumes_after_kill_9_with_nothing_lost_or_duplicated(artifacts, tmp_path: Path) -> None:
    port, data_dir, log = free_port(), tmp_path / "data", tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}/v1"
    sdk = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    prompts = {f"req-{i}": f"Line {i}: " + "and " * (i % 5) for i in range(NUM_LINES)}
    lines = [
        {"custom_id": c, "method": "POST", "url": "/v1/completions", "body": {**BODY, "prompt": p}}
        for c, p in prompts.items()
    ]
    server = start(artifacts["lm"], port, data_dir, log)
    try:
        file_id = sdk.files.create(file=("in.jsonl", "\n".join(map(json.dumps, lines)).encode()), purpose="batch").id
        batch_id = sdk.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h").id
        before = wait(sdk, batch_id, lambda b: b.request_counts.completed >= 20, timeout=180)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
        killed_at = int(time.time())
    finally:
        if server.poll() is None:
            server.kill()
    assert before.status == "in_progress" and before.request_counts.completed < NUM_LINES, before
    time.sleep(1.1)  # answers given after the restart carry a later `created` second than any before the kill
    server = start(artifacts["lm"], port, data_dir, log)
    try:
        batch = wait(sdk, batch_id, timeout=180)
        assert batch.status == "completed", batch
        assert (batch.request_counts.total, batch.request_counts.completed) == (NUM_LINES, NUM_LINES)
        assert batch.error_file_id is None
        output = [json.loads(x) for x in sdk.files.content(batch.output_file_id).text.splitlines()]
        assert Counter(x["custom_id"] for x in output) == Counter(list(prompts))  # each exactly once
        assert len({x["id"] for x in output}) == NUM_LINES
        # The answers stored before the kill were kept, not recomputed; and only those precede it.
        kept = sum(x["response"]["body"]["created"] <= killed_at for x in output)
        assert before.request_counts.completed <= kept < NUM_LINES
        # Every answer is what the interactive endpoint gives (greedy decoding is batch-invariant).
        live = asyncio.run(interactive(url, prompts))
        assert {x["custom_id"]: x["response"]["body"]["choices"][0]["text"] for x in output} == live
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


async def interactive(url: str, prompts: dict[str, str]) -> dict[str, str]:
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        body = {k: v for k, v in BODY.items() if k != "model"}

        async def one(prompt: str) -> str:
            response = await client.completions.create(model="tiny-lm", prompt=prompt, extra_body=body)
            return response.choices[0].text

        texts = await asyncio.gather(*(one(p) for p in prompts.values()))
    return dict(zip(prompts, texts, strict=True))
