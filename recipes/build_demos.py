"""Train every recipe under several seeds, export and evaluate each run, and bundle one demo per method.

    python -m recipes.build_demos [--seeds 3] [--jobs 2] [--only NAME ...] [--train-only | --bundle-only] [--retrain]
                                  [--precision auto|fp32|bf16]

1. Train: every (recipe, seed) without a checkpoint under runs/RECIPE/seed-S, `--jobs` at a time, one CPU
   thread each (on this 2-core machine two 1-thread runs train ~1.3-1.7x faster than one 2-thread run).
   Seed-major order, so that every method has a first seed before any has a third. Resumable: a finished
   run is never trained again (unless --retrain). Every run of a build trains in one `--precision`
   (auto: bf16 where the CPU has bf16 matrix units, else fp32); it is part of a recipe's settings, so
   seeds trained in two precisions never share a mean.
2. Evaluate: each run is exported (bf16, routers fp32) to runs/RECIPE/seed-S/artifact and scored on the
   held-out plays at k = 1, 2, 4, 8 (runs/RECIPE/seed-S/quality.json).
3. Bundle: the best seed of each recipe (lowest mean bits per byte over k, or highest mean accuracy, on
   the same held-out plays the table reports, so the bundled row is the best of N, not an unbiased
   estimate; the mean over seeds is) is exported to moe_serve/demo_models/NAME with its quality table; its provenance's
   `seeds` holds every seed's figures and their mean and standard deviation, and its router diagnostics
   (recipes.diagnostics). `moe-serve eval --stored` prints them side by side. Seeds whose runs are not
   under --runs but which the bundled demo's provenance records (an earlier build, same recipe settings)
   count too, so the seeds of a recipe can be trained in several sittings; a recipe with no run under
   --runs whose bundled demo already records every seed asked for keeps that demo as it is.
   The summary also keeps each seed's wall time, CPU and router diagnostics (`runs`), and the mean and
   standard deviation of the wall time and of the diagnostics' deltas per k (`diagnostics`).
4. Controls (CONTROLS: recipes that make a demo's claim testable) are trained, evaluated and summarised
   the same way but bundle no weights (the demos stay within their size): their seeds summary goes into
   the provenance of the demo whose claim they test, under `controls`, which `moe-serve eval --stored`
   prints beside the demos.
Writes docs/quality_vs_k.{csv,png} from the bundled demos and the controls' best seeds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from moe_serve import LLM
from moe_serve.artifact import CONFIG_FILE
from moe_serve.evaluation.plot import plot
from moe_serve.evaluation.runner import evaluate
from moe_serve.evaluation.table import format_table, write_csv
from moe_serve.exporters import exporter
from moe_serve.exporters.base import TRAINING_CHECKPOINT, TRAINING_CONFIG, ExportOptions
from moe_serve.model_config import ModelConfig
from moe_serve.quality import LOWER_IS_BETTER, QUALITY_FILE, QualityRow, QualityTable
from moe_serve.registry import BUNDLED_DIR
from recipes import play_chat, train

# demo name -> (recipe, export format); one per seed method, plus the baselines.
DEMOS = {
    "shakespeare-hyperrouter": ("hyperrouter-lm", "hyperrouter"),
    "shakespeare-hypermoe": ("hypermoe-lm", "hypermoe"),
    "shakespeare-similarity": ("similarity-lm", "similarity"),
    "shakespeare-attention": ("attention-lm", "attention"),
    "shakespeare-smoe": ("smoe-lm", "smoe"),
    "shakespeare-dense": ("dense-lm", "txl-dense"),
    "genre-moesart": ("moesart-clf", "moesart"),
    "genre-smear": ("smear-clf", "smear"),
    "genre-topk": ("topk-clf", "topk"),
    "genre-switch": ("switch-clf", "switch"),
}
# control name -> (recipe, export format, the bundled demo whose claim it tests and whose provenance carries it).
CONTROLS = {
    "shakespeare-smoe-top1": ("smoe-top1-lm", "smoe", "shakespeare-hypermoe"),
    "shakespeare-hypermoe-lb": ("hypermoe-lb-lm", "hypermoe", "shakespeare-hypermoe"),
}
LANGUAGE_MODELS = tuple(name for name, (recipe, _) in DEMOS.items() if train.RECIPES[recipe].kind == "lm")
CLASSIFIERS = tuple(name for name in DEMOS if name not in LANGUAGE_MODELS)
KS = [1, 2, 4, 8]
DATASET = "shakespeare"
HEADLINE = {"causal_lm": "bits_per_byte", "sequence_classification": "accuracy"}


def run_dir(runs: Path, recipe: str, seed: int) -> Path:
    return runs / recipe / f"seed-{seed}"


def export(fmt: str, src: Path, dst: Path) -> Path:
    return exporter(fmt)(src, dst, ExportOptions(dtype=torch.bfloat16, overwrite=True, progress=False))


def train_all(runs: Path, recipes: list[str], seeds: list[int], jobs: int, retrain: bool, precision: str) -> None:
    """Every missing (recipe, seed), `jobs` subprocesses at a time; a failed run stops the build."""
    queue = [
        (recipe, seed)
        for seed in seeds
        for recipe in recipes
        if retrain or not (run_dir(runs, recipe, seed) / TRAINING_CHECKPOINT).is_file()
    ]
    running: list[tuple[str, int, subprocess.Popen, Path]] = []
    with tqdm(total=len(queue), desc="train runs", unit="run") as bar:
        while queue or running:
            while queue and len(running) < jobs:
                recipe, seed = queue.pop(0)
                out = run_dir(runs, recipe, seed)
                out.mkdir(parents=True, exist_ok=True)
                log = out / "train.log"
                command = [sys.executable, "-m", "recipes.train", recipe, "--seed", str(seed)]
                command += ["--threads", "1", "--precision", precision, "--out", str(out)]
                with open(log, "w") as f:
                    running.append((recipe, seed, subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT), log))
            time.sleep(2)
            for entry in list(running):
                recipe, seed, process, log = entry
                if process.poll() is None:
                    continue
                running.remove(entry)
                if process.returncode != 0:
                    for _, _, other, _ in running:
                        other.terminate()
                    raise SystemExit(f"training {recipe} seed {seed} failed (exit {process.returncode}); see {log}")
                bar.update(1)
                bar.write(f"trained {recipe} seed {seed}")


def evaluate_run(run: Path, fmt: str, max_items: int | None) -> list[QualityRow]:
    """The run's quality rows at KS, cached in run/quality.json (redone when the checkpoint is newer)."""
    cached = run / QUALITY_FILE
    if cached.is_file() and cached.stat().st_mtime > (run / TRAINING_CHECKPOINT).stat().st_mtime:
        return list(QualityTable.read(cached).rows)
    llm = LLM(export(fmt, run, run / "artifact"))
    moe = llm.config.moe
    ks = [k for k in KS if moe is None or moe.min_k <= k <= moe.max_k]  # HyperMoE serves its trained k only
    rows = evaluate(llm, ks, DATASET, max_items)
    QualityTable(tuple(rows)).write(cached)
    return rows


# A training record's keys that describe one run; every other key (precision included) is the recipe's settings.
RUN_KEYS = frozenset(
    {
        "seed",
        "command",
        "metrics",
        "train_seconds",
        "load_average",
        "hyperrouter_embedding_lr_scale",
        "seeds",
        "cpu_bf16_units",
    }
)
# The diagnostics a seeds summary averages: (name in the summary, key in recipes.diagnostics' output).
DIAGNOSTIC_DELTAS = (
    ("plain_routing_delta_bits_per_byte", "plain_routing_bits_per_byte"),
    ("swap_to_init_delta_bits_per_byte", "swap_to_init_bits_per_byte"),
    ("fixed_hyper_expert_delta_bits_per_byte", "fixed_hyper_expert_bits_per_byte"),
)


def settings_sha256(record: dict) -> str:
    """What every seed of a recipe shares (steps, optimizer, model, split, precision, thread count, torch
    version...)."""
    settings = {key: value for key, value in record.items() if key not in RUN_KEYS}
    # The classifiers train in fp32 only, as they always have, but their first records named no precision:
    # the same setting either way, so the seeds bundled then keep counting.
    if settings.get("task") == "sequence_classification" and settings.get("precision") == "fp32":
        del settings["precision"]
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def bundled_summary(artifact: Path) -> dict | None:
    """The seeds summary in the bundled demo's provenance (None when there is no such demo or summary)."""
    path = artifact / CONFIG_FILE
    return json.loads(path.read_text())["provenance"].get("seeds") if path.is_file() else None


def control_summaries(artifact: Path) -> dict[str, dict]:
    """The controls' seeds summaries in a bundled demo's provenance (`controls`), by control name."""
    path = artifact / CONFIG_FILE
    return dict(json.loads(path.read_text())["provenance"].get("controls") or {}) if path.is_file() else {}


def recorded_summary(name: str) -> dict | None:
    """The seeds summary an earlier build recorded for a demo, or for a control (in its host demo)."""
    if name in CONTROLS:
        return control_summaries(BUNDLED_DIR / CONTROLS[name][2]).get(name)
    return bundled_summary(BUNDLED_DIR / name)


def earlier_seeds(
    name: str, settings: str, measured: dict[int, list[QualityRow]], seeds: list[int]
) -> dict[int, list[QualityRow]]:
    """The seeds an earlier build measured (the bundled demo's provenance) and whose runs are not here:
    training 3 seeds of every recipe takes longer than one sitting on 2 cores, and runs/ may be gone. Kept
    only under the same recipe settings, and only if every seed measured both then and now agrees (else
    the code changed under the same settings, and none of the earlier figures is used)."""
    summary = recorded_summary(name)
    if not summary or summary.get("settings_sha256") != settings:
        return {}
    rows: dict[int, list[QualityRow]] = {}
    for cell in summary["quality"]:
        for seed, value in cell["values"].items():
            rows.setdefault(int(seed), []).append(QualityRow(DATASET, cell["k"], cell["metric"], value, name))
    for seed in measured.keys() & rows.keys():
        now = {(int(r.k), r.metric): r.value for r in measured[seed] if r.policy is None}
        if any(abs(now[(int(r.k), r.metric)] - r.value) > 1e-3 for r in rows[seed]):
            print(f"{name}: seed {seed} measures differently from the earlier build; its earlier seeds are dropped")
            return {}
    return {seed: r for seed, r in rows.items() if seed not in measured and seed in seeds}


def run_facts(record: dict) -> dict:
    """What a seeds summary keeps of one run: its wall time (and the load average when it ended), precision,
    CPU and router diagnostics."""
    kept = ("train_seconds", "load_average", "precision", "cpu_bf16_units")
    facts = {key: record[key] for key in kept if key in record}
    diagnostics = (record.get("metrics") or {}).get("diagnostics")
    return {**facts, "diagnostics": diagnostics} if diagnostics else facts


def earlier_facts(name: str, seeds: set[int]) -> dict[int, dict]:
    """The run facts an earlier build recorded for these seeds (the seeds earlier_seeds keeps)."""
    recorded = (recorded_summary(name) or {}).get("runs") or {}
    return {int(seed): facts for seed, facts in recorded.items() if int(seed) in seeds}


def _spread(values: dict[int, float]) -> dict:
    series = [values[s] for s in sorted(values)]
    return {
        "mean": round(statistics.fmean(series), 4),
        "std": round(statistics.stdev(series), 4) if len(series) > 1 else None,
        "values": {str(s): round(values[s], 4) for s in sorted(values)},
    }


def trained_ks(artifact: Path) -> list[int] | None:
    """The k an exported run serves exactly (MoEConfig.exact_ks: the k it trained at, by its exporter and
    router kind, as the served `approximate` flag has it); None for a model without experts."""
    moe = ModelConfig.from_dict(json.loads((artifact / CONFIG_FILE).read_text())["model"]).moe
    return list(moe.exact_ks()) if moe is not None else None


def seed_summary(
    recipe: str,
    per_seed: dict[int, list[QualityRow]],
    best: int,
    task: str,
    settings: str,
    runs: dict[int, dict] | None = None,
    trained_k: list[int] | None = None,
) -> dict:
    """Each (k, metric): every seed's value, their mean and sample standard deviation; with the runs'
    facts (run_facts), each seed's, and the spread of the wall time and of the diagnostics' deltas per k.
    `trained_k` (trained_ks) lets a table mark the k no seed was trained at."""
    cells: dict[tuple[int, str], dict[int, float]] = {}
    for seed, rows in per_seed.items():
        for row in rows:
            if row.policy is None:
                cells.setdefault((int(row.k), row.metric), {})[seed] = row.value
    quality = [{"k": k, "metric": metric, **_spread(values)} for (k, metric), values in sorted(cells.items())]
    rule = "lowest" if HEADLINE[task] in LOWER_IS_BETTER else "highest"
    summary = {
        "recipe": recipe,
        "settings_sha256": settings,
        "seeds": sorted(per_seed),
        "bundled_seed": best,
        "chosen_by": f"{rule} mean {HEADLINE[task]} over k = {', '.join(map(str, KS))} on the held-out plays",
        "quality": quality,
    }
    if trained_k is not None:
        summary["trained_k"] = trained_k
    facts = {seed: f for seed, f in (runs or {}).items() if seed in per_seed and f}
    return summary | runs_summary(facts) if facts else summary


def runs_summary(runs: dict[int, dict]) -> dict:
    """The runs' facts by seed, and their spread: the wall time, and each diagnostic delta per k."""
    out: dict = {"runs": {str(seed): runs[seed] for seed in sorted(runs)}}
    precisions = {facts["precision"] for facts in runs.values() if "precision" in facts}
    if len(precisions) == 1:  # one setting (settings_sha256), unless runs predate the record
        out["precision"] = precisions.pop()
    seconds = {seed: facts["train_seconds"] for seed, facts in runs.items() if "train_seconds" in facts}
    if seconds:
        out["train_seconds"] = _spread(seconds)
    deltas: dict[tuple[str, int], dict[int, float]] = {}
    for seed, facts in runs.items():
        for name, key in DIAGNOSTIC_DELTAS:
            for k, cell in ((facts.get("diagnostics") or {}).get(key) or {}).items():
                deltas.setdefault((name, int(k)), {})[seed] = cell["delta"]
    if deltas:
        out["diagnostics"] = [{"name": name, "k": k, **_spread(values)} for (name, k), values in sorted(deltas.items())]
    return out


def best_seed(per_seed: dict[int, list[QualityRow]], task: str) -> int:
    metric = HEADLINE[task]

    def score(seed: int) -> float:
        values = [r.value for r in per_seed[seed] if r.metric == metric and r.policy is None]
        mean = statistics.fmean(values)
        return mean if metric in LOWER_IS_BETTER else -mean

    return min(sorted(per_seed), key=score)


def bundled_seeds(artifact: Path) -> set[int]:
    summary = bundled_summary(artifact)
    return set(summary["seeds"]) if summary else set()


def bundled_rows(artifact: Path) -> list[QualityRow]:
    return [r for r in QualityTable.read(artifact / QUALITY_FILE).rows if r.policy is None]


def available_seeds(runs: Path, recipe: str, seeds: list[int]) -> list[int]:
    return [s for s in seeds if (run_dir(runs, recipe, s) / TRAINING_CHECKPOINT).is_file()]


def measure(
    name: str, recipe: str, fmt: str, runs: Path, seeds: list[int], max_items: int | None
) -> tuple[dict[int, list[QualityRow]], dict[int, dict], dict]:
    """Evaluate every run of `recipe` under `runs` (at least one) -> (their rows and training records by
    seed, the seeds summary over them and the seeds an earlier build recorded)."""
    available = available_seeds(runs, recipe, seeds)
    measured = {s: evaluate_run(run_dir(runs, recipe, s), fmt, max_items) for s in available}
    records = {s: json.loads((run_dir(runs, recipe, s) / TRAINING_CONFIG).read_text()) for s in available}
    settings = settings_sha256(records[available[0]])
    if any(settings_sha256(r) != settings for r in records.values()):
        raise SystemExit(f"{name}: the runs of {recipe} under {runs} were trained with different settings")
    per_seed = {**earlier_seeds(name, settings, measured, seeds), **measured}
    facts = {**earlier_facts(name, set(per_seed) - set(measured)), **{s: run_facts(r) for s, r in records.items()}}
    task = "causal_lm" if train.RECIPES[recipe].kind == "lm" else "sequence_classification"
    artifact = run_dir(runs, recipe, available[0]) / "artifact"  # evaluate_run exported it; one setting for all
    trained = trained_ks(artifact) if (artifact / CONFIG_FILE).is_file() else None
    summary = seed_summary(recipe, per_seed, best_seed(per_seed, task), task, settings, facts, trained)
    return measured, records, summary


def write_provenance(artifact: Path, **entries: object) -> None:
    """Set entries of a bundled demo's provenance in its config.json (not among the checksummed files)."""
    path = artifact / CONFIG_FILE
    manifest = json.loads(path.read_text())
    manifest["provenance"].update(entries)
    path.write_text(json.dumps(manifest, indent=2) + "\n")  # save_artifact's layout


def bundle(name: str, recipe: str, fmt: str, runs: Path, seeds: list[int], max_items: int | None) -> list[QualityRow]:
    artifact = BUNDLED_DIR / name
    if not available_seeds(runs, recipe, seeds):
        recorded = bundled_seeds(artifact)
        if not set(seeds) <= recorded:
            raise SystemExit(f"{name}: no trained run of {recipe} under {runs}")
        print(f"{name}: no run under {runs}; the bundled demo already records seeds {sorted(recorded)} and stays")
        return bundled_rows(artifact)
    measured, records, summary = measure(name, recipe, fmt, runs, seeds, max_items)
    best = summary["bundled_seed"]
    if best not in measured:  # the bundled demo is that seed already: only its seeds' summary changes
        if json.loads((artifact / CONFIG_FILE).read_text())["provenance"]["seed"] != best:
            raise SystemExit(f"{name}: the best seed is {best}, whose run is not under {runs}; bundled is another")
        write_provenance(artifact, seeds=summary)
        return bundled_rows(artifact)
    source = run_dir(runs, recipe, best)
    record = records[best]
    record["seeds"] = summary  # carried into the artifact's provenance
    (source / TRAINING_CONFIG).write_text(json.dumps(record, indent=2) + "\n")
    controls = control_summaries(artifact)  # the export replaces the artifact; the controls' summaries stay
    export(fmt, source, artifact)
    if controls:
        write_provenance(artifact, controls=controls)
    if train.RECIPES[recipe].kind == "lm":
        play_chat.install(artifact)  # chat that works out of the box: the template fits the training text
    rows = [QualityRow(r.dataset, r.k, r.metric, r.value, name, r.policy) for r in measured[best]]
    QualityTable(tuple(rows)).merge_into(artifact / QUALITY_FILE)
    return rows


def bundle_control(
    name: str, recipe: str, fmt: str, host: str, runs: Path, seeds: list[int], max_items: int | None
) -> list[QualityRow]:
    """A control's seeds summary into its host demo's provenance (`controls`); no weights are bundled.
    -> its best seed's rows, named after the control."""
    artifact = BUNDLED_DIR / host
    if not (artifact / CONFIG_FILE).is_file():
        raise SystemExit(f"{name}: the demo {host} that carries this control is not bundled; build it first")
    if not available_seeds(runs, recipe, seeds):
        summary = control_summaries(artifact).get(name)
        if summary is None or not set(seeds) <= set(summary["seeds"]):
            raise SystemExit(f"{name}: no trained run of {recipe} under {runs}")
        print(f"{name}: no run under {runs}; {host} already records seeds {summary['seeds']} of it and stays")
        return summary_rows(name, summary)
    _, _, summary = measure(name, recipe, fmt, runs, seeds, max_items)
    write_provenance(artifact, controls={**control_summaries(artifact), name: summary})
    return summary_rows(name, summary)


def summary_rows(name: str, summary: dict) -> list[QualityRow]:
    """The figures of a seeds summary's best seed, as quality rows of `name`."""
    seed = str(summary["bundled_seed"])
    return [QualityRow(DATASET, q["k"], q["metric"], q["values"][seed], name) for q in summary["quality"]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.build_demos", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per recipe")
    parser.add_argument("--jobs", type=int, default=2, help="training runs at once (one thread each)")
    parser.add_argument(
        "--only", nargs="+", choices=sorted({**DEMOS, **CONTROLS}), default=None, help="these demos and controls only"
    )
    stage = parser.add_mutually_exclusive_group()
    stage.add_argument("--train-only", action="store_true", help="stop after training")
    stage.add_argument(
        "--bundle-only", action="store_true", help="train nothing: bundle from the seeds already trained under --runs"
    )
    parser.add_argument("--retrain", action="store_true", help="train even when a run's checkpoint exists")
    parser.add_argument(
        "--precision",
        choices=train.PRECISIONS,
        default="auto",
        help="every run's training precision (recipes.train --precision; auto: bf16 where the CPU has bf16 units)",
    )
    parser.add_argument(
        "--max-items", type=int, default=400, help="windows/passages sampled evenly across the held-out plays (0: all)"
    )
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument("--docs", type=Path, default=Path("docs"))
    args = parser.parse_args(argv)
    chosen = args.only or [*DEMOS, *CONTROLS]
    demos = {name: DEMOS[name] for name in chosen if name in DEMOS}
    controls = {name: CONTROLS[name] for name in chosen if name in CONTROLS}
    seeds = list(range(args.seeds))
    if not args.bundle_only:
        recipes = [recipe for recipe, _ in demos.values()] + [recipe for recipe, _, _ in controls.values()]
        train_all(args.runs, recipes, seeds, args.jobs, args.retrain, args.precision)
    if args.train_only:
        return
    rows = []
    for name, (recipe, fmt) in demos.items():
        rows += bundle(name, recipe, fmt, args.runs, seeds, args.max_items or None)
    for name, (recipe, fmt, host) in controls.items():  # after the demos, so that a re-exported host keeps them
        rows += bundle_control(name, recipe, fmt, host, args.runs, seeds, args.max_items or None)
    if args.only is None:
        write_csv(args.docs / "quality_vs_k.csv", rows)
        plot(args.docs / "quality_vs_k.png", rows)
    print(format_table(rows))


if __name__ == "__main__":
    main()
