"""experts_per_token "auto" against a fixed k under an overload ramp: a real `moe-serve serve` with a
latency target (--target-itl-ms) and a small waiting queue (--max-waiting, so overload ends in 429s), offered
load (requests/s, open loop: arrivals do not wait for answers) ramped up in stages, run twice: every request
at the model's max k, then every request "auto". Per stage: throughput (generated tokens/s), inter-token
latency p50/p99 as streaming clients measure it, 429s, and the mean k the responses report; plus the
server's auto k over time (its gauge, polled).

The model is the `medium` benchmark model (benchmarks/models.py: random weights, 16 experts, ~0.5 B
parameters; built once into $BENCH_CACHE): on a CPU its steps are bound by expert compute, so k is what
decides throughput. On the small demos (--model shakespeare-smoe) HTTP and streaming overhead bound this
2-core machine before the experts do, so lowering k buys little there.

    python -m benchmarks.overload_ramp                      # writes benchmarks/results/overload_ramp.{json,md}
    python -m benchmarks.overload_ramp --rates 1,4 --stage-seconds 5 --out /tmp/ramp   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks import robustness
from benchmarks.models import build

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ("ROMEO.\n", "JULIET.\n", "HAMLET.\nTo be, or not to be", "First Citizen.\n", "MACBETH.\nIs this a dagger")
RESULTS = Path(__file__).parent / "results"


@dataclass
class Request:
    stage: int
    sent: float
    status: int = 0
    token_times: list[float] = field(default_factory=list)
    mean_k: float | None = None


async def one_request(http: httpx.AsyncClient, request: Request, body: dict) -> None:
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            request.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if event.get("choices"):  # one chunk per token (its text may be empty: a partial UTF-8 character)
                    request.token_times.append(time.monotonic())
                if event.get("usage"):
                    request.mean_k = event["usage"]["experts_per_token_mean"]
    except httpx.HTTPError:
        request.status = -1  # the connection failed: counted apart from 429s


async def poll_gauges(url: str, model: str, samples: list[dict], started: float, stop: asyncio.Event) -> None:
    """The server's auto k and waiting queue, twice a second: "auto k over time"."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        while not stop.is_set():
            text = (await http.get("/metrics")).text
            sample = {"t": round(time.monotonic() - started, 2)}
            for key, metric in (
                ("auto_k", "moe_serve_auto_experts_per_token"),
                ("waiting", "moe_serve_num_requests_waiting"),
            ):
                found = re.search(rf'^{metric}{{model="{re.escape(model)}"}} ([0-9.e+]+)$', text, re.M)
                sample[key] = float(found.group(1)) if found else None
            samples.append(sample)
            await asyncio.sleep(0.5)


async def ramp(url: str, model: str, k: int | str, rates: list[float], stage_seconds: float, max_tokens: int) -> dict:
    rng = random.Random(0)  # the same arrivals and prompts for both runs
    requests: list[Request] = []
    tasks = []
    gauges: list[dict] = []
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        started = time.monotonic()
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_gauges(url, model, gauges, started, stop))
        for stage, rate in enumerate(rates):
            stage_end = started + (stage + 1) * stage_seconds
            next_at = started + stage * stage_seconds
            while True:
                next_at += rng.expovariate(rate)  # Poisson arrivals at the stage's rate
                if next_at >= stage_end:
                    break
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                request = Request(stage, time.monotonic())
                body = {
                    "model": model,
                    "prompt": rng.choice(PROMPTS),
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "experts_per_token": k,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                requests.append(request)
                tasks.append(asyncio.create_task(one_request(http, request, body)))
            await asyncio.sleep(max(0.0, stage_end - time.monotonic()))
        await asyncio.gather(*tasks)
        stop.set()
        await poller
    return {"stages": summarize(requests, rates, started, stage_seconds), "gauges": gauges}


def summarize(requests: list[Request], rates: list[float], started: float, stage_seconds: float) -> list[dict]:
    out = []
    for stage, rate in enumerate(rates):
        begin, end = started + stage * stage_seconds, started + (stage + 1) * stage_seconds
        sent = [r for r in requests if r.stage == stage]
        answered = [r for r in sent if r.status == 200]
        itls = [b - a for r in answered for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
        tokens_in_window = sum(begin <= t < end for r in requests for t in r.token_times)
        ks = [r.mean_k for r in answered if r.mean_k is not None]
        out.append(
            {
                "offered_rps": rate,
                "sent": len(sent),
                "ok": len(answered),
                "429": sum(r.status == 429 for r in sent),
                "other_errors": sum(r.status not in (200, 429) for r in sent),
                "tokens_per_s": round(tokens_in_window / stage_seconds, 1),
                "itl_p50_ms": round(1000 * statistics.median(itls), 1) if itls else None,
                "itl_p99_ms": round(1000 * quantile(itls, 0.99), 1) if itls else None,
                "mean_k": round(statistics.fmean(ks), 2) if ks else None,
            }
        )
    return out


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"## Overload ramp: auto k against fixed k = {s['max_k']} ({s['model']})",
        "",
        f"`{s['command']}`: server `{' '.join(s['server_args'])}`; {s['stage_seconds']:g} s per stage, Poisson "
        f"arrivals, {s['max_tokens']} tokens per request (streamed), CPU ({s['cpu_note']}).",
        "",
        "| offered req/s | k | sent | ok | 429 | tokens/s | ITL p50 ms | ITL p99 ms | mean k |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for stage in range(len(s["rates"])):
        for name, run in result["runs"].items():
            r = run["stages"][stage]
            lines.append(
                f"| {r['offered_rps']:g} | {name} | {r['sent']} | {r['ok']} | {r['429']} | {r['tokens_per_s']} | "
                f"{r['itl_p50_ms']} | {r['itl_p99_ms']} | {r['mean_k']} |"
            )
    lines.append("")
    for name, run in result["runs"].items():
        totals = run["stages"]
        lines.append(
            f"- {name}: {sum(r['ok'] for r in totals)} answered, {sum(r['429'] for r in totals)} refused with 429, "
            f"{sum(r['other_errors'] for r in totals)} other errors"
        )
    auto = [g["auto_k"] for g in result["runs"]["auto"]["gauges"] if g["auto_k"] is not None]
    if auto:
        lines.append(f"- auto k over time (server gauge, every 0.5 s): {' '.join(str(int(k)) for k in auto)}")
    return "\n".join(lines) + "\n"


def served_model(url: str) -> tuple[str, int]:
    card = httpx.get(url + "/v1/models").json()["data"][0]
    return card["id"], card["experts_per_token"]["max"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="medium", help="medium (the benchmark model), or an artifact / demo name")
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("BENCH_CACHE", ROOT / ".cache")))
    parser.add_argument("--rates", default="0.5,1,2,4,8", help="offered requests/s per stage")
    parser.add_argument("--stage-seconds", type=float, default=15.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--target-itl-ms", type=float, default=150.0)
    parser.add_argument("--max-waiting", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--out", default=str(RESULTS / "overload_ramp"), help="path without .json/.md")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    model = str(build("medium", args.cache).artifact) if args.model == "medium" else args.model
    server_args = [
        "--target-itl-ms", str(args.target_itl_ms), "--max-waiting", str(args.max_waiting),
        "--max-num-seqs", str(args.max_num_seqs),
    ]  # fmt: skip
    runs, name, max_k = {}, model, 0
    for run in ("fixed", "auto"):
        process, url = robustness.start(*server_args, models=(model,))  # a fresh server per run: nothing carries over
        try:
            name, max_k = served_model(url)
            label, k = (f"fixed {max_k}", max_k) if run == "fixed" else ("auto", "auto")
            runs[label] = asyncio.run(ramp(url, name, k, rates, args.stage_seconds, args.max_tokens))
        finally:
            process.kill()
            process.wait(timeout=30)
        print(label, json.dumps(runs[label]["stages"]), flush=True)
    result = {
        "settings": {
            "command": "python -m benchmarks.overload_ramp "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "cache")),
            "model": args.model if args.model != "medium" else "medium (benchmarks/models.py)",
            "max_k": max_k,
            "server_args": server_args,
            "rates": rates,
            "stage_seconds": args.stage_seconds,
            "max_tokens": args.max_tokens,
            "cpu_note": "2 cores shared by the server, this load generator and whatever else runs",
        },
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
