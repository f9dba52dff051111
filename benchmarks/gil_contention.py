"""What a serving thread's Python work costs the engine thread through the GIL: the time of a small engine-like
step (tensor ops, each of which gives the GIL up and must win it back) alone, and beside a thread that tokenizes
the mix's score request (256 texts of 510 characters) without pause, per text with `tokenizers`' `encode` (the
GIL held for each text) or with `encode_batch` (the GIL released while it runs), at two switch intervals.

    .venv/bin/python -m benchmarks.gil_contention [--steps 40] [--json PATH]

Each figure is the median step in milliseconds; the 1-minute load average is printed beside them (the machine
has 2 cores: any other process skews every figure). What it shows drove moe_serve.tokenizer's `encode_many` and
the engine process's switch interval (moe_serve.engine.async_engine.SWITCH_INTERVAL).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time

import torch

from moe_serve.tokenizer import Tokenizer, byte_level_tokenizer

TEXTS = 256
TEXT_CHARS = 510
OPS = 20  # a step of this many small tensor ops: a decode step of a small model is of this order


def _step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(OPS):
        x = torch.nn.functional.linear(x, w)
    return x


def _median_step_ms(steps: int) -> float:
    x, w = torch.randn(4, 1024), torch.randn(1024, 1024) / 32
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _step(x, w)
        times.append(time.perf_counter() - start)
        time.sleep(0.001)  # as the engine between steps: the other thread runs alone meanwhile
    return statistics.median(times) * 1e3


def _measure(tokenizer: Tokenizer, texts: list[str], how: str, steps: int) -> float:
    stop = threading.Event()

    def tokenize() -> None:
        hf = tokenizer.hf
        while not stop.is_set():
            if how == "encode":
                for text in texts:
                    hf.encode(text, add_special_tokens=False)
            else:
                tokenizer.encode_many(texts)

    thread = threading.Thread(target=tokenize, daemon=True) if how != "alone" else None
    if thread is not None:
        thread.start()
        time.sleep(0.05)
    try:
        return _median_step_ms(steps)
    finally:
        stop.set()
        if thread is not None:
            thread.join()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one engine thread's ops; the tokenizing thread has the other core
    tokenizer = Tokenizer(byte_level_tokenizer())
    rng = random.Random(0)
    texts = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(TEXT_CHARS)) for _ in range(TEXTS)]
    figures: dict[str, dict[str, float]] = {}
    default_interval = sys.getswitchinterval()
    try:
        for interval in (0.005, 0.001):
            sys.setswitchinterval(interval)
            row = {how: _measure(tokenizer, texts, how, args.steps) for how in ("alone", "encode", "encode_batch")}
            figures[f"switch interval {interval * 1e3:g} ms"] = row
    finally:
        sys.setswitchinterval(default_interval)
    load = os.getloadavg()[0]
    print(f"median step, ms (load average {load:.2f})")
    print(f"{'':24} {'alone':>8} {'encode':>8} {'encode_batch':>13}")
    for name, row in figures.items():
        print(f"{name:24} {row['alone']:8.2f} {row['encode']:8.2f} {row['encode_batch']:13.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_average": load, "median_step_ms": figures}, f, indent=2)


if __name__ == "__main__":
    main()
