"""The onnxruntime backend against the torch backend, in one run on the same machine (issue: ONNX export):

    python -m benchmarks.onnx_backend [--models tiny,medium] [--reps 3]

- greedy tokens/s at batch 1 and 16 on the benchmark models (benchmarks.models), both backends behind the
  same engine (scheduler, paged cache, sampling), each in its own worker process (benchmarks.engines);
- per-k decode cost on the medium model (ms per token at batch 1, per step at batch 16).

The first onnxruntime worker exports the artifact into the ONNX cache (not timed: the warm-up run follows
the load). Results go to benchmarks/results/onnx_backend.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks.models import build
from benchmarks.run import ROOT, decode_cost, run_worker, throughput, throughput_table, write_results

BACKENDS = {"torch": "moe-serve", "onnxruntime": "moe-serve-onnx"}  # backend -> benchmarks.engines name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,medium")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k-sweep", default="1,2,4,8,16")
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("BENCH_CACHE", ROOT / ".cache")))
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "onnx_backend.json")
    parser.add_argument("--timeout", type=int, default=3600)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "throughput": {}, "k_sweep": {}}
    models = {name: build(name, args.cache) for name in args.models.split(",")}
    for name, model in models.items():
        for backend, engine in BACKENDS.items():
            cell = throughput(engine, model, batches, args.reps, args.new_tokens, args.timeout)
            report["throughput"].setdefault(name, {})[backend] = cell
            print(f"{name} {backend}: {cell}", flush=True)
    if "medium" in models:
        ks = [int(k) for k in args.k_sweep.split(",")]
        for backend, engine in BACKENDS.items():
            result = run_worker(engine, models["medium"], [1, 16], ks, args.reps, 33, args.timeout, decode_cost=True)
            for k in ks:
                cell = result.get(str(k), {}) if isinstance(result, dict) else result
                if isinstance(cell, dict):
                    cell = decode_cost(cell, models["medium"].decode_bytes(k))
                report["k_sweep"].setdefault(backend, {})[str(k)] = cell
            print(f"k sweep {backend}: {report['k_sweep'][backend]}", flush=True)
    write_results(report, markdown(report), args.out)


def markdown(report: dict) -> str:
    lines = []
    for name, backends in report["throughput"].items():
        lines += throughput_table(f"{name}: greedy", "backend", backends)
        torch_cell, onnx_cell = backends.get("torch"), backends.get("onnxruntime")
        if isinstance(torch_cell, dict) and isinstance(onnx_cell, dict):
            ratios = ", ".join(
                f"batch {b}: {onnx_cell[b]['median'] / torch_cell[b]['median']:.2f}x" for b in torch_cell
            )
            lines += ["", f"onnxruntime / torch (medians): {ratios}"]
        lines.append("")
    if report["k_sweep"]:
        ks = list(next(iter(report["k_sweep"].values())))
        lines += ["### medium, per k: ms per decode step at batch 1 / at batch 16 (prefill excluded)", ""]
        lines += ["| backend | " + " | ".join(f"k={k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
        for backend, cells in report["k_sweep"].items():
            values = " | ".join(
                f"{c['ms_per_token_batch1']:.1f} / {c['ms_per_step_batch16']:.0f}" if isinstance(c, dict) else str(c)
                for c in cells.values()
            )
            lines.append(f"| {backend} | {values} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
