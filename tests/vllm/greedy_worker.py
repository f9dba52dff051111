"""Greedy tokens of vLLM + the plugin for one artifact at several k, in a process of its own (vLLM keeps
process-wide state: one engine per process).

    python -m tests.vllm.greedy_worker ARTIFACT --ks 1,8 --prompt 1,2,3 --max-tokens 12 [--tensor-parallel-size 2]
        [--enable-expert-parallel] [--dtype bfloat16]

Prints RESULT {k: [token ids]} and DTYPES [each parameter of the first rank's model with its dtype].
"""

from __future__ import annotations

import argparse
import json

from vllm import LLM, SamplingParams


def parameter_dtypes(model) -> list[str]:
    return sorted(f"{name}: {param.dtype}" for name, param in model.named_parameters())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--ks", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    llm = LLM(
        args.artifact,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=128,
        kv_cache_memory_bytes=16 << 20,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
    )
    prompt = {"prompt_token_ids": [int(t) for t in args.prompt.split(",")]}
    ks = [int(k) for k in args.ks.split(",")]
    params = [
        SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, extra_args={"experts_per_token": k})
        for k in ks
    ]
    outs = llm.generate([prompt] * len(ks), params, use_tqdm=False)  # every k in one batch
    print("RESULT " + json.dumps({k: list(o.outputs[0].token_ids) for k, o in zip(ks, outs, strict=True)}))
    dtypes = llm.apply_model(parameter_dtypes)
    print("DTYPES " + json.dumps(dtypes[0]))  # the first rank's parameters, each with its dtype


if __name__ == "__main__":
    main()
