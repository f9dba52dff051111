"""Starvation by long scoring work: a short completion's latency while one /v1/score of
16 inputs of about 4,000 tokens runs on the same model, against its latency alone, through a real server on
127.0.0.1 serving a bundled demo model.

    .venv/bin/python -m benchmarks.starvation [--model shakespeare-smoe] [--inputs 16] [--tokens 4000]
        [--long-prefill-threshold N] [--long-prefill-chunk N] [--max-long-prefills N]

Figures: the median latency of a 4-token completion alone (several, one after another), then the median of
the completions sent one after another while the score runs, their ratio (the goal: at most 3x), the
longest /health answer during the score, and the score's own time, with the load average beside them (the
machine may be shared). `--long-prefill-threshold 1000000` turns the long-prompt
policy off (every prompt short: the scheduler as it was before), for a comparison on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

import httpx

from benchmarks.mixed import serve_in_thread
from moe_serve.config import EngineConfig, RequestLimits
from moe_serve.registry import resolve_model
from moe_serve.server.app import create_app
from moe_serve.server.settings import ServerSettings

COMPLETION = {"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} CPUs)"


async def timed(http: httpx.AsyncClient, path: str, body: dict | None = None) -> float:
    start = time.perf_counter()
    response = await (http.post(path, json=body) if body is not None else http.get(path))
    response.raise_for_status()
    return time.perf_counter() - start


async def measure(url: str, model: str, inputs: list[str], alone_runs: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        completion = {"model": model, **COMPLETION}
        for _ in range(3):  # warm: first requests pay one-time costs
            await timed(http, "/v1/completions", completion)
        alone = [await timed(http, "/v1/completions", completion) for _ in range(alone_runs)]
        load_before = load()

        score_start = time.perf_counter()
        score = asyncio.ensure_future(timed(http, "/v1/score", {"model": model, "input": inputs}))
        await asyncio.sleep(0.5)  # the score is admitted and prefilling
        during, health = [], []
        while not score.done():
            during.append(await timed(http, "/v1/completions", completion))
            health.append(await timed(http, "/health"))
            await asyncio.sleep(0.05)
        score_seconds = await score
        score_wall = time.perf_counter() - score_start
        load_during = load()
    alone_median = statistics.median(alone)
    during_median = statistics.median(during) if during else float("nan")
    return {
        "completion_alone_median_s": round(alone_median, 4),
        "completion_alone_runs_s": [round(x, 4) for x in alone],
        "completion_during_score_median_s": round(during_median, 4),
        "completion_during_score_max_s": round(max(during), 4) if during else None,
        "completions_during_score": len(during),
        "ratio_median": round(during_median / alone_median, 2),
        "health_during_score_max_s": round(max(health), 4) if health else None,
        "score_s": round(score_seconds, 2),
        "score_wall_s": round(score_wall, 2),
        "load_average_before_score": load_before,
        "load_average_after_score": load_during,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shakespeare-smoe")
    parser.add_argument("--inputs", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=4000, help="characters per input (a token each: byte model)")
    parser.add_argument("--alone-runs", type=int, default=9)
    defaults = EngineConfig()
    parser.add_argument("--long-prefill-threshold", type=int, default=defaults.long_prefill_threshold)
    parser.add_argument("--long-prefill-chunk", type=int, default=defaults.long_prefill_chunk)
    parser.add_argument("--max-long-prefills", type=int, default=defaults.max_long_prefills)
    args = parser.parse_args()

    engine = EngineConfig(
        long_prefill_threshold=args.long_prefill_threshold,
        long_prefill_chunk=args.long_prefill_chunk,
        max_long_prefills=args.max_long_prefills,
    )
    path = resolve_model(args.model)
    settings = ServerSettings(
        models=(str(path),), port=0, engine=engine, limits=RequestLimits(max_request_tokens=1 << 20)
    )
    app = create_app(settings)
    server, thread, port = serve_in_thread(app)
    name = next(iter(app.state.ctx.models))
    max_len = app.state.ctx.models[name].engine.inputs.max_model_len
    tokens = min(args.tokens, max_len - 1)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz      \n,.ETAOINSHR"
    inputs = ["".join(rng.choice(letters) for _ in range(tokens)) for _ in range(args.inputs)]
    print(
        f"model {name} (max_model_len {max_len}); score: {args.inputs} inputs x {tokens} characters; "
        f"long_prefill_threshold {engine.long_prefill_threshold}, long_prefill_chunk {engine.long_prefill_chunk}, "
        f"max_long_prefills {engine.max_long_prefills}; "
        f"load average {load()}",
        flush=True,
    )
    try:
        result = asyncio.run(measure(f"http://127.0.0.1:{port}", name, inputs, args.alone_runs))
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    result = {"model": name, "inputs": args.inputs, "tokens_per_input": tokens, **result}
    result |= {
        "long_prefill_threshold": engine.long_prefill_threshold,
        "long_prefill_chunk": engine.long_prefill_chunk,
        "max_long_prefills": engine.max_long_prefills,
    }
    print(json.dumps(result, indent=2))
    verdict = "meets" if result["ratio_median"] <= 3.0 else "misses"
    print(
        f"4-token completion: {result['completion_alone_median_s']} s alone, "
        f"{result['completion_during_score_median_s']} s during the score (median of "
        f"{result['completions_during_score']}): {result['ratio_median']}x ({verdict} the 3x goal); "
        f"/health at most {result['health_during_score_max_s']} s; the score took {result['score_s']} s; "
        f"load average {result['load_average_after_score']}"
    )


if __name__ == "__main__":
    main()
