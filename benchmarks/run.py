"""The side-by-side benchmark (docs/architecture.md §10), one command, every engine in the same run on the same
machine:

    python -m benchmarks.run [--models tiny,medium] [--engines moe-serve,hf,vllm,vllm-eager,llama.cpp] [--reps 3]
        [--formats fp32,bf16,int8,int4] [--ks 1,2,N]

- greedy tokens/s of moe-serve, Hugging Face transformers `generate`, vLLM (CPU build; compiled and eager) and
  llama.cpp (benchmarks.llamacpp) on a tiny and a medium Mixtral-format model, batch 1, 16 and 64, at each
  k of `--ks` (N: all experts), `--reps` rounds in which the engines take turns (min/median/max, each
  repetition with the 1-minute load average when its worker ended); in each weight format of `--formats`
  moe-serve's artifact against llama.cpp's GGUF (fp32-F32, bf16-BF16, int8-Q8_0, int4-Q4_0; the other
  engines run fp32 only);
- per-k decode cost on the medium model (ms per token at batch 1, per step at batch 16);
- the memory-bandwidth roofline (measured copy bandwidth / bytes one batch-1 decode step reads at k) and
  each engine's fraction of it;
- mixed traffic (64 concurrent vs sequential requests over HTTP), the stall when a 512-token prompt joins 16
  decodes, and KV memory allocated against its budget.

Each engine runs in its own process. vLLM comes from the `bench` extra (`make bench` installs it in
.venv-bench), llama.cpp from `make llamacpp` (built here when missing); an engine that cannot be imported,
built or given the format is reported as missing, with the reason, not silently dropped. Results go to
benchmarks/results/latest.json, and a markdown summary is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import bandwidth, llamacpp, mixed
from benchmarks.models import DEFAULT_CACHE, BenchModel, build

ROOT = Path(__file__).resolve().parent
ENGINES = ("moe-serve", "hf", "vllm", "vllm-eager", "llama.cpp")


@dataclass(frozen=True, slots=True)
class FormatPair:
    """One row group of the formats table: moe-serve's artifact weights and the llama.cpp GGUF type paired
    with them (activations and KV cache stay fp32 in both)."""

    name: str  # moe-serve's (moe_serve.quantize): fp32, bf16, int8, int4
    gguf: str  # llama.cpp's (benchmarks.llamacpp.GGUF_TYPES)


FORMATS = {
    f.name: f
    for f in (
        FormatPair("fp32", "f32"),
        FormatPair("bf16", "bf16"),
        FormatPair("int8", "q8_0"),
        FormatPair("int4", "q4_0"),
    )
}
# The engines that run every format; the rest run fp32 only. moe-serve-auto is moe-serve with --cpu-activations
# auto (each packed format's own activation precision), run in the packed formats only (fp32 weights: the same).
QUANTIZED_ENGINES = ("moe-serve", "moe-serve-auto", "llama.cpp")
OURS = ("moe-serve", "moe-serve-auto")


class Unavailable(Exception):
    """An engine cannot run this model in this format; the message says why (it becomes the engine's cell)."""


def artifact(model: BenchModel, weights: str) -> Path:
    """moe-serve's artifact in these weights: the fp32 one, or its quantized copy beside it (artifact-int8, ...),
    made once by moe_serve.quantize."""
    if weights == "fp32":
        return model.artifact
    out = model.artifact.with_name(f"artifact-{weights}")
    if (out / "config.json").is_file():
        return out
    try:
        from moe_serve.quantize import quantize_artifact
    except ImportError as error:
        raise Unavailable(
            f"no {weights} artifact: moe_serve.quantize.quantize_artifact unavailable ({error})"
        ) from None
    partial = out.with_name(out.name + ".partial")  # renamed when complete: an interrupted run is redone
    shutil.rmtree(partial, ignore_errors=True)
    try:
        quantize_artifact(model.artifact, partial, weights)
    except Exception as error:  # its cell says why; the rest of the run goes on
        raise Unavailable(f"quantize_artifact({weights}) failed: {error!r}") from None
    partial.rename(out)
    return out


def model_input(engine: str, model: BenchModel, weights: str = "fp32") -> Path:
    """What the engine's worker loads: an artifact, the Hugging Face checkpoint or a GGUF file (built and
    converted here when missing, so that no worker's time includes it)."""
    if engine == "llama.cpp":
        try:
            llamacpp.ensure_built(model.cache)  # the worker loads the library too, not only the file
            return llamacpp.ensure_gguf(model, FORMATS[weights].gguf)
        except (OSError, SystemExit, subprocess.CalledProcessError) as error:
            raise Unavailable(f"llama.cpp unavailable: {error}") from None
    if engine.startswith("moe-serve") or engine == "vllm-plugin":
        return artifact(model, weights)
    if weights != "fp32":
        raise Unavailable(f"{engine} runs fp32 only")
    return model.hf_dir


def run_worker(
    engine: str,
    model: BenchModel,
    batches: list[int],
    ks: list[int],
    reps: int,
    new_tokens: int,
    timeout: int,
    decode_cost: bool = False,
    weights: str = "fp32",
) -> dict | str:
    """{k: {batch: [tok/s ...]}} (with decode_cost, benchmarks.engines.measure_decode's cells), or the
    reason it could not run."""
    try:
        model_dir = model_input(engine, model, weights)
    except Unavailable as error:
        return str(error)
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
        "--cache",
        str(model.cache),
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
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / out_name)
    parser.add_argument("--timeout", type=int, default=3600)


def started() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def throughput_cells(models: dict[str, BenchModel], engines: dict[str, str], args: argparse.Namespace) -> dict:
    """{model: {label: {batch: min / median / max tok/s} or why the engine could not run}} for each engine
    (label -> benchmarks.engines name) at the model's own k, printed as run (`rounds`)."""
    cells: dict = {}
    for name, model in models.items():
        cells[name] = rounds(model, engines, model.config["num_experts_per_tok"], args)
        for label, cell in cells[name].items():
            print(f"{name} {label}: {cell}", flush=True)
    return cells


def format_cells(
    models: dict[str, BenchModel], engines: list[str], formats: list[str], ks: str, args: argparse.Namespace
) -> dict:
    """{model: {format: {k: {engine: cell}}}}: in each weight format the engines that run it (`rounds`)."""
    cells: dict = {}
    for name, model in models.items():
        for weights in formats:
            chosen = {
                e: e
                for e in engines
                if (weights == "fp32" and e != "moe-serve-auto") or (weights != "fp32" and e in QUANTIZED_ENGINES)
            }
            for k in model.ks(ks):
                cell = rounds(model, chosen, k, args, weights)
                cells.setdefault(name, {}).setdefault(weights, {})[str(k)] = cell
                for label, c in cell.items():
                    print(f"{name} {weights} k={k} {label}: {c}", flush=True)
    return cells


def rounds(
    model: BenchModel, engines: dict[str, str], k: int, args: argparse.Namespace, weights: str = "fp32"
) -> dict[str, dict | str]:
    """{label: {batch: min / median / max tok/s and the load averages} or why the engine could not run}. The
    engines take turns, one repetition each per round (`--reps` rounds, each a fresh worker after its warm-up):
    a slow minute of this shared VM (runs of 2026-11-25 saw the first worker's minute at half speed) then lands
    on one repetition of every engine, not on all repetitions of one. Each repetition keeps the 1-minute load
    average when its worker ended (the worker's own two threads count for up to 2 of it)."""
    batches = [int(b) for b in args.batches.split(",")]
    rates: dict[str, dict[str, list[float]] | str] = {}
    loads: dict[str, list[float]] = {}
    for label, engine in engines.items():  # conversions and quantization first: out of every worker's minute
        try:
            model_input(engine, model, weights)
        except Unavailable as error:
            rates[label] = str(error)
    for _ in range(args.reps):
        for label, engine in engines.items():
            if isinstance(rates.get(label), str):  # unavailable, or it failed in an earlier round
                continue
            result = run_worker(engine, model, batches, [k], 1, args.new_tokens, args.timeout, weights=weights)
            if isinstance(result, str):
                rates[label] = result
                continue
            loads.setdefault(label, []).append(os.getloadavg()[0])
            for batch, values in result[str(k)].items():
                rates.setdefault(label, {}).setdefault(batch, []).extend(values)  # type: ignore[union-attr]
    return {
        label: cell if isinstance(cell, str) else {b: summary(v, loads[label]) for b, v in cell.items()}
        for label, cell in rates.items()
    }


def decode_costs(engine: str, model: BenchModel, ks: list[int], reps: int, timeout: int) -> dict[str, dict | str]:
    """{k: decode-cost cell (or the worker's failure)} at batch 1 and 16, from one worker."""
    result = run_worker(engine, model, [1, 16], ks, reps, 33, timeout, decode_cost=True)
    cells = {}
    for k in ks:
        cell = result.get(str(k), {}) if isinstance(result, dict) else result
        cells[str(k)] = decode_cost(cell, model.decode_bytes(k)) if isinstance(cell, dict) else cell
    return cells


def summary(rates: list[float], loads: list[float] | None = None) -> dict:
    """min / median / max of the repetitions' rates, and the load average beside each repetition."""
    return {"min": min(rates), "median": statistics.median(rates), "max": max(rates)} | (
        {"load_average": loads} if loads is not None else {}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser, "latest.json")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--formats", default="fp32", help=f"weight formats: {','.join(FORMATS)}")
    parser.add_argument("--ks", default="2", help="ks of the throughput tables (N: all of a model's experts)")
    parser.add_argument("--k-sweep", default="1,2,4,8,16", help="ks of the per-k cost on the medium model")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: throughput,ksweep,mixed")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    engines = args.engines.split(",")
    formats = args.formats.split(",")
    if unknown := set(formats) - set(FORMATS):
        parser.error(f"unknown formats {sorted(unknown)}; choose from {', '.join(FORMATS)}")
    report: dict = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "started": started(),
        "settings": vars(args) | {"cache": str(args.cache), "out": str(args.out)},
    }
    report["bandwidth"] = bandwidth.copy_bandwidth()
    models = {name: build(name, args.cache) for name in args.models.split(",")}

    if "throughput" not in skip:
        report["throughput"] = format_cells(models, engines, formats, args.ks, args)

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


def formats_table(name: str, formats: dict) -> list[str]:
    """Markdown: a row per format, k and batch (`format_cells`): each engine's median tok/s with the load
    averages of its repetitions, and moe-serve's ratios to llama.cpp (moe-serve-auto's too, where it ran) and to
    the best other engine; then why an engine has no figure."""
    engines = list(dict.fromkeys(e for ks in formats.values() for cells in ks.values() for e in cells))
    auto = "moe-serve-auto" in engines
    lines = [
        f"### {name} (tok/s, median of the reps [1-minute load average when each rep's worker ended])",
        "",
        "| format | k | batch | "
        + " | ".join(engines)
        + " | moe-serve / llama.cpp | "
        + ("moe-serve-auto / llama.cpp | " if auto else "")
        + "moe-serve / best peer |",
        "|---|---|---|" + "---|" * (len(engines) + 2 + auto),
    ]
    reasons = []
    for weights, ks in formats.items():
        for k, cells in ks.items():
            measured = {e: c for e, c in cells.items() if isinstance(c, dict)}
            reasons += [f"- {weights}, k={k}, {e}: {c}" for e, c in cells.items() if isinstance(c, str)]
            for batch in next((list(c) for c in measured.values()), []):
                figures = " | ".join(figure(measured.get(e, {}).get(batch)) for e in engines)
                peers = [e for e in measured if e not in OURS]
                best = max(peers, key=lambda e: measured[e][batch]["median"], default=None)
                auto_ratio = f"{ratio(measured, 'llama.cpp', batch, ours='moe-serve-auto')} | " if auto else ""
                lines.append(
                    f"| {weights} | {k} | {batch} | {figures} | {ratio(measured, 'llama.cpp', batch)} | "
                    f"{auto_ratio}{ratio(measured, best, batch, named=True)} |"
                )
    return [*lines, "", *reasons, *([""] if reasons else [])]


def figure(cell: dict | None) -> str:
    if cell is None:
        return "-"
    return f"{cell['median']:,.0f} [" + ", ".join(f"{load:.1f}" for load in cell["load_average"]) + "]"


def ratio(cells: dict[str, dict], other: str | None, batch: str, named: bool = False, ours: str = "moe-serve") -> str:
    """`ours`'s median over the other engine's (named: the other's name after it)."""
    if ours not in cells or other not in cells:
        return "-"
    return f"{cells[ours][batch]['median'] / cells[other][batch]['median']:.2f}x" + (f" ({other})" if named else "")


def markdown(report: dict) -> str:
    lines = [
        f"copy bandwidth {report['bandwidth']['copy_gb_s']:.1f} GB/s (read {report['bandwidth']['read_gb_s']:.1f})",
        "",
    ]
    for name, formats in report.get("throughput", {}).items():
        lines += formats_table(name, formats)
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
