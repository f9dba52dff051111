"""The hardening figures, measured against a real `moe-serve serve` process on the demos:

1. peak memory of one /v1/score request with 32 inputs of about 4,000 tokens;
2. a small request's latency alone and while twelve 900 KB prompts arrive at once;
3. what a streaming client sees when the server is overloaded, and when it shuts down mid-stream.

    python -m benchmarks.robustness
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

MODEL = "shakespeare-smoe"


def start(*args: str, models: tuple[str, ...] = (MODEL,)) -> tuple[subprocess.Popen, str]:
    """`moe-serve serve` in its own process on a free loopback port, once it answers /ready."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "moe_serve.server", *models, "--port", str(port), "--log-level", "warning", *args]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/ready").status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError("the server did not start")


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmHWM"))
    return int(line.split()[1]) / 1024


async def small_latency(http: httpx.AsyncClient) -> float:
    start = time.monotonic()
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "ROMEO:", "max_tokens": 4})
    response.raise_for_status()
    return time.monotonic() - start


async def latency_under_big_prompts(url: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        alone = min([await small_latency(http) for _ in range(5)])
        big = {"model": MODEL, "prompt": "To be, or not to be. " * 43_000, "max_tokens": 1}  # ~900 KB
        flood = [asyncio.create_task(http.post("/v1/completions", json=big)) for _ in range(12)]
        await asyncio.sleep(0.05)
        during = await small_latency(http)
        statuses = sorted({r.status_code for r in await asyncio.gather(*flood)})
    return {"small_alone_s": round(alone, 3), "small_during_12x900KB_s": round(during, 3), "big_statuses": statuses}


async def stream_events(http: httpx.AsyncClient, body: dict) -> tuple[int, list[str]]:
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            return response.status_code, [(await response.aread()).decode()]
        return 200, [line async for line in response.aiter_lines() if line.startswith("data: ")]


async def overloaded_stream(url: str) -> dict:
    body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 200, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        results = await asyncio.gather(*(stream_events(http, body) for _ in range(12)))
    refused = [events[0] for status, events in results if status != 200]
    return {"statuses": sorted(status for status, _ in results), "a_refusal": refused[0] if refused else None}


async def stream_during_shutdown(process: subprocess.Popen, url: str) -> dict:
    body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 3000, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        task = asyncio.create_task(stream_events(http, body))
        await asyncio.sleep(1.0)
        os.kill(process.pid, signal.SIGTERM)
        status, events = await task
    return {"status": status, "last_events": events[-2:]}


def main() -> None:
    figures: dict = {}
    process, url = start("--max-inputs", "32")
    try:
        text = ("To be, or not to be, that is the question. " * 200)[:3990]
        before = peak_rss_mib(process.pid)
        start_time = time.monotonic()
        response = httpx.post(url + "/v1/score", json={"model": MODEL, "input": [text] * 32}, timeout=600)
        response.raise_for_status()
        figures["score_32x4000"] = {
            "tokens": response.json()["usage"]["prompt_tokens"],
            "seconds": round(time.monotonic() - start_time, 1),
            "peak_rss_mib_before": round(before),
            "peak_rss_mib_after": round(peak_rss_mib(process.pid)),
        }
        figures["latency"] = asyncio.run(latency_under_big_prompts(url))
    finally:
        process.kill()
    process, url = start("--max-waiting", "2", "--max-num-seqs", "2")
    try:
        figures["stream_overload"] = asyncio.run(overloaded_stream(url))
    finally:
        process.kill()
    process, url = start("--drain-timeout", "1")
    try:
        figures["stream_shutdown"] = asyncio.run(stream_during_shutdown(process, url))
    finally:
        process.wait(timeout=60)
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
