"""Where a GPU decode step's time goes: the profile behind docs/gpu.md's step-time breakdown.

    python3 -m benchmarks.gpu_profile [--model large] [--out DIR]

On the model of benchmarks.gpu_check (random Mixtral-format weights in bf16, converted by exporters.hf), at
batch 1, 16 and 64 and k = 1 and 2, it reports for the CUDA-graph path, first with the routing of the first
GPU run (plain torch ops) and then as the code stands (moe_serve.kernels.cuda.routing): the median GPU time
of one graph replay (CUDA events around `replay`), the median wall time between the starts of two decode
steps, and the difference, which is the host's share of a step; then torch.profiler's table of the kernels
one step runs, by total GPU time. For the eager path it reports the same step period and the profiler's
table of host-side calls (launches, synchronisations, copies), which is what sets an eager step's time.
Text to stdout and OUT/gpu_profile.txt. On a machine without CUDA it runs the eager part on the tiny model,
to check the script.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_check import MODELS, QUICK, BenchSettings, build_hf, make_llm, prompts, timed_generate, to_artifact
from moe_serve.kernels import reference

ROWS = 22


class StepClock:
    """Wraps DecodeGraphs._run (graph replay) and the runner's execute: CUDA events around each replay, wall
    clock at each step's start."""

    def __init__(self, runner: Any) -> None:
        import torch

        self.torch = torch
        self.starts: list[float] = []
        self.events: list[tuple[Any, Any]] = []
        execute = runner.execute

        def timed_execute(output: Any) -> Any:
            self.starts.append(time.perf_counter())
            return execute(output)

        runner.execute = timed_execute
        graphs = getattr(runner, "decode_graphs", None)
        if graphs is not None and graphs.capture:
            run = graphs._run

            def timed_run(key: Any) -> Any:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                logits = run(key)
                end.record()
                self.events.append((begin, end))
                return logits

            graphs._run = timed_run

    def reset(self) -> None:
        self.starts.clear()
        self.events.clear()

    def summary(self) -> dict[str, float]:
        if self.torch.cuda.is_available():
            self.torch.cuda.synchronize()
        periods = [b - a for a, b in zip(self.starts[1:-1], self.starts[2:], strict=False)]  # decode steps only
        out = {"steps": len(self.starts), "step_period_ms": 1000 * statistics.median(periods) if periods else 0.0}
        if self.events:
            replay = statistics.median(a.elapsed_time(b) for a, b in self.events[1:])
            out["replay_gpu_ms"] = replay
            out["host_ms"] = out["step_period_ms"] - replay
        return out


def profile_table(llm: Any, batch_prompts: list[list[int]], sort_by: str, new_tokens: int) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        timed_generate(llm, batch_prompts, [2], new_tokens)
    return prof.key_averages().table(sort_by=sort_by, row_limit=ROWS, max_name_column_width=60)


def before_routing_kernels() -> contextlib.ExitStack:
    """The routing as the first GPU run measured it (benchmarks/results/gpu-check-h100-2026-11-27a.md): plain
    torch ops (reference.topk_route_torch, static_moe.align) instead of moe_serve.kernels.cuda.routing. Patched for
    the A/B only, on the same machine in the same run."""
    from unittest import mock

    from moe_serve.kernels import static_moe
    from moe_serve.kernels.cuda import moe, routing

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(routing, "topk_route", reference.topk_route_torch))
    stack.enter_context(mock.patch.object(moe, "align", static_moe.align))
    return stack


def step_cells(llm: Any, vocab: int, settings: BenchSettings, tokens: int, label: str) -> list[str]:
    clock = StepClock(llm.engine.runner)
    lines = []
    for batch in settings.batches:
        for k in (1, 2):
            batch_prompts = prompts(vocab, batch, settings.prompt_len, settings.seed)
            timed_generate(llm, batch_prompts, [k], 4)
            clock.reset()
            timed_generate(llm, batch_prompts, [k], tokens)
            lines.append(f"{label} batch {batch} k={k}: {clock.summary()}")
    return lines


def run(args: argparse.Namespace) -> str:
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model = args.model if cuda else "tiny"
    settings: BenchSettings = BenchSettings() if cuda else QUICK
    config = MODELS[model]
    vocab = config["vocab_size"]
    lines = [f"# gpu_profile: {model} on {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}"]
    hf = build_hf(config, device, settings.seed)
    artifact = to_artifact(hf, model)
    del hf
    if cuda:  # the A/B: each engine captures its own graphs under its own kernels
        with before_routing_kernels():
            llm = make_llm(artifact, device, True, settings)
            lines += step_cells(llm, vocab, settings, args.tokens, "before (torch routing)")
        del llm
        torch.cuda.empty_cache()
    batch_prompts = prompts(vocab, 1, settings.prompt_len, settings.seed)
    for graphs in (True, False) if cuda else (False,):
        llm = make_llm(artifact, device, graphs, settings)
        label = "graphs" if graphs else "eager"
        lines += step_cells(llm, vocab, settings, args.tokens, label)
        sort_by = "cuda_time_total" if graphs else "cpu_time_total"
        lines.append(f"\n## {label}, batch 1, k=2, {args.profile_tokens} tokens, by {sort_by}\n")
        lines.append(profile_table(llm, batch_prompts, sort_by, args.profile_tokens))
        if graphs:  # the same step's kernels, run eagerly through the static forward: what the graph holds
            graphs_path = llm.engine.runner.decode_graphs
            graphs_path.capture = False
            lines.append("\n## static forward run eagerly, batch 1, k=2, by cuda_time_total\n")
            lines.append(profile_table(llm, batch_prompts, "cuda_time_total", args.profile_tokens))
            graphs_path.capture = True
        del llm
        if cuda:
            torch.cuda.empty_cache()
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="large")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed per cell")
    parser.add_argument("--profile-tokens", type=int, default=6, help="tokens generated under the profiler")
    default_out = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path("gpu-check-out")
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args()
    text = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_profile.txt").write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
