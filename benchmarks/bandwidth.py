"""The machine's memory bandwidth, measured as the roofline uses it: copying a 512 MiB buffer with the
benchmark's threads (bytes read + bytes written, per second), and reading one (a sum)."""

from __future__ import annotations

import time

import torch


def copy_bandwidth(threads: int = 2, mib: int = 512, reps: int = 7) -> dict[str, float]:
    torch.set_num_threads(threads)
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    copies, reads = [], []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        copies.append(2 * src.numel() * 4 / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        src.sum()
        reads.append(src.numel() * 4 / (time.perf_counter() - start) / 1e9)
    copies.sort()
    reads.sort()
    return {"copy_gb_s": copies[len(copies) // 2], "read_gb_s": reads[len(reads) // 2], "threads": threads}
