"""Write an OpenAI Batch JSONL of Shakespeare requests (held-out plays) for trying `moe-serve batch`.

    python -m loadtests.make_batch_file OUT.jsonl [--lines 1000] [--lm shakespeare-smoe] [--classifier genre-smear]

A third each: completions (the LM), scores (the LM), labelled classifications (the classifier; the true
genre is the line's "label", so `moe-serve batch --quality` reports accuracy against k).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moe_serve.evaluation.datasets import shakespeare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--lm", default="shakespeare-smoe")
    parser.add_argument("--classifier", default="genre-smear")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    passages = shakespeare.passages(shakespeare.split(held_out=True), 200, stride=701)
    with open(args.out, "w", encoding="utf-8") as f:
        for i in range(args.lines):
            text, genre = passages[i % len(passages)]
            kind = i % 3
            if kind == 0:
                record = {
                    "url": "/v1/completions",
                    "body": {"model": args.lm, "prompt": text[:80], "max_tokens": args.max_tokens, "temperature": 0},
                }
            elif kind == 1:
                record = {"url": "/v1/score", "body": {"model": args.lm, "input": text}}
            else:
                record = {"url": "/v1/classify", "body": {"model": args.classifier, "input": text}, "label": genre}
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", **record}) + "\n")
    print(f"wrote {args.lines} lines to {args.out}")


if __name__ == "__main__":
    main()
