"""The CPU kernels on packed weights (moe_serve/kernels/packed.py) against fp32, on the medium model's shapes
(benchmarks/models.py: hidden 1,024, 16 experts of 1,024, k = 2, vocabulary 32,000):

- linear at M = 1, 16, 64 rows on the LM head [32000, 1024] and on a [1024, 1024] projection;
- moe_experts at batch 1, k = 2 (gated experts: w1, w3 [16, 1024, 1024], w2 [16, 1024, 1024]);

each with fp32 activations and, for int8 and int4 (rows int8/a8, int4/a8), with int8 activations
(--cpu-activations int8: kernels/csrc/int_dot.h), for bf16 (bf16/a16, where the CPU has AVX-512 BF16) with bf16
ones (bf16_dot.h).

Each call reads its weights from memory, as in a decode step, whose weights are far larger than the caches:
the calls cycle through enough copies of a weight (or, for the bank, through copies and expert pairs) that
none is in the last-level cache when read again. Reported: the median time, the weight bytes read per second
(data and scales), that rate against the copy bandwidth measured in the same run (benchmarks/bandwidth.py:
bytes read + written per second), and the speedup over fp32.

    python -m benchmarks.packed_gemv [--reps 30] [--threads 2] [--prefill]

--prefill adds larger M for linear's dispatch rule (moe_serve.kernels.ops.linear): the C++ kernel against
dequantizing then MKL (F.linear), and against MKL on an fp32 copy kept beside the packed weight.

The load average is printed before and after: while other processes run, each parallel region waits for
its second thread's scheduler slice and the 2-thread times stall in steps of several milliseconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
from torch.nn import functional as F

from benchmarks.bandwidth import CopyMeter
from moe_serve.kernels import has_bf16_dot, ops
from moe_serve.kernels.packed import WeightFormat, quantize
from moe_serve.kernels.vocabulary import ExpertWeights, Weight, float_weight

# (label, format, activations)
FORMATS = (
    ("fp32", WeightFormat.FP32, "fp32"),
    ("bf16", WeightFormat.BF16, "fp32"),
    ("int8", WeightFormat.INT8, "fp32"),
    ("int4", WeightFormat.INT4, "fp32"),
    ("bf16/a16", WeightFormat.BF16, "bf16"),
    ("int8/a8", WeightFormat.INT8, "int8"),
    ("int4/a8", WeightFormat.INT4, "int8"),
)
HIDDEN, INTERMEDIATE, EXPERTS, VOCAB, TOP_K = 1024, 1024, 16, 32000, 2
EVICT_BYTES = 256 * 2**20  # what the copies of a weight add up to at least: several times the last-level cache
LINEAR_SHAPES = {"lm_head": (VOCAB, HIDDEN), "proj": (HIDDEN, HIDDEN)}


def packed(weight: torch.Tensor, fmt: WeightFormat, activations: str = "fp32") -> Weight:
    return weight.clone() if fmt is WeightFormat.FP32 else quantize(weight, fmt).with_activations(activations)


def copy_of(weight: Weight) -> Weight:
    """Another copy in memory (the same values)."""
    if isinstance(weight, torch.Tensor):
        return weight.clone()
    scales = weight.scales.clone() if weight.scales is not None else None
    return dataclasses.replace(weight, data=weight.data.clone(), scales=scales)


def median_seconds(calls: Callable[[int], object], reps: int) -> float:
    """The median of `reps` timed calls calls(i), after two untimed ones."""
    calls(0)
    calls(1)
    times = []
    for i in range(reps):
        start = time.perf_counter()
        calls(i)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def copies_for(nbytes: int) -> int:
    return max(2, math.ceil(EVICT_BYTES / nbytes))


def rotating_linear(x: torch.Tensor, weights: Sequence[Weight], i: int) -> torch.Tensor:
    return ops.linear(x, weights[i % len(weights)])


def linear_rows(
    label: str, fmt: WeightFormat, activations: str, name: str, rows: tuple[int, ...], reps: int
) -> list[dict]:
    n, k = LINEAR_SHAPES[name]
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=generator) * 0.02
    first = packed(weight, fmt, activations)
    nbytes = first.nbytes
    weights = [first] + [copy_of(first) for _ in range(copies_for(nbytes) - 1)]
    results = []
    for m in rows:
        x = torch.randn(m, k, generator=generator)
        seconds = median_seconds(partial(rotating_linear, x, weights), reps)
        results.append({"op": f"linear {name} M={m}", "format": label, "seconds": seconds, "bytes": nbytes})
    return results


def moe_row(label: str, fmt: WeightFormat, activations: str, reps: int) -> dict:
    generator = torch.Generator().manual_seed(1)

    w1, w3 = (torch.randn(EXPERTS, INTERMEDIATE, HIDDEN, generator=generator) * 0.02 for _ in range(2))
    w2 = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * 0.02
    parts = [packed(w, fmt, activations) for w in (w1, w2, w3)]
    whole = sum(w.nbytes for w in parts)
    banks = [
        ExpertWeights(copy_of(parts[0]), copy_of(parts[1]), "silu", w3=copy_of(parts[2]))
        for _ in range(copies_for(whole))
    ]
    pairs = [torch.tensor([[e, e + 1]]) for e in range(0, EXPERTS, TOP_K)]  # each expert once per round
    schedule = list(itertools.product(banks, pairs))
    x = torch.randn(1, HIDDEN, generator=generator)
    weights = torch.tensor([[0.6, 0.4]])

    def call(i: int) -> torch.Tensor:
        b, ids = schedule[i % len(schedule)]
        return ops.moe_experts(x, ids, weights, b)

    per_call = whole * TOP_K // EXPERTS  # the two experts' three matrices
    return {"op": "moe_experts T=1 k=2", "format": label, "seconds": median_seconds(call, reps), "bytes": per_call}


def mkl_linear(x: torch.Tensor, weight: Weight, _: int) -> torch.Tensor:
    """F.linear (MKL) on the weight as an fp32 tensor: a packed one dequantized first, in the timing."""
    return F.linear(x, float_weight(weight, torch.float32))


def prefill_rows(reps: int) -> list[str]:
    """linear on the LM head above 64 rows: the C++ kernel, dequantize + MKL, MKL on a kept fp32 copy."""
    n, k = LINEAR_SHAPES["lm_head"]
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(n, k, generator=generator) * 0.02
    lines = [f"{'format':>6} {'M':>5} {'C++ ms':>9} {'deq+MKL ms':>11} {'MKL fp32 ms':>12}"]
    for fmt in (WeightFormat.BF16, WeightFormat.INT8, WeightFormat.INT4):
        w = quantize(weight, fmt)
        dense = w.dequantize()
        for m in (64, 128, 256, 512):
            x = torch.randn(m, k, generator=generator)
            kernel = median_seconds(partial(rotating_linear, x, [w]), reps)
            dequant = median_seconds(partial(mkl_linear, x, w), reps)
            mkl = median_seconds(partial(mkl_linear, x, dense), reps)
            lines.append(f"{fmt.value:>6} {m:>5} {kernel * 1e3:>9.2f} {dequant * 1e3:>11.2f} {mkl * 1e3:>12.2f}")
    return lines


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", action="store_true", help="also linear at M = 64..512 against MKL")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    meter = CopyMeter(threads=args.threads)
    before = meter.measure()
    print(f"load average {load_average()}; copy bandwidth {before['copy_gb_s']:.1f} GB/s ({args.threads} threads)")
    rows = []
    for label, fmt, activations in FORMATS:
        if activations == "bf16" and not has_bf16_dot():
            continue
        for name in LINEAR_SHAPES:
            rows += linear_rows(label, fmt, activations, name, (1, 16, 64), args.reps)
        rows.append(moe_row(label, fmt, activations, args.reps))
    after = meter.measure()
    copy = (before["copy_gb_s"] + after["copy_gb_s"]) / 2
    fp32 = {r["op"]: r["seconds"] for r in rows if r["format"] == "fp32"}
    print(f"{'op':<24} {'format':>7} {'ms':>8} {'weight GB/s':>12} {'of copy':>8} {'vs fp32':>8}")
    for op in dict.fromkeys(r["op"] for r in rows):
        for r in (r for r in rows if r["op"] == op):
            rate = r["bytes"] / r["seconds"] / 1e9
            print(
                f"{op:<24} {r['format']:>7} {r['seconds'] * 1e3:>8.3f} {rate:>12.1f} {rate / copy:>7.0%} "
                f"{fp32[op] / r['seconds']:>7.2f}x"
            )
    print(f"copy bandwidth before {before['copy_gb_s']:.1f}, after {after['copy_gb_s']:.1f} GB/s")
    if args.prefill:
        print("\n".join(prefill_rows(max(5, args.reps // 5))))
    print(f"load average {load_average()}")


if __name__ == "__main__":
    main()
