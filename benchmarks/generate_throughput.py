"""Greedy generation throughput: this engine vs Hugging Face transformers `generate`, same weights,
same machine, same run (DESIGN §10). Reports tokens/s per batch size and the ratio.

    .venv/bin/python -m benchmarks.generate_throughput [--batch-sizes 1,16,64] [--k 2] [--json]

The model is a tiny Mixtral-format model built with transformers (hidden 256, 4 layers, 8 experts,
k = 2, fp32), exported with `exporters.hf`; prompts are 32 random tokens, 64 new tokens each.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from moe_serve import LLM, SamplingParams
from moe_serve.exporters.base import ExportOptions
from moe_serve.exporters.hf import export_hf

NO_PROGRESS = ExportOptions(progress=False)

PROMPT_LEN, NEW_TOKENS = 32, 64


def build(directory: Path) -> tuple[MixtralForCausalLM, Path]:
    # fmt: off
    config = MixtralConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                           bos_token_id=None, eos_token_id=None, pad_token_id=None)
    # fmt: on
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).eval()
    model.save_pretrained(directory / "hf")
    from transformers import PreTrainedTokenizerFast

    from moe_serve.tokenizer import byte_level_tokenizer

    PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer()).save_pretrained(directory / "hf")
    return model, export_hf(directory / "hf", directory / "artifact", NO_PROGRESS)


def time_hf(model: MixtralForCausalLM, prompts: torch.Tensor) -> float:
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
        elapsed = time.perf_counter() - start
    assert out.shape[1] == PROMPT_LEN + NEW_TOKENS
    return elapsed


def time_ours(llm: LLM, prompts: torch.Tensor, k: int) -> float:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, experts_per_token=k)
    start = time.perf_counter()
    outs = llm.generate(prompts.tolist(), params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        hf_model, artifact = build(Path(tmp))
        llm = LLM(artifact)
        rows = []
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            prompts = torch.randint(0, 1000, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(batch))
            time_ours(llm, prompts[:1, :8], args.k)  # warm-up
            ours = time_ours(llm, prompts, args.k)
            hf = time_hf(hf_model, prompts) if args.k == 2 else float("nan")
            tokens = batch * NEW_TOKENS
            rows.append(
                {
                    "batch": batch,
                    "k": args.k,
                    "moe_serve_tok_s": tokens / ours,
                    "transformers_tok_s": tokens / hf,
                    "ratio": hf / ours,
                }
            )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'batch':>5} {'k':>2} {'moe-serve tok/s':>16} {'transformers tok/s':>19} {'ratio':>6}")
        for r in rows:
            print(
                f"{r['batch']:>5} {r['k']:>2} {r['moe_serve_tok_s']:>16.1f} "
                f"{r['transformers_tok_s']:>19.1f} {r['ratio']:>6.2f}"
            )


if __name__ == "__main__":
    main()
