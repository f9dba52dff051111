"""Host tensors backed by transparent huge pages (2 MiB), for the large tensors a decode step streams: the
weights. (Not the KV-cache pool: it is committed block by block as it fills, and a huge page would commit
2 MiB at once on the step that first writes it; engine.kv_cache says what that cost.)

A batch-1 decode step reads every weight once, so its speed is the memory bandwidth the kernels reach.
With 4 KiB pages a 128 MiB weight spans 32,768 pages and the stream takes a TLB miss every 4 KiB; with
2 MiB pages, 64. Measured on the development machine (2-core EPYC VM, `python -m benchmarks.hugepages`):
the C++ linear kernel streams a 32,000 x 1,024 weight 5-14% faster from huge pages, interleaved runs in
one process.

Linux only hands huge pages to private anonymous mappings that ask for them (`madvise`, the default
`transparent_hugepage` mode), which PyTorch's allocator does not do unless THP_MEM_ALLOC_ENABLE is set
before its first allocation. Elsewhere, or for small tensors, this is plain `torch.empty`. Pages are
committed on first touch, 2 MiB at a time (with the kernel's default `defrag=madvise` that first fault may
compact memory).
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def supported() -> bool:
    return all(hasattr(mmap, name) for name in ("MADV_HUGEPAGE", "MAP_PRIVATE", "MAP_ANONYMOUS"))


def _huge(nbytes: int, device: torch.device) -> bool:
    """Whether a tensor of nbytes on device goes into huge-page memory."""
    return device.type == "cpu" and nbytes >= HUGE_PAGE and supported()


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised tensor; on the CPU and from 2 MiB up, in memory advised to use huge pages."""
    device = torch.device(device)
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if not _huge(nbytes, device):
        return torch.empty(shape, dtype=dtype, device=device)
    # Private and anonymous: a shared mapping (mmap.mmap(-1, n)'s default) is shmem, which gets no THP.
    # A whole number of huge pages: kernels that align only such mappings to 2 MiB still align this one.
    # The tensor holds a reference to the mapping, which is unmapped when the last tensor using it goes.
    region = mmap.mmap(-1, -(-nbytes // HUGE_PAGE) * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without THP, or a sandbox refusing madvise: the advice is optional
        pass
    return torch.frombuffer(region, dtype=dtype, count=numel).view(shape)


@torch.no_grad()
def place(
    tensor: torch.Tensor, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> torch.Tensor:
    """`tensor` as `dtype` (default: its own) on `device` (default: its own), in one copy: into huge-page
    memory (contiguous) where `empty` would use it, else `tensor.to(device, dtype)`."""
    dtype = dtype or tensor.dtype
    device = torch.device(device) if device is not None else tensor.device
    if not _huge(tensor.numel() * dtype.itemsize, device):
        return tensor.detach().to(device, dtype)
    out = empty(tensor.shape, dtype)
    out.copy_(tensor.detach())
    return out
