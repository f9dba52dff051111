"""One engine's greedy generation throughput on one model, run inside a worker process (one engine per
process: their threads, caches and compilers never meet). Prompts are random token ids; every request
generates exactly `new_tokens` tokens (EOS ignored); one warm-up run precedes the timed ones.

    python -m benchmarks.engines ENGINE MODEL_DIR --batches 1,16,64 --ks 2 --reps 3 [--threads 2] [--decode-cost]

ENGINE: moe-serve, moe-serve-onnx (its onnxruntime backend) or vllm-plugin (vLLM loading the artifact
through moe_serve.vllm_plugin, k per request): MODEL_DIR is an artifact; hf or vllm / vllm-eager (stock
vLLM, k fixed at load): MODEL_DIR is the Hugging Face checkpoint; llama.cpp (k fixed at load; its build
found under --cache, benchmarks.llamacpp): MODEL_DIR is a GGUF file. Prints one JSON document:
{"<k>": {"<batch>": [tok/s of each rep]}}; with --decode-cost, the cost of one decode step instead
(`measure_decode`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import bandwidth
from benchmarks.models import DEFAULT_CACHE

# (prompts, k, new_tokens): generate new_tokens for each; the moe-serve and llama.cpp runners return what they
# generated (benchmarks.llamacpp_parity compares it).
Runner = Callable[[list[list[int]], int, int], object]


def moe_serve_runner(
    model_dir: str, max_batch: int, backend: str = "torch", logprobs: bool = False, cpu_activations: str = "fp32"
) -> Runner:
    """Returns each prompt's completion (moe_serve.outputs.CompletionOutput; logprobs: with each token's)."""
    from moe_serve import LLM, EngineConfig, SamplingParams
    from moe_serve.exporters.onnx.cache import load_servable

    config = EngineConfig(max_num_seqs=max_batch, backend=backend, cpu_activations=cpu_activations)
    llm = LLM(load_servable(model_dir, config), config)  # onnxruntime: the artifact's cached export

    def run(prompts: list[list[int]], k: int, new_tokens: int) -> list:
        params = SamplingParams(
            max_tokens=new_tokens, temperature=0, ignore_eos=True, experts_per_token=k, logprobs=0 if logprobs else None
        )
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert all(len(o.token_ids) == new_tokens for o in outs)
        return outs

    return run


def hf_runner(model_dir: str, max_batch: int) -> Runner:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(prompts: list[list[int]], k: int, new_tokens: int) -> None:
        for module in model.modules():  # Mixtral reads top_k when it routes; a load-time constant otherwise
            if hasattr(module, "top_k"):
                module.top_k = k
        ids = torch.tensor(prompts)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )
        assert out.shape[1] == ids.shape[1] + new_tokens

    return run


def vllm_llm(model_dir: str, max_batch: int, eager: bool, **kwargs):  # noqa: ANN201
    from vllm import LLM

    memory_share = float(os.environ.get("BENCH_VLLM_MEMORY", "0.4"))  # vLLM's CPU KV cache takes this share of RAM
    return LLM(
        model=model_dir,
        dtype="float32",
        gpu_memory_utilization=memory_share,
        enforce_eager=eager,
        max_model_len=1024,
        max_num_seqs=max_batch,
        seed=0,
        **kwargs,
    )


def vllm_runner(model_dir: str, max_batch: int, eager: bool, k: int) -> Runner:
    """Stock vLLM fixes k when it loads the model (`hf_overrides`): one worker process per k."""
    from vllm import SamplingParams

    llm = vllm_llm(model_dir, max_batch, eager, hf_overrides={"num_experts_per_tok": k})

    def run(prompts: list[list[int]], run_k: int, new_tokens: int) -> None:
        assert run_k == k, "one vLLM process per k"
        params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, temperature=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)

    return run


def vllm_plugin_runner(model_dir: str, max_batch: int) -> Runner:
    """vLLM with moe-serve's plugin (moe_serve.vllm_plugin) on an artifact: k per request (extra_args). The
    plugin's model runs eager (vLLM compiles only models it decorates)."""
    from vllm import SamplingParams

    llm = vllm_llm(model_dir, max_batch, eager=True)

    def run(prompts: list[list[int]], k: int, new_tokens: int) -> None:
        params = SamplingParams(
            max_tokens=new_tokens,
            min_tokens=new_tokens,
            ignore_eos=True,
            temperature=0,
            extra_args={"experts_per_token": k},
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)

    return run


def llamacpp_runner(gguf_file: str, max_batch: int, k: int, max_len: int, threads: int, cache: Path) -> Runner:
    """llama.cpp's C API on a GGUF file (benchmarks.llamacpp.LlamaCppGenerator: multi-sequence batches, greedy,
    flash attention off, fp32 KV cache). k is fixed at load, like stock vLLM's: one worker process per k."""
    from benchmarks.llamacpp import EngineSettings, LlamaCppGenerator, ensure_built

    generator = LlamaCppGenerator(ensure_built(cache), Path(gguf_file), EngineSettings(k, max_batch, max_len, threads))

    def run(prompts: list[list[int]], run_k: int, new_tokens: int) -> list[list[int]]:
        assert run_k == k, "one llama.cpp process per k"
        outs = generator.generate(prompts, new_tokens)
        assert all(len(tokens) == new_tokens for tokens in outs)
        return outs

    return run


def random_prompts(rng: random.Random, batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]


def measure(
    run: Runner, batches: list[int], ks: list[int], reps: int, prompt_len: int, new_tokens: int, vocab: int
) -> dict[str, dict[str, list[float]]]:
    rng = random.Random(0)
    results: dict[str, dict[str, list[float]]] = {}
    for k in ks:
        for batch in batches:
            prompts = random_prompts(rng, batch, prompt_len, vocab)
            run(prompts[:1], k, new_tokens)  # warm-up (and, for compiled engines, compilation)
            rates = []
            for _ in range(reps):
                start = time.perf_counter()
                run(prompts, k, new_tokens)
                rates.append(batch * new_tokens / (time.perf_counter() - start))
            results.setdefault(str(k), {})[str(batch)] = rates
    return results


def measure_decode(
    run: Runner, batches: list[int], ks: list[int], reps: int, prompt_len: int, new_tokens: int, vocab: int
) -> dict[str, dict[str, list[dict[str, float]]]]:
    """The cost of one decode step, prefill excluded: (time to generate new_tokens - time to generate 1)
    / (new_tokens - 1), the same prompts, each rep next to a measurement of the machine's copy bandwidth
    (this VM's bandwidth drifts by tens of percent over minutes; the roofline uses the one measured with
    the step). {k: {batch: [{"step_s", "copy_gb_s"} per rep]}}."""
    meter = bandwidth.CopyMeter(threads=2, mib=256)
    rng = random.Random(0)
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for k in ks:
        for batch in batches:
            prompts = random_prompts(rng, batch, prompt_len, vocab)
            run(prompts, k, new_tokens)  # warm-up (and, for compiled engines, compilation)
            cells = []
            before = meter.measure()
            for _ in range(reps):  # each rep between two measurements; one rep's "after" is the next's "before"
                start = time.perf_counter()
                run(prompts, k, 1)
                middle = time.perf_counter()
                run(prompts, k, new_tokens)
                end = time.perf_counter()
                after = meter.measure()
                step = ((end - middle) - (middle - start)) / (new_tokens - 1)
                cells.append({"step_s": step, "copy_gb_s": (before["copy_gb_s"] + after["copy_gb_s"]) / 2})
                before = after
            results.setdefault(str(k), {})[str(batch)] = cells
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engines = ["moe-serve", "moe-serve-auto", "moe-serve-onnx", "hf", "vllm", "vllm-eager", "vllm-plugin", "llama.cpp"]
    parser.add_argument("engine", choices=engines)
    parser.add_argument("model_dir")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--ks", default="2")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=257, help="prompt token ids are drawn below this")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-cost", action="store_true", help="seconds per decode step (measure_decode)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="the benchmark cache (llama.cpp's build)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    if args.engine in ("moe-serve", "moe-serve-auto", "moe-serve-onnx", "hf"):
        import torch

        torch.set_num_threads(args.threads)
    if args.engine == "moe-serve":
        run = moe_serve_runner(args.model_dir, max(batches))
    elif args.engine == "moe-serve-auto":  # --cpu-activations auto: the packed formats' own activation precision
        run = moe_serve_runner(args.model_dir, max(batches), cpu_activations="auto")
    elif args.engine == "moe-serve-onnx":  # onnxruntime uses every core by default, as here
        run = moe_serve_runner(args.model_dir, max(batches), backend="onnxruntime")
    elif args.engine == "hf":
        run = hf_runner(args.model_dir, max(batches))
    elif args.engine == "vllm-plugin":
        run = vllm_plugin_runner(args.model_dir, max(batches))
    elif len(ks) != 1:
        parser.error(f"{args.engine} fixes k at load: give one --ks value per process")
    elif args.engine == "llama.cpp":
        max_len = args.prompt_len + args.new_tokens
        run = llamacpp_runner(args.model_dir, max(batches), ks[0], max_len, args.threads, args.cache)
    else:
        run = vllm_runner(args.model_dir, max(batches), args.engine == "vllm-eager", ks[0])
    how = measure_decode if args.decode_cost else measure
    results = how(run, batches, ks, args.reps, args.prompt_len, args.new_tokens, args.vocab)
    print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
