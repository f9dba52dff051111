"""Where a decode step's time goes: `batch` greedy sequences decode together and every kernel call of the
decode-only steps is timed, grouped by what it computes (linear calls by their weight: the LM head, the
routers, the other projections). What no kernel accounts for is the host's share: scheduling, batch
building, sampling, detokenizing. Then the same steps run with every C++ kernel call answered from a cache
(python_floor): what a step costs besides the kernels.

    python -m benchmarks.profile_step MODEL_DIR [--batch 64] [--k 2] [--steps 16] [--threads 2] [--weights int4]
        [--cpu-activations auto]

The profile runs the Python layers (the kernel calls are theirs); then the same steps run with the C++ decode
stack (moe_serve.engine.decode_stack), which calls the same kernels from C++ (layers, final norm and LM head)
and times each part itself (DecodeStack.set_timing): its step time less those parts is the host time left.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from collections.abc import Callable
from unittest import mock

import torch

from moe_serve import LLM, EngineConfig, SamplingParams
from moe_serve.kernels import cpu_extension, ops
from moe_serve.kernels.packed import CPU_ACTIVATIONS

TIMED = ("linear", "moe_experts", "attention", "rotary_write", "rms_norm", "topk_route")


class KernelTimer:
    """Wraps the kernel entry points of `moe_serve.kernels.ops` (the layers call them through the module)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.seconds: dict[str, float] = defaultdict(float)
        self.enabled = False
        for name in TIMED:
            setattr(ops, name, self._wrap(name, getattr(ops, name)))

    def _label(self, name: str, args: tuple) -> str:
        if name != "linear":
            return {"moe_experts": "experts", "topk_route": "routing (top-k)"}.get(name, name)
        out_features = args[1].shape[0]
        if out_features == self.vocab_size:
            return "linear: LM head"
        return "linear: router" if out_features <= 256 else "linear: attention projections"

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if not self.enabled:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            self.seconds[self._label(name, args)] += time.perf_counter() - start
            return result

        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weights", default=None, help="pack the weights at load: bf16, int8, int4")
    parser.add_argument("--cpu-activations", default="fp32", choices=CPU_ACTIVATIONS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    llm = decoding(args, decode_stack=False)
    timer = KernelTimer(llm.config.vocab_size)
    timer.enabled = True
    total = time_steps(llm, args.steps)
    timer.enabled = False

    per_step = {label: seconds / args.steps for label, seconds in timer.seconds.items()}
    kernels = sum(per_step.values())
    per_step["host (scheduling, batch building, sampling, detokenizing)"] = total - kernels
    weights = args.weights or "float"
    print(f"{args.model_dir} ({weights} weights): batch {args.batch}, k={args.k}: {total * 1e3:.2f} ms per decode step")
    print("| part | ms per step | share |\n|---|---|---|")
    for label, seconds in sorted(per_step.items(), key=lambda item: -item[1]):
        print(f"| {label} | {seconds * 1e3:.2f} | {seconds / total:.0%} |")
    floor = python_floor(llm, args.steps)
    print(f"with every C++ kernel call answered from a cache (the Python and torch glue): {floor * 1e3:.2f} ms")
    del llm
    llm = decoding(args, decode_stack=True)
    stack = llm.engine.runner.decode_stack
    if stack is None:
        print("the C++ decode stack does not run this model (see the log)")
        return
    calls = [0.0]  # seconds inside the stack's calls
    logits = stack.logits

    def timed_logits(*args):  # noqa: ANN002, ANN202
        start = time.perf_counter()
        result = logits(*args)
        calls[0] += time.perf_counter() - start
        return result

    stack.logits = timed_logits  # type: ignore[method-assign]
    stack.set_timing(True)
    stack.timings()  # the sums start here
    stacked = time_steps(llm, args.steps)
    parts = {part: seconds / args.steps for part, seconds in stack.timings().items()}
    inside, call = sum(parts.values()), calls[0] / args.steps
    parts["the stack's glue between kernels (residual adds, splits, the pybind call)"] = call - inside
    parts["host (scheduling, batch building, embedding, sampling, detokenizing)"] = stacked - call
    print(f"\nwith the C++ decode stack (its own timers): {stacked * 1e3:.2f} ms per decode step")
    print("| part | ms per step | share |\n|---|---|---|")
    for label, seconds in sorted(parts.items(), key=lambda item: -item[1]):
        print(f"| {label} | {seconds * 1e3:.2f} | {seconds / stacked:.0%} |")
    print(f"host time: {(total - kernels) * 1e3:.2f} ms with the Python layers -> {(stacked - call) * 1e3:.2f} ms")


def decoding(args: argparse.Namespace, decode_stack: bool) -> LLM:
    """An engine with `args.batch` sequences past their prompts: every later step decodes only."""
    config = EngineConfig(
        max_num_seqs=args.batch,
        weights=args.weights,
        cpu_activations=getattr(args, "cpu_activations", "fp32"),
        cpu_decode_stack=decode_stack,
    )
    llm = LLM(args.model_dir, config)
    params = SamplingParams(max_tokens=4 * args.steps + 8, temperature=0, ignore_eos=True, experts_per_token=args.k)
    rng = random.Random(0)
    vocab = min(llm.config.vocab_size, 257)
    seqs = []
    for i in range(args.batch):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        seqs += llm.engine.add_request(f"profile-{i}", llm.inputs.generation_request(prompt, params))
    while not all(seq.num_output_tokens for seq in seqs):  # every prompt prefilled: only decodes from here
        llm.engine.step()
    llm.engine.step()  # one untimed decode step
    return llm


def time_steps(llm: LLM, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    return (time.perf_counter() - start) / steps


def python_floor(llm: LLM, steps: int) -> float:
    """Seconds per decode step when each C++ kernel call returns the result its first call with those shapes
    computed: what the step costs besides the kernels (what no kernel speed-up can remove)."""
    ext = cpu_extension()
    if ext is None:
        return float("nan")
    results: dict = {}

    class Cached:
        def __getattr__(self, name: str) -> Callable:
            kernel = getattr(ext, name)

            def call(*args):  # noqa: ANN002, ANN202
                key = (name, tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args))
                if key not in results:
                    results[key] = kernel(*args)
                return results[key]

            setattr(self, name, call)  # one wrapper per kernel: later lookups skip __getattr__
            return call

    cached = Cached()
    with mock.patch.object(ops, "cpu_extension", lambda: cached):
        llm.engine.step()  # fills the cache
        start = time.perf_counter()
        for _ in range(steps):
            llm.engine.step()
        return (time.perf_counter() - start) / steps


if __name__ == "__main__":
    main()
