"""Huge pages (moe_serve.kernels.hugepages) against 4 KiB pages, interleaved in one process so that both see
the same machine (this VM's memory bandwidth drifts by tens of percent over minutes):

- the C++ linear kernel streaming one [32000, 1024] fp32 weight (an LM head) at one row;
- whole batch-1 decodes of MODEL at each k, two copies of the model loaded side by side.

    python -m benchmarks.hugepages [MODEL] [--ks 1,2,8] [--rounds 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from moe_serve import LLM, EngineConfig, SamplingParams
from moe_serve.kernels import cpu_extension, hugepages


def kernel_ab(rounds: int) -> dict[str, float]:
    ext = cpu_extension()
    assert ext is not None, "the C++ kernels are needed"
    plain = torch.randn(32000, 1024)
    huge = hugepages.place(plain)
    x = torch.randn(1, 1024)
    times: dict[str, list[float]] = {"4 KiB pages": [], "huge pages": []}
    for _ in range(rounds * 8):
        for name, weight in (("4 KiB pages", plain), ("huge pages", huge)):
            start = time.perf_counter()
            ext.linear(x, weight, None)
            times[name].append(time.perf_counter() - start)
    return {name: plain.numel() * 4 / statistics.median(t) / 1e9 for name, t in times.items()}


def engine_ab(model: str, ks: list[int], rounds: int, new_tokens: int = 33) -> dict[int, dict[str, float]]:
    config = EngineConfig(max_num_seqs=1)
    engines = {"huge pages": LLM(model, config)}
    with mock.patch.object(hugepages, "supported", return_value=False):
        engines["4 KiB pages"] = LLM(model, config)
    prompt = [[(7 * i) % 250 for i in range(32)]]
    out: dict[int, dict[str, float]] = {}
    for k in ks:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, experts_per_token=k)
        times: dict[str, list[float]] = {name: [] for name in engines}
        for llm in engines.values():
            llm.generate(prompt, params)  # warm
        for _ in range(rounds):
            for name, llm in engines.items():
                start = time.perf_counter()
                llm.generate(prompt, params)
                times[name].append(time.perf_counter() - start)
        out[k] = {name: 1000 * statistics.median(t) / new_tokens for name, t in times.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="an artifact or demo (default: kernel only)")
    parser.add_argument("--ks", default="1,2,8")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rates = kernel_ab(args.rounds)
    print("linear [32000, 1024], one row (GB/s, median): " + ", ".join(f"{n} {r:.1f}" for n, r in rates.items()))
    if args.model:
        for k, ms in engine_ab(args.model, [int(k) for k in args.ks.split(",")], args.rounds).items():
            print(f"batch-1 decode, k={k} (ms per token, median): " + ", ".join(f"{n} {v:.1f}" for n, v in ms.items()))


if __name__ == "__main__":
    main()
