"""The batch-1 roofline per weight format: moe-serve's decode step at batch 1 (decode only, the C++ decode
stack on) against the copy bandwidth measured in the same run, as a fraction of the rate at which the step's
bytes could stream (benchmarks.models.BenchModel.packed_decode_bytes: the packed weights at their bits per
weight, scales included; the router, norms and fp32 KV cache as they are).

    python -m benchmarks.format_roofline [--model medium] [--k 2] [--steps 48] [--cpu-activations fp32,auto]

Each format runs under each --cpu-activations mode given (packed.CPU_ACTIVATIONS; fp32 weights read fp32 in
every mode, so they run once).
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks import bandwidth
from benchmarks.models import DEFAULT_CACHE, build
from benchmarks.profile_step import decoding, time_steps
from moe_serve.kernels.packed import CPU_ACTIVATIONS

BITS = {"fp32": 32.0, "bf16": 16.0, "int8": 8.5, "int4": 4.5}  # per weight, the fp16 group scales included


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="medium")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--cpu-activations", default="fp32,auto", help="comma-separated modes")
    args = parser.parse_args()
    modes = args.cpu_activations.split(",")
    unknown = [m for m in modes if m not in CPU_ACTIVATIONS]
    if unknown:
        parser.error(f"--cpu-activations: {', '.join(unknown)} not one of {', '.join(CPU_ACTIVATIONS)}")
    torch.set_num_threads(2)
    model = build(args.model, DEFAULT_CACHE)
    copy = bandwidth.copy_bandwidth()["copy_gb_s"]
    print(f"{args.model}, k = {args.k}, batch 1; copy bandwidth {copy:.1f} GB/s; load {os.getloadavg()[0]:.2f}")
    print("| weights | activations | ms per decode step | bytes per step (MB) | roofline tok/s | tok/s | fraction |")
    print("|---|---|---|---|---|---|---|")
    for fmt, bits in BITS.items():
        for mode in modes[:1] if fmt == "fp32" else modes:
            run = argparse.Namespace(
                model_dir=str(model.artifact), batch=1, k=args.k, steps=args.steps, prompt_len=32,
                weights=None if fmt == "fp32" else fmt, cpu_activations=mode,
            )  # fmt: skip
            seconds = time_steps(decoding(run, decode_stack=True), args.steps)
            step_bytes = model.packed_decode_bytes(args.k, bits)
            roofline = copy * 1e9 / step_bytes
            print(
                f"| {fmt} | {mode} | {seconds * 1e3:.2f} | {step_bytes / 1e6:.0f} | {roofline:.0f} | "
                f"{1 / seconds:.0f} | {1 / seconds / roofline:.0%} |",
                flush=True,
            )
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
