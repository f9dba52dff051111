"""Mixed traffic on moe-serve's engine: concurrent vs sequential requests of mixed prompt lengths through a
real HTTP server, the stall when a long prompt joins running decodes, and KV memory against its budget."""

from __future__ import annotations

import asyncio
import random
import statistics
import threading
import time
from pathlib import Path

import torch

from moe_serve import EngineConfig, SamplingParams
from moe_serve.artifact import load_artifact
from moe_serve.engine.llm_engine import LLMEngine


def serve_in_thread(app) -> tuple:
    """A real uvicorn server for `app` on 127.0.0.1 (a free port), running in a daemon thread -> (server,
    thread, port); stop it with `server.should_exit = True` and `thread.join()`."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, server.servers[0].sockets[0].getsockname()[1]


def join_stall(
    artifact_dir: Path, decodes: int = 16, long_prompt: int = 512, threads: int = 2, repetitions: int = 3
) -> dict[str, float | list[float]]:
    """Step times while `decodes` sequences decode and a long prompt joins: the stall in decode steps (the
    longest step of the join over the median decode step just before it). One joining prompt after another,
    `repetitions` times, each new (no prefix-cache hit); the median of the repetitions is the figure, as
    for every other figure of the benchmark: on a 2-vCPU VM a plain decode step alone sometimes takes
    twice the median."""
    torch.set_num_threads(threads)
    config = EngineConfig(max_num_seqs=decodes + 1)
    engine = LLMEngine(load_artifact(artifact_dir), config, torch.device("cpu"))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    for i in range(decodes):
        engine.add_request(f"d{i}", engine.inputs.generation_request([rng.randrange(257) for _ in range(32)], params))
    for _ in range(20):  # the prompts' prefill, then decode steps (the cost model learns both)
        engine.step()
    reps = []
    for rep in range(repetitions):
        timed = []
        for _ in range(20):
            start = time.perf_counter()
            engine.step()
            timed.append(time.perf_counter() - start)
        decode_step = statistics.median(timed)
        prompt = [rng.randrange(257) for _ in range(long_prompt)]
        # Not 1 token: a finished sequence frees its blocks and resets num_computed_tokens, which the loop reads.
        long_params = SamplingParams(max_tokens=8, temperature=0)
        (seq,) = engine.add_request(f"long{rep}", engine.inputs.generation_request(prompt, long_params))
        joined = []
        while seq.num_computed_tokens < long_prompt:
            start = time.perf_counter()
            engine.step()
            joined.append(time.perf_counter() - start)
        reps.append((max(joined) / decode_step, decode_step, max(joined), len(joined)))
    stall, decode_step, longest, steps = sorted(reps)[len(reps) // 2]
    return {
        "decode_step_ms": 1000 * decode_step,
        "max_join_step_ms": 1000 * longest,
        "stall_in_decode_steps": stall,
        "stall_repetitions": [r[0] for r in reps],
        "join_steps": steps,
    }


def kv_memory(artifact_dir: Path, budget: int) -> dict[str, int]:
    """What the cache allocates for a byte budget: never more than the budget."""
    engine = LLMEngine(load_artifact(artifact_dir), EngineConfig(kv_cache_memory=budget), torch.device("cpu"))
    shape = engine.cache_shape
    slots = {id(pair): pair for pair in engine.runner.cache.layers}.values()  # layers of KV groups share a slot's
    allocated = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in slots)
    return {
        "budget_bytes": budget,
        "allocated_bytes": allocated,
        "blocks": shape.num_blocks,
        "tokens": shape.sequence_tokens,  # one sequence's, as if no KV group gave blocks back
    }


def concurrent_vs_sequential(artifact_dir: Path, requests: int = 64, max_tokens: int = 32) -> dict[str, float]:
    """The same mixed-length requests through a real uvicorn server: one at a time, then all at once."""
    import httpx

    from moe_serve.server.app import create_app
    from moe_serve.server.settings import ServerSettings

    settings = ServerSettings(models=(str(artifact_dir),), port=0, engine=EngineConfig(max_num_seqs=requests))
    server, thread, port = serve_in_thread(create_app(settings))
    rng = random.Random(1)
    bodies = [
        {
            "prompt": [rng.randrange(257) for _ in range(rng.choice([8, 32, 128, 400]))],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for _ in range(requests)
    ]

    async def run() -> tuple[float, float]:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:
            start = time.perf_counter()
            for body in bodies:
                (await http.post("/v1/completions", json=body)).raise_for_status()
            sequential = time.perf_counter() - start
            start = time.perf_counter()
            for response in await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies)):
                response.raise_for_status()
            return sequential, time.perf_counter() - start

    try:
        sequential, concurrent = asyncio.run(run())
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    return {
        "requests": requests,
        "sequential_s": sequential,
        "concurrent_s": concurrent,
        "speedup": sequential / concurrent,
    }
