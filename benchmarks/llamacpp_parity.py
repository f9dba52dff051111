"""Parity before speed: llama.cpp's greedy tokens against moe-serve's on the same weights at fp32 (the F32 GGUF
against the fp32 artifact), at each k, for random prompts decoded together (llama.cpp's multi-sequence batch,
the path the benchmark times) and one at a time; and how far apart the two engines' log-probabilities of those
tokens are (llama.cpp's from one pass over prompt + completion), beside the smallest top-1/top-2 margin,
which says how close a near-tie came to flipping a token.

    python -m benchmarks.llamacpp_parity [--models tiny] [--ks 1,2,N] [--prompts 4] [--new-tokens 32]

Prints one line per model and k and, for each sequence that differs, the first position where it does; exits 1
when any does. Both engines run in this process, two threads each.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from benchmarks import llamacpp
from benchmarks.engines import moe_serve_runner, random_prompts
from benchmarks.models import DEFAULT_CACHE, BenchModel, build


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)


def differences(ours: list[list[int]], runs: dict[str, list[list[int]]]) -> list[str]:
    return [
        f"{how}: prompt {i} from token {at}"
        for how, outputs in runs.items()
        for i, (a, b) in enumerate(zip(ours, outputs, strict=True))
        if (at := first_difference(a, b)) is not None
    ]


def logprob_gap(generator: llamacpp.LlamaCppGenerator, prompts: list[list[int]], completions: list) -> str:
    """The largest |moe-serve logprob - llama.cpp logprob| over moe-serve's tokens, and llama.cpp's smallest
    margin between its top two tokens at those positions."""
    import numpy as np

    gaps, margins = [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        rows = generator.log_probs(prompt + completion.token_ids)[len(prompt) - 1 : -1]  # row t predicts t + 1
        theirs = rows[np.arange(len(rows)), completion.token_ids]
        gaps.append(np.abs(theirs - np.asarray(completion.logprobs)).max())
        top2 = np.sort(rows, axis=1)[:, -2:]
        margins.append((top2[:, 1] - top2[:, 0]).min())
    return f"max |logprob difference| {max(gaps):.1e}, smallest top-2 margin {min(margins):.1e}"


def check(model: BenchModel, ks: list[int], prompts: list[list[int]], new_tokens: int, threads: int) -> bool:
    """Every k: moe-serve's tokens against llama.cpp's, batched and one prompt at a time; True when all equal."""
    lcpp = llamacpp.ensure_built(model.cache)
    gguf = llamacpp.ensure_gguf(model, "f32")
    moe_serve = moe_serve_runner(str(model.artifact), len(prompts), logprobs=True)
    max_len = len(prompts[0]) + new_tokens
    equal = True
    for k in ks:
        completions: list = moe_serve(prompts, k, new_tokens)  # type: ignore[assignment]
        ours = [c.token_ids for c in completions]
        settings = llamacpp.EngineSettings(k, len(prompts), max_len, threads)
        generator = llamacpp.LlamaCppGenerator(lcpp, gguf, settings)
        runs = {
            "batched": generator.generate(prompts, new_tokens),
            "alone": [generator.generate([prompt], new_tokens)[0] for prompt in prompts],
        }
        found = differences(ours, runs)
        equal &= not found
        verdict = "equal" if not found else "DIFFER: " + "; ".join(found)
        gap = logprob_gap(generator, prompts, completions)
        print(f"{model.name} k={k}: {len(prompts)} prompts x {new_tokens} tokens, batched and alone: {verdict}; {gap}")
        if found:
            print(f"  moe-serve {ours}\n  llama.cpp {runs['batched']}")
        generator.close()
    return equal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny")
    parser.add_argument("--ks", default="1,2,N", help="N: all of the model's experts")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=257, help="prompt token ids are drawn below this")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    prompts = random_prompts(random.Random(0), args.prompts, args.prompt_len, args.vocab)
    equal = True
    for name in args.models.split(","):
        model = build(name, args.cache)
        equal &= check(model, model.ks(args.ks), prompts, args.new_tokens, args.threads)
    sys.exit(0 if equal else 1)


if __name__ == "__main__":
    main()
