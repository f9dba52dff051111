"""The side-by-side benchmark (docs/architecture.md §10), one command, every engine in the same run on the same
machine:

    python -m benchmarks.run [--models tiny,medium] [--engines moe-serve,hf,vllm,vllm-eager] [--reps 3]

- greedy tokens/s of moe-serve, Hugging Face transformers `generate` and vLLM (CPU build; compiled and
  eager) on a tiny and a medium Mixtral-format model, batch 1, 16 and 64, `--reps` rounds in which the engines
  take turns (min/median/max);
- per-k decode cost on the medium model (ms per token at batch 1, per step at batch 16);
- the memory-bandwidth roofline (measured copy bandwidth / bytes one batch-1 decode step reads at k) and
  each engine's fraction of it;
- mixed traffic (64 concurrent vs sequential requests over HTTP), the stall when a 512-token prompt joins 16
  decodes, and KV memory allocated against its budget.

Each engine runs in its own process. vLLM comes from the `bench` extra (`make bench` installs it in
.venv-bench); an engine that cannot be imported is reported as missing, not silently dropped. Results go
to benchmarks/results/latest.json, and a markdown summary is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import bandwidth, mixed
from benchmarks.models import BenchModel, build

ROOT = Path(__file__).resolve().parent
ENGINES = ("moe-serve", "hf", "vllm", "vllm-eager")


def run_worker(
    engine: str,
    model: BenchModel,
    batches: list[int],
    ks: list[int],
    reps: int,
    new_tokens: int,
    timeout: int,
    decode_cost: bool = False,
) -> dict | str:
    """{k: {batch: [tok/s ...]}} (with decode_cost, benchmarks.engines.measure_decode's cells), or the
    reason it could not run."""
    model_dir = model.artifact if engine.startswith("moe-serve") or engine == "vllm-plugin" else model.hf_dir
    command = [
        sys.executable,
        "-m",
        "benchmarks.engines",
        engine,
        str(model_dir),
        "--batches",
        ",".join(map(str, batches)),
        "--ks",
        ",".join(map(str, ks)),
        "--reps",
        str(reps),
        "--new-tokens",
        str(new_tokens),
        *(["--decode-cost"] if decode_cost else []),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT.parent)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout} s"
    for line in done.stdout.splitlines():
        if line.startswith("RESULTS "):
            return json.loads(line.removeprefix("RESULTS "))
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return "failed: " + " | ".join(tail)


def decode_cost(cell: dict[str, list[dict[str, float]]], bytes_per_step: int) -> dict[str, float]:
    """Medians over reps: ms per decode step at batch 1 and 16, and the batch-1 fraction of the roofline,
    each rep against the copy bandwidth measured next to it."""
    batch1, batch16 = cell["1"], cell["16"]
    fractions = [bytes_per_step / (rep["copy_gb_s"] * 1e9) / rep["step_s"] for rep in batch1]
    return {
        "ms_per_token_batch1": 1000 * statistics.median(rep["step_s"] for rep in batch1),
        "ms_per_step_batch16": 1000 * statistics.median(rep["step_s"] for rep in batch16),
        "roofline_fraction_batch1": statistics.median(fractions),
        "copy_gb_s": statistics.median(rep["copy_gb_s"] for rep in batch1),
    }


def throughput_table(title: str, label: str, cells: dict[str, dict | str]) -> list[str]:
    """Markdown: one row per engine (`throughput` cells), min / median / max per batch."""
    batches = next((list(c) for c in cells.values() if isinstance(c, dict)), [])
    lines = [
        f"### {title} (tok/s, min / median / max)",
        "",
        f"| {label} | " + " | ".join(f"batch {b}" for b in batches) + " |",
        "|---|" + "---|" * len(batches),
    ]
    for name, cell in cells.items():
        values = (
            cell
            if isinstance(cell, str)
            else " | ".join(f"{c['min']:.0f} / {c['median']:.0f} / {c['max']:.0f}" for c in cell.values())
        )
        lines.append(f"| {name} | {values} |")
    return lines


def common_arguments(parser: argparse.ArgumentParser, out_name: str, batches: str = "1,16,64") -> None:
    """The options every benchmark script takes (models, batches, repetitions, cache, output, timeout)."""
    parser.add_argument("--models", default="tiny,medium")
    parser.add_argument("--batches", default=batches)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("BENCH_CACHE", ROOT / ".cache")))
    parser.add_argument("--out", type=Path, default=ROOT / "results" / out_name)
    parser.add_argument("--timeout", type=int, default=3600)


def started() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def throughput_cells(models: dict[str, BenchModel], engines: dict[str, str], args: argparse.Namespace) -> dict:
    """{model: {label: {batch: min / median / max tok/s} or why the engine could not run}} for each engine
    (label -> benchmarks.engines name) at the model's own k, printed as run. The engines take turns, one
    repetition each per round (`--reps` rounds, each a fresh worker after its warm-up): a slow minute of this
    shared VM (runs of 2026-11-25 saw the first worker's minute at half speed) then lands on one repetition
    of every engine, not on all repetitions of one."""
    batches = [int(b) for b in args.batches.split(",")]
    cells: dict = {}
    for name, model in models.items():
        k = str(model.config["num_experts_per_tok"])
        rates: dict[str, dict[str, list[float]] | str] = {}
        for _ in range(args.reps):
            for label, engine in engines.items():
                if isinstance(rates.get(label), str):  # it failed in an earlier round
                    continue
                result = run_worker(engine, model, batches, [int(k)], 1, args.new_tokens, args.timeout)
                if isinstance(result, str):
                    rates[label] = result
                    continue
                for batch, values in result[k].items():
                    rates.setdefault(label, {}).setdefault(batch, []).extend(values)  # type: ignore[union-attr]
        for label, cell in rates.items():
            cells.setdefault(name, {})[label] = (
                cell if isinstance(cell, str) else {batch: summary(values) for batch, values in cell.items()}
            )
            print(f"{name} {label}: {cells[name][label]}", flush=True)
    return cells


def decode_costs(engine: str, model: BenchModel, ks: list[int], reps: int, timeout: int) -> dict[str, dict | str]:
    """{k: decode-cost cell (or the worker's failure)} at batch 1 and 16, from one worker."""
    result = run_worker(engine, model, [1, 16], ks, reps, 33, timeout, decode_cost=True)
    cells = {}
    for k in ks:
        cell = result.get(str(k), {}) if isinstance(result, dict) else result
        cells[str(k)] = decode_cost(cell, model.decode_bytes(k)) if isinstance(cell, dict) else cell
    return cells


def summary(rates: list[float]) -> dict[str, float]:
    return {"min": min(rates), "median": statistics.median(rates), "max": max(rates)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser, "latest.json")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--k-sweep", default="1,2,4,8,16", help="ks of the per-k cost on the medium model")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: throughput,ksweep,mixed")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    engines = args.engines.split(",")
    report: dict = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "started": started(),
        "settings": vars(args) | {"cache": str(args.cache), "out": str(args.out)},
    }
    report["bandwidth"] = bandwidth.copy_bandwidth()
    models = {name: build(name, args.cache) for name in args.models.split(",")}

    if "throughput" not in skip:
        report["throughput"] = throughput_cells(models, {engine: engine for engine in engines}, args)

    if "ksweep" not in skip and "medium" in models:
        model = models["medium"]
        ks = [int(k) for k in args.k_sweep.split(",")]
        report["k_sweep"] = {}
        for engine in engines:
            runs = [(engine, ks)] if engine in ("moe-serve", "hf") else [(engine, [k]) for k in ks]
            for name, run_ks in runs:
                report["k_sweep"].setdefault(engine, {}).update(
                    decode_costs(name, model, run_ks, args.reps, args.timeout)
                )
            print(f"k sweep {engine}: {report['k_sweep'].get(engine)}", flush=True)
        bandwidth_gb_s = report["bandwidth"]["copy_gb_s"]
        report["roofline"] = {
            str(k): {"bytes_per_step": model.decode_bytes(k), "tok_s": bandwidth_gb_s * 1e9 / model.decode_bytes(k)}
            for k in ks
        }

    if "mixed" not in skip:
        tiny = models.get("tiny") or build("tiny", args.cache)
        report["mixed"] = {
            "concurrent_vs_sequential": mixed.concurrent_vs_sequential(tiny.artifact),
            "join_stall": {name: mixed.join_stall(m.artifact) for name, m in models.items()},
            "kv_memory": mixed.kv_memory(tiny.artifact, 64 << 20),
        }
        print(f"mixed: {report['mixed']}", flush=True)

    write_results(report, markdown(report), args.out)


def write_results(report: dict, text: str, out: Path) -> None:
    """The report as JSON at `out`, its markdown beside it (.md) and on stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


def markdown(report: dict) -> str:
    lines = [
        f"copy bandwidth {report['bandwidth']['copy_gb_s']:.1f} GB/s (read {report['bandwidth']['read_gb_s']:.1f})",
        "",
    ]
    for name, engines in report.get("throughput", {}).items():
        lines += throughput_table(name, "engine", engines)
        ours = engines.get("moe-serve")
        peers = {e: c for e, c in engines.items() if e != "moe-serve" and isinstance(c, dict)}
        if isinstance(ours, dict) and peers:
            ratios = []
            for batch in ours:
                best = max(c[batch]["median"] for c in peers.values() if batch in c)
                ratios.append(f"batch {batch}: {ours[batch]['median'] / best:.2f}x")
            lines += ["", "moe-serve / best peer (medians): " + ", ".join(ratios)]
        lines.append("")
    if "k_sweep" in report:
        lines += [
            "### per-k decode cost, medium (ms per decode step at batch 1 / at batch 16; prefill excluded, "
            "medians of the reps)",
            "",
        ]
        ks = list(next(iter(report["k_sweep"].values())).keys())
        lines += ["| engine | " + " | ".join(f"k={k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
        for engine, cells in report["k_sweep"].items():
            lines.append(
                f"| {engine} | "
                + " | ".join(
                    f"{c['ms_per_token_batch1']:.1f} / {c['ms_per_step_batch16']:.0f}"
                    if isinstance(c, dict)
                    else str(c)
                    for c in cells.values()
                )
                + " |"
            )
        roof = report["roofline"]
        lines += [
            "",
            "roofline at batch 1 at the run's opening bandwidth (tok/s; bytes per step): "
            + ", ".join(f"k={k}: {r['tok_s']:.1f} ({r['bytes_per_step'] / 1e6:.0f} MB)" for k, r in roof.items()),
            "",
            "fraction of the roofline at batch 1, each rep against the copy bandwidth measured next to it "
            "(median; that bandwidth in GB/s):",
        ]
        for engine, cells in report["k_sweep"].items():
            fractions = [
                f"k={k}: {100 * c['roofline_fraction_batch1']:.0f}% ({c['copy_gb_s']:.1f})"
                for k, c in cells.items()
                if isinstance(c, dict)
            ]
            lines.append(f"- {engine}: " + ", ".join(fractions))
        lines.append("")
    if "mixed" in report:
        m = report["mixed"]
        c = m["concurrent_vs_sequential"]
        lines.append(
            f"- {c['requests']} mixed-length requests over HTTP: sequential {c['sequential_s']:.1f} s, "
            f"concurrent {c['concurrent_s']:.1f} s ({c['speedup']:.1f}x)"
        )
        for name, s in m["join_stall"].items():
            lines.append(
                f"- {name}: a 512-token prompt joining 16 decodes: longest step {s['max_join_step_ms']:.1f} ms "
                f"= {s['stall_in_decode_steps']:.1f} decode steps ({s['decode_step_ms']:.1f} ms), "
                f"over {s['join_steps']} steps (median of "
                + " / ".join(f"{r:.1f}" for r in s.get("stall_repetitions", [s["stall_in_decode_steps"]]))
                + ")"
            )
        kv = m["kv_memory"]
        lines.append(
            f"- KV cache: budget {kv['budget_bytes'] / 2**20:.0f} MiB, "
            f"allocated {kv['allocated_bytes'] / 2**20:.2f} MiB "
            f"({kv['blocks']} blocks, {kv['tokens']} tokens)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
