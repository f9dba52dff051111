"""The onnxruntime backend against the torch backend, in one run on the same machine:

    python -m benchmarks.onnx_backend [--models tiny,medium] [--reps 3]

- greedy tokens/s at batch 1 and 16 on the benchmark models (benchmarks.models), both backends behind the
  same engine (scheduler, paged cache, sampling), each in its own worker process (benchmarks.engines);
- per-k decode cost on the medium model (ms per token at batch 1, per step at batch 16).

The first onnxruntime worker exports the artifact into the ONNX cache (not timed: the warm-up run follows
the load). Results go to benchmarks/results/onnx_backend.{json,md}.
"""

from __future__ import annotations

import argparse

from benchmarks.models import build
from benchmarks.run import common_arguments, decode_costs, started, throughput_cells, throughput_table, write_results

BACKENDS = {"torch": "moe-serve", "onnxruntime": "moe-serve-onnx"}  # backend -> benchmarks.engines name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser, "onnx_backend.json", batches="1,16")
    parser.add_argument("--k-sweep", default="1,2,4,8,16")
    args = parser.parse_args()
    models = {name: build(name, args.cache) for name in args.models.split(",")}
    report: dict = {"started": started(), "throughput": throughput_cells(models, BACKENDS, args), "k_sweep": {}}
    if "medium" in models:
        ks = [int(k) for k in args.k_sweep.split(",")]
        for backend, engine in BACKENDS.items():
            report["k_sweep"][backend] = decode_costs(engine, models["medium"], ks, args.reps, args.timeout)
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
