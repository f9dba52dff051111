"""Fair share under hostile request shapes: a short interactive probe (a 4-token completion) while another
client's heavy work runs on the same server, against the probe alone. A real `moe-serve serve` process on
127.0.0.1 (its own process, as in production: the client here never shares its interpreter), a bundled demo
model, the default engine settings.

    .venv/bin/python -m benchmarks.fair_share [--model shakespeare-smoe] [--rows all|NAME,...] [--json PATH]
        [--heavy-only] [-- SERVE_OPTIONS...]

Rows (the heavy work; every prompt or input of distinct random characters, so no prefix-cache hit):
  completions-256x500  /v1/completions, 256 prompts x 500 tokens, max_tokens 1
  score-256x510        /v1/score, 256 inputs x 510 tokens
  score-256x512        /v1/score, 256 inputs x 512 tokens
  score-16x4000        /v1/score, 16 inputs x 4,000 tokens
  batch-400-score      a Batch API file of 400 /v1/score lines (one input of 500 tokens each)
  mix                  four clients at once: the first four rows together

For each row: the heavy work alone (its seconds: its own throughput), then again with the probe sent one after
another (50 ms apart) until the heavy work ends: the probe's median, 99th percentile and maximum latency against
its median alone (measured just before the row), with the 1-minute load average at the row's end (the machine
has 2 cores: any other process skews every figure). The goal: probe median <= 3x and probe max <= 10x its latency alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from moe_serve.registry import resolve_model

PROBE = {"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
LETTERS = "abcdefghijklmnopqrstuvwxyz      \n,.ETAOINSHR"
GOAL_MEDIAN, GOAL_MAX = 3.0, 10.0


@dataclass
class Row:
    name: str
    heavy_alone_s: float
    heavy_with_probe_s: float
    probes: int
    probe_median_s: float
    probe_max_s: float
    median_ratio: float
    max_ratio: float
    load_average: str
    p99_ratio: float = 0.0  # the 99th percentile probe against alone
    over_max_goal: int = 0  # probes slower than GOAL_MAX times alone
    probe_alone_s: float = 0.0  # the probe alone just before the row: what its ratios are against

    @property
    def meets(self) -> bool:
        return self.median_ratio <= GOAL_MEDIAN and self.max_ratio <= GOAL_MAX


def load() -> str:
    return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def texts(rng: random.Random, count: int, length: int) -> list[str]:
    return ["".join(rng.choice(LETTERS) for _ in range(length)) for _ in range(count)]


async def post(http: httpx.AsyncClient, path: str, body: dict) -> None:
    """POST as a well-behaved client does: a 429 (the engine's queue is full: several heavy clients at once)
    is retried after its Retry-After."""
    while True:
        response = await http.post(path, json=body)
        if response.status_code != 429:
            response.raise_for_status()
            return
        await asyncio.sleep(float(response.headers.get("retry-after", "1")))


class Heavy:
    """The heavy work of each row, as a coroutine factory over one client (fresh random texts every call)."""

    def __init__(self, http: httpx.AsyncClient, model: str, seed: int = 0) -> None:
        self.http, self.model, self.rng = http, model, random.Random(seed)

    async def completions(self, prompts: int = 256, tokens: int = 500) -> None:
        body = {"model": self.model, "prompt": texts(self.rng, prompts, tokens), "max_tokens": 1, "temperature": 0}
        await post(self.http, "/v1/completions", body)

    async def score(self, inputs: int, tokens: int) -> None:
        await post(self.http, "/v1/score", {"model": self.model, "input": texts(self.rng, inputs, tokens)})

    async def batch(self, lines: int = 400, tokens: int = 500) -> None:
        rows = [
            {"custom_id": f"l{i}", "method": "POST", "url": "/v1/score", "body": {"model": self.model, "input": text}}
            for i, text in enumerate(texts(self.rng, lines, tokens))
        ]
        data = "\n".join(json.dumps(r) for r in rows).encode()
        upload = await self.http.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
        upload.raise_for_status()
        body = {"input_file_id": upload.json()["id"], "endpoint": "/v1/score", "completion_window": "24h"}
        created = await self.http.post("/v1/batches", json=body)
        created.raise_for_status()
        batch_id = created.json()["id"]
        while True:
            status = (await self.http.get(f"/v1/batches/{batch_id}")).json()
            if status["status"] in ("completed", "failed", "expired", "cancelled"):
                assert status["status"] == "completed", status
                return
            await asyncio.sleep(0.1)

    def row(self, name: str):
        if name == "completions-256x500":
            return self.completions()
        if name.startswith("score-"):
            inputs, tokens = name.removeprefix("score-").split("x")
            return self.score(int(inputs), int(tokens))
        if name == "batch-400-score":
            return self.batch()
        if name == "mix":
            return self.mix()
        raise ValueError(f"unknown row {name}")

    async def mix(self) -> None:
        """Four clients at once, each with its own connection pool."""
        async with httpx.AsyncClient(base_url=self.http.base_url, timeout=3600) as second:
            others = [Heavy(second, self.model, seed) for seed in (1, 2, 3)]
            await asyncio.gather(
                self.completions(), others[0].score(256, 510), others[1].score(256, 512), others[2].score(16, 4000)
            )


ROWS = ("completions-256x500", "score-256x510", "score-256x512", "score-16x4000", "batch-400-score", "mix")


async def probe(http: httpx.AsyncClient, model: str) -> float:
    start = time.perf_counter()
    (await http.post("/v1/completions", json={"model": model, **PROBE})).raise_for_status()
    return time.perf_counter() - start


async def measure(url: str, model: str, rows: list[str], alone_runs: int, heavy_only: bool) -> tuple[float, list[Row]]:
    async with (
        httpx.AsyncClient(base_url=url, timeout=3600) as http,
        httpx.AsyncClient(base_url=url, timeout=3600) as probe_http,
    ):
        for _ in range(3):  # the first requests pay one-time costs
            await probe(probe_http, model)
        alone = statistics.median([await probe(probe_http, model) for _ in range(alone_runs)])
        heavy = Heavy(http, model)
        results = []
        for name in rows:
            start = time.perf_counter()
            await heavy.row(name)
            heavy_alone = time.perf_counter() - start
            if heavy_only:
                print(f"{name:20s} heavy {heavy_alone:6.2f} s alone; load {load()}", flush=True)
                results.append(Row(name, round(heavy_alone, 2), 0.0, 0, 0.0, 0.0, 0.0, 0.0, load()))
                continue
            # The probe alone again just before the row, its baseline: from run to run it was 0.012-0.026 s.
            row_alone = statistics.median([await probe(probe_http, model) for _ in range(alone_runs)])
            start = time.perf_counter()
            task = asyncio.ensure_future(heavy.row(name))
            latencies = []
            await asyncio.sleep(0.2)  # the heavy work is admitted
            while not task.done():
                latencies.append(await probe(probe_http, model))
                await asyncio.sleep(0.05)
            await task
            heavy_with = time.perf_counter() - start
            median, longest = statistics.median(latencies), max(latencies)
            row = Row(
                name,
                round(heavy_alone, 2),
                round(heavy_with, 2),
                len(latencies),
                round(median, 4),
                round(longest, 4),
                round(median / row_alone, 2),
                round(longest / row_alone, 2),
                load(),
                round(statistics.quantiles(latencies, n=100)[98] / row_alone, 2) if len(latencies) > 1 else 0.0,
                sum(latency > GOAL_MAX * row_alone for latency in latencies),
                round(row_alone, 4),
            )
            results.append(row)
            print(
                f"{name:20s} heavy {row.heavy_alone_s:6.2f} s alone, {row.heavy_with_probe_s:6.2f} s with the probe; "
                f"probe median {row.probe_median_s:.4f} s ({row.median_ratio}x), max {row.probe_max_s:.4f} s "
                f"({row.max_ratio}x; p99 {row.p99_ratio}x, {row.over_max_goal} over {GOAL_MAX:g}x) over {row.probes}; "
                f"{'meets' if row.meets else 'MISSES'}; load {row.load_average}",
                flush=True,
            )
        return alone, results


def start_server(model: str, port: int, data_dir: Path, extra: list[str]) -> subprocess.Popen:
    with socket.socket() as probe_socket:  # another server on the port would answer in this one's place
        if probe_socket.connect_ex(("127.0.0.1", port)) == 0:
            raise SystemExit(f"port {port} is taken: stop what listens there, or pass --port")
    command = [sys.executable, "-m", "moe_serve", "serve", model, "--port", str(port), "--data-dir", str(data_dir)]
    server = subprocess.Popen([*command, "--log-level", "warning", *extra])
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
        time.sleep(0.25)
    server.kill()
    raise SystemExit("the server did not become ready in 300 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shakespeare-smoe")
    parser.add_argument("--rows", default="all", help=f"all, or a comma-separated subset of {', '.join(ROWS)}")
    parser.add_argument("--alone-runs", type=int, default=15)
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--heavy-only", action="store_true", help="the heavy work alone, no probe (another version's throughput)"
    )
    parser.add_argument("server_args", nargs="*", help="after --: extra `moe-serve serve` options")
    args = parser.parse_args()
    rows = list(ROWS) if args.rows == "all" else args.rows.split(",")
    path = resolve_model(args.model)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fair-share-") as data_dir:
        print(f"model {path.name}; load average before {load()} ({os.cpu_count()} CPUs)", flush=True)
        server = start_server(str(path), args.port, Path(data_dir), args.server_args)
        try:
            alone, results = asyncio.run(
                measure(f"http://127.0.0.1:{args.port}", path.name, rows, args.alone_runs, args.heavy_only)
            )
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(f"probe alone: {alone:.4f} s (median of {args.alone_runs})")
    if args.heavy_only:
        print("| row | heavy alone (s) | load |\n|---|---|---|")
        for r in results:
            print(f"| {r.name} | {r.heavy_alone_s} | {r.load_average} |")
    else:
        print("| row | heavy alone (s) | probe alone | probe median | probe p99 | probe max | load |")
        print("|---|---|---|---|---|---|---|")
        for r in results:
            print(
                f"| {r.name} | {r.heavy_alone_s} | {r.probe_alone_s} s | {r.probe_median_s} s ({r.median_ratio}x) | "
                f"{r.p99_ratio}x | {r.probe_max_s} s ({r.max_ratio}x) | {r.load_average} |"
            )
    if args.json:
        payload = {"model": path.name, "probe_alone_s": round(alone, 4), "rows": [asdict(r) for r in results]}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
