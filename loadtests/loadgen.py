"""HTTP load generator for /v1/completions (streaming, so time to first token is measured on the wire).

    python -m loadtests.loadgen --url http://127.0.0.1:8000 --model NAME --concurrency 1,8,32 --k 1,8 \
        [--requests 64] [--rate R] [--max-tokens 64] [--json out.json] [--csv out.csv]

Per (concurrency, k) cell: `--requests` requests are issued open-loop: arrivals follow a Poisson process
at `--rate` requests/s (default: as fast as the concurrency allows), never waiting for earlier requests to
finish, with at most `concurrency` in flight. Reports p50/p99 end-to-end latency and time to first token,
and throughput in requests/s and generated tokens/s. Loopback targets only; every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import sys
import time
from dataclasses import asdict, dataclass

import httpx

PROMPTS = [
    "ROMEO.\n",
    "JULIET.\nO Romeo, Romeo,",
    "HAMLET.\nTo be, or not to be,",
    "MACBETH.\nIs this a dagger",
    "KING LEAR.\nBlow, winds,",
    "PORTIA.\nThe quality of mercy",
    "PUCK.\nIf we shadows have offended,",
    "IAGO.\nO, beware, my lord,",
]


@dataclass
class Cell:
    concurrency: int
    k: int
    requests: int
    errors: int
    seconds: float
    requests_per_s: float
    tokens_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def one_request(
    http: httpx.AsyncClient, model: str, prompt: str, k: int, max_tokens: int
) -> tuple[float, float, int]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "experts_per_token": k,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    first, tokens = None, 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return time.perf_counter() - start, first or float("nan"), tokens


async def run_cell(
    url: str, model: str, concurrency: int, k: int, requests: int, rate: float | None, max_tokens: int, seed: int
) -> Cell:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    latencies, ttfts, tokens, errors = [], [], 0, 0

    async def fire(http: httpx.AsyncClient, index: int) -> None:
        nonlocal tokens, errors
        async with gate:
            try:
                latency, ttft, n = await one_request(http, model, PROMPTS[index % len(PROMPTS)], k, max_tokens)
            except (httpx.HTTPError, RuntimeError):
                errors += 1
                return
        latencies.append(latency)
        ttfts.append(ttft)
        tokens += n

    async with httpx.AsyncClient(
        base_url=url, timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)
    ) as http:
        start = time.perf_counter()
        tasks = []
        for index in range(requests):  # open loop: schedule arrivals without waiting for completions
            tasks.append(asyncio.create_task(fire(http, index)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        seconds = time.perf_counter() - start
    done = len(latencies)
    return Cell(
        concurrency,
        k,
        done,
        errors,
        seconds,
        done / seconds,
        tokens / seconds,
        percentile(latencies, 0.5),
        percentile(latencies, 0.99),
        percentile(ttfts, 0.5),
        percentile(ttfts, 0.99),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.loadgen", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--k", default="1", help="comma-separated experts_per_token values")
    parser.add_argument(
        "--requests", type=int, default=None, help="requests per cell (default: 4 x concurrency, at least 8)"
    )
    parser.add_argument(
        "--rate", type=float, default=None, help="Poisson arrival rate in requests/s (default: unthrottled)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--csv", dest="csv_path", default=None)
    args = parser.parse_args(argv)
    host = httpx.URL(args.url).host
    if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127."):
        print(f"error: refusing to load {host}: loopback targets only", file=sys.stderr)
        return 2
    cells = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for k in (int(k) for k in args.k.split(",")):
            requests = args.requests or max(8, 4 * concurrency)
            cell = asyncio.run(
                run_cell(args.url, args.model, concurrency, k, requests, args.rate, args.max_tokens, args.seed)
            )
            cells.append(cell)
            print(
                f"c={cell.concurrency:<3} k={cell.k:<2} {cell.requests_per_s:7.2f} req/s "
                f"{cell.tokens_per_s:8.1f} tok/s  "
                f"latency p50 {cell.latency_p50_s:6.3f}s p99 {cell.latency_p99_s:6.3f}s  "
                f"ttft p50 {cell.ttft_p50_s:6.3f}s p99 {cell.ttft_p99_s:6.3f}s  errors {cell.errors}",
                flush=True,
            )
    rows = [asdict(c) for c in cells]
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(
                {"url": args.url, "model": args.model, "max_tokens": args.max_tokens, "rate": args.rate, "cells": rows},
                f,
                indent=2,
            )
    if args.csv_path:
        with open(args.csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 1 if any(c.errors for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
