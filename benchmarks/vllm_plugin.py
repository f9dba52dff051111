"""The cost of per-request k inside vLLM, in one run on the same machine:

    python -m benchmarks.vllm_plugin [--models tiny,medium] [--batches 1,16,64] [--reps 3]

Greedy tokens/s at the models' k (2) of vLLM loading the artifact through moe_serve.vllm_plugin (k per
request, eager), stock vLLM on the same weights as a Hugging Face checkpoint (k fixed at load; compiled,
its default, and eager) and moe-serve's own engine; each in its own worker process (benchmarks.engines).
Runs in the environment with vLLM and the plugin installed (`make bench` builds it). Results go to
benchmarks/results/vllm_plugin.{json,md}.
"""

from __future__ import annotations

import argparse

from benchmarks.models import build
from benchmarks.run import common_arguments, started, throughput_cells, throughput_table, write_results

ENGINES = ("vllm-plugin", "vllm-eager", "vllm", "moe-serve")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser, "vllm_plugin.json")
    args = parser.parse_args()
    models = {name: build(name, args.cache) for name in args.models.split(",")}
    report = {"started": started(), "throughput": throughput_cells(models, {e: e for e in ENGINES}, args)}
    write_results(report, markdown(report), args.out)


def markdown(report: dict) -> str:
    lines = []
    for name, engines in report["throughput"].items():
        lines += throughput_table(name, "engine", engines)
        plugin = engines.get("vllm-plugin")
        if isinstance(plugin, dict):
            lines.append("")
            for other in ("vllm-eager", "vllm", "moe-serve"):
                cells = engines.get(other)
                if isinstance(cells, dict):
                    ratios = ", ".join(f"batch {b}: {plugin[b]['median'] / cells[b]['median']:.2f}x" for b in plugin)
                    lines.append(f"- vllm-plugin / {other} (medians): {ratios}")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
