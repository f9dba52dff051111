"""Decode steps with fp32 and with rounded activations (--cpu-activations int8: int8 ones for int8 and int4
weights, bf16 ones for bf16 weights where the CPU has AVX-512 BF16), A/B: two engines on the same packed weights,
each with `batch` sequences decoding, take turns for `--rounds` rounds of `--steps` steps; the median ms per step
of each, the paired per-round ratios (fp32 / rounded: the speedup) with their spread, and the load average.

    python -m benchmarks.activations_ab [--model medium] [--weights int8,int4,bf16] [--batches 1,16,64] [--k 2]
        [--rounds 10] [--steps 10] [--json PATH]

The model is a benchmarks.models preset (built and cached on first use) or an artifact directory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.models import DEFAULT_CACHE, PRESETS, build
from moe_serve import LLM, EngineConfig, SamplingParams

MODES = ("fp32", "int8")  # int8: the lowest precision, so each format's own rounded activations


def engine(path: str, weights: str, activations: str, batch: int, k: int, steps: int) -> LLM:
    """An engine with `batch` sequences past their prompts, each with room for `steps` more tokens (the KV cache
    sized for them: the default budget would take a large share of memory twice over)."""
    tokens = batch * (32 + steps + 8) + 256
    config = EngineConfig(max_num_seqs=batch, weights=weights, cpu_activations=activations, kv_cache_tokens=tokens)
    llm = LLM(path, config)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True, experts_per_token=k)
    seqs = []
    for i in range(batch):
        prompt = [(7 * i + j) % 900 + 1 for j in range(32)]
        seqs += llm.engine.add_request(f"ab-{i}", llm.inputs.generation_request(prompt, params))
    while not all(s.num_output_tokens for s in seqs):  # past the prompts: every later step decodes only
        llm.engine.step()
    return llm


def measure(path: str, weights: str, batch: int, k: int, rounds: int, steps: int) -> dict:
    engines = {mode: engine(path, weights, mode, batch, k, rounds * steps) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode, llm in engines.items():  # the two take turns: drift on the machine falls on both
            start = time.perf_counter()
            for _ in range(steps):
                llm.engine.step()
            times[mode].append((time.perf_counter() - start) / steps)
    ratios = [a / b for a, b in zip(times["fp32"], times["int8"], strict=True)]
    return {
        "weights": weights,
        "activations": engines["int8"].artifact.weights_label,
        "batch": batch,
        "k": k,
        "fp32_ms": round(statistics.median(times["fp32"]) * 1e3, 3),
        "rounded_ms": round(statistics.median(times["int8"]) * 1e3, 3),
        "speedup_median": round(statistics.median(ratios), 3),
        "speedup_min": round(min(ratios), 3),
        "speedup_max": round(max(ratios), 3),
        "load_average": "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="medium", help=f"a preset ({', '.join(PRESETS)}) or an artifact directory")
    parser.add_argument("--weights", default="int8,int4")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(2)
    path = str(build(args.model, DEFAULT_CACHE).artifact) if args.model in PRESETS else args.model
    print(f"model {args.model}; load average {'{:.2f} {:.2f} {:.2f}'.format(*os.getloadavg())}", flush=True)
    rows = []
    for weights in args.weights.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            row = measure(path, weights, batch, args.k, args.rounds, args.steps)
            rows.append(row)
            print(
                f"{weights} batch {batch:>2} k={args.k}: fp32 activations {row['fp32_ms']:.2f} ms/step, "
                f"{row['activations']} {row['rounded_ms']:.2f}; speedup {row['speedup_median']}x "
                f"(rounds {row['speedup_min']}-{row['speedup_max']}); load {row['load_average']}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
