"""The machine's memory bandwidth, measured as the roofline uses it: copying a buffer with the benchmark's
threads (bytes read + bytes written, per second), and reading one (a sum)."""

from __future__ import annotations

import time

import torch


class CopyMeter:
    """Buffers allocated (and their pages committed) once, so that measurements can be repeated next to the
    runs they are compared with."""

    def __init__(self, threads: int = 2, mib: int = 512) -> None:
        self.threads = threads
        self.src = torch.ones(mib * 2**20 // 4)
        self.dst = torch.zeros_like(self.src)

    def measure(self, reps: int = 5) -> dict[str, float]:
        """Medians of `reps` copies and reads, GB/s, with the meter's threads (the caller's are restored)."""
        caller_threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        nbytes = self.src.numel() * 4
        copies, reads = [], []
        try:
            for _ in range(reps):
                start = time.perf_counter()
                self.dst.copy_(self.src)
                copies.append(2 * nbytes / (time.perf_counter() - start) / 1e9)
                start = time.perf_counter()
                self.src.sum()
                reads.append(nbytes / (time.perf_counter() - start) / 1e9)
        finally:
            torch.set_num_threads(caller_threads)
        copies.sort()
        reads.sort()
        return {"copy_gb_s": copies[len(copies) // 2], "read_gb_s": reads[len(reads) // 2], "threads": self.threads}


def copy_bandwidth(threads: int = 2, mib: int = 512, reps: int = 7) -> dict[str, float]:
    return CopyMeter(threads, mib).measure(reps)
