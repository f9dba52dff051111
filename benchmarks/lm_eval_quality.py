"""lm-evaluation-harness, unchanged, against one `moe-serve serve` of the bundled LMs, at k = 1 and k = max:
multiple-choice accuracy, bits per byte and speaker exact match on the held-out plays (the tasks of
moe_serve.evaluation.lm_eval_tasks). Needs the test extra (lm-eval[api]).

    python -m benchmarks.lm_eval_quality [--docs 200]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.robustness import start
from moe_serve.evaluation.lm_eval_tasks import TASKS, write_tasks

MODELS = ("shakespeare-smoe", "shakespeare-hyperrouter", "shakespeare-dense")
RUNS = ("shakespeare-smoe:k1", "shakespeare-smoe:k8", "shakespeare-hyperrouter:k1", "shakespeare-hyperrouter:k8",
        "shakespeare-dense")  # fmt: skip
OUT = Path(__file__).parent / "results" / "lm_eval.json"


def evaluate(url: str, model: str, tasks_dir: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    # No prefix option: lm-eval takes the BOS that /tokenizer_info names to score a document's first byte.
    args = f"model={model},base_url={url}/v1/completions,max_length=1024,num_concurrent=4"
    manager = TaskManager(include_path=str(tasks_dir))
    results = lm_eval.simple_evaluate(
        model="local-completions", model_args=args, tasks=list(TASKS), task_manager=manager, log_samples=False
    )["results"]
    return {
        "model": model,
        "mc_acc": results["shakespeare_next_line"]["acc,none"],
        "mc_acc_stderr": results["shakespeare_next_line"]["acc_stderr,none"],
        "bits_per_byte": results["shakespeare_ppl"]["bits_per_byte,none"],
        "speaker_exact_match": float(results["shakespeare_speaker"]["exact_match,none"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=200, help="documents per task")
    args = parser.parse_args()
    tasks_dir = Path(tempfile.mkdtemp(prefix="lm-eval-tasks-"))
    write_tasks(tasks_dir, per_task=args.docs)
    server, url = start(models=MODELS)
    try:
        rows = [evaluate(url, model, tasks_dir) for model in RUNS]
    finally:
        server.kill()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(rows, indent=2) + "\n")
    print("| model | next-line acc | bits per byte | speaker exact match |\n|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['model']} | {row['mc_acc']:.3f} ± {row['mc_acc_stderr']:.3f} | {row['bits_per_byte']:.3f} | "
            f"{row['speaker_exact_match']:.2f} |"
        )


if __name__ == "__main__":
    main()
