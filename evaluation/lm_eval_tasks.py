"""lm-evaluation-harness tasks on the held-out Shakespeare plays, for any server that speaks vLLM's API:

- `shakespeare_next_line` (multiple choice, loglikelihood): three lines of a scene, then the true next
  line against three other lines of the same play;
- `shakespeare_ppl` (loglikelihood_rolling): whole held-out passages: word and byte perplexity, bits per byte;
- `shakespeare_speaker` (generate_until): the text up to a speech, then the speaker's name (exact match).

    python -m moe_serve.evaluation.lm_eval_tasks DIR
    lm_eval --model local-completions --include_path DIR \\
        --tasks shakespeare_next_line,shakespeare_ppl,shakespeare_speaker \\
        --model_args model=shakespeare-smoe:k1,base_url=http://127.0.0.1:8000/v1/completions,max_length=1024,custom_prefix_token_id=10

The k goes in the model name (`:k1`); the tokenizer comes from the server's /tokenize. LMs trained
without a BOS or EOS token (the first bundled demos), so `custom_prefix_token_id=10` (a newline byte) is the context
that scores a document's first byte. LMs trained with BOS and EOS (<|endoftext|>, id 256: the recipes
now) name it in `/tokenizer_info`, and lm-eval runs without the option; but lm-eval reads the token's id
as /tokenize's first id of its text, which the server tokenizes literally ('<', 60), so pass
`custom_prefix_token_id=256` (the `bos_token_id` of `/tokenizer_info`) for the prefix the model trained with.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from moe_serve.evaluation.datasets.shakespeare import split

TASKS = ("shakespeare_next_line", "shakespeare_ppl", "shakespeare_speaker")
SPEAKER = re.compile(r"^([A-Z][A-Z ]{1,30})\.$")

_YAML = {
    "shakespeare_next_line": """task: shakespeare_next_line
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_target: gold
doc_to_choice: choices
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1.0
""",
    "shakespeare_ppl": """task: shakespeare_ppl
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: text
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
""",
    "shakespeare_speaker": """task: shakespeare_speaker
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: speaker
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 24
  do_sample: false
metric_list:
  - metric: exact_match
metadata:
  version: 1.0
""",
}


def write_tasks(directory: Path, per_task: int = 200, seed: int = 0) -> list[str]:
    """Writes each task's JSONL data and YAML into `directory`; returns the task names."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    plays = split(held_out=True)
    docs = {
        "shakespeare_next_line": _next_line_docs(plays, per_task, rng),
        "shakespeare_ppl": _passage_docs(plays, per_task),
        "shakespeare_speaker": _speaker_docs(plays, per_task, rng),
    }
    for task, rows in docs.items():
        data = directory / f"{task}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        (directory / f"{task}.yaml").write_text(_YAML[task].format(data=data.resolve()), encoding="utf-8")
    return list(TASKS)


def _spoken_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not SPEAKER.match(line) and not line.startswith("[")]


def _next_line_docs(plays, count: int, rng: random.Random) -> list[dict]:
    docs = []
    for index in range(count):
        lines = _spoken_lines(plays[index % len(plays)].text)
        at = rng.randrange(3, len(lines) - 1)
        distractors = rng.sample([line for line in lines if line != lines[at]], 3)
        choices = [" " + line for line in [lines[at], *distractors]]
        order = list(range(4))
        rng.shuffle(order)
        docs.append(
            {
                "context": "\n".join(lines[at - 3 : at]) + "\n",
                "choices": [choices[i] for i in order],
                "gold": order.index(0),
            }
        )
    return docs


def _passage_docs(plays, count: int, length: int = 600) -> list[dict]:
    docs = []
    for index in range(count):
        text = plays[index % len(plays)].text
        start = (index // len(plays)) * length * 3
        start = text.find("\n", start % max(1, len(text) - length)) + 1
        docs.append({"text": text[start : start + length]})
    return docs


def _speaker_docs(plays, count: int, rng: random.Random, context: int = 400) -> list[dict]:
    docs = []
    for index in range(count):
        text = plays[index % len(plays)].text
        speeches = [m for m in re.finditer(r"^([A-Z][A-Z ]{1,30})\.$", text, re.MULTILINE) if m.start() > context]
        match = rng.choice(speeches)
        docs.append({"context": text[match.start() - context : match.start()], "speaker": match.group(1) + "."})
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--per-task", type=int, default=200, help="documents per task")
    args = parser.parse_args()
    names = write_tasks(args.directory, args.per_task)
    print(f"wrote {', '.join(names)} to {args.directory} (lm_eval --include_path {args.directory})")


if __name__ == "__main__":
    main()
