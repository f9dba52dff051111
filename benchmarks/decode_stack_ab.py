"""The decode step with and without the C++ decode stack (moe_serve.engine.decode_stack), A/B: two engines on
the same model, each with one sequence decoding at batch 1, take turns for `--rounds` rounds of `--steps` steps;
the median ms per step of each, and their difference (the host glue the stack removes).

    python -m benchmarks.decode_stack_ab MODEL_DIR [--weights int8] [--k 2] [--rounds 10] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from moe_serve import LLM, EngineConfig, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--weights", default=None)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(2)
    engines = {}
    for stack in (False, True):
        llm = LLM(args.model_dir, EngineConfig(max_num_seqs=1, cpu_decode_stack=stack, weights=args.weights))
        budget = args.rounds * args.steps + 8
        params = SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True, experts_per_token=args.k)
        seqs = llm.engine.add_request("ab", llm.inputs.generation_request(list(range(1, 33)), params))
        while not seqs[0].num_output_tokens:  # past the prompt: every later step decodes only
            llm.engine.step()
        engines[stack] = llm
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for stack, llm in engines.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                llm.engine.step()
            times[stack].append((time.perf_counter() - start) / args.steps * 1e3)
    python, stacked = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"{args.model_dir} ({args.weights or 'float'} weights), batch 1, k={args.k}: Python layers {python:.2f} ms "
        f"per step, decode stack {stacked:.2f} ms ({python - stacked:.2f} ms less); load {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
