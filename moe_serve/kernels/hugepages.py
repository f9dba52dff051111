"""Host tensors backed by transparent huge pages (2 MiB), for the large tensors a decode step streams: the
weights and the KV-cache pool.

A batch-1 decode step reads every weight once, so its speed is the memory bandwidth the kernels reach.
With 4 KiB pages a 128 MiB weight spans 32,768 pages and the stream takes a TLB miss every 4 KiB; with
2 MiB pages, 64. Measured on the development machine (2-core EPYC VM, `python -m benchmarks.hugepages`):
the C++ linear kernel streams a 32,000 x 1,024 weight 5-14% faster from huge pages, interleaved runs in
one process.

Linux only hands huge pages to private anonymous mappings that ask for them (`madvise`, the default
`transparent_hugepage` mode), which PyTorch's allocator does not do unless THP_MEM_ALLOC_ENABLE is set
before its first allocation. Elsewhere, or for small tensors, this is plain `torch.empty`. Pages are
committed on first touch, 2 MiB at a time (a KV block's first write commits its whole huge page; with the
kernel's default `defrag=madvise` that first fault may compact memory).
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20


def supported() -> bool:
    return all(hasattr(mmap, name) for name in ("MADV_HUGEPAGE", "MAP_PRIVATE", "MAP_ANONYMOUS"))


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised tensor; on the CPU and from 2 MiB up, in memory advised to use huge pages."""
    device = torch.device(device)
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < HUGE_PAGE or not supported():
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
def place(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`tensor` as `dtype` (default: its own), copied into huge-page memory (contiguous) where `empty` would
    use it, in one copy; else `tensor.to(dtype)`."""
    dtype = dtype or tensor.dtype
    nbytes = tensor.numel() * torch.empty((), dtype=dtype).element_size()
    if tensor.device.type != "cpu" or nbytes < HUGE_PAGE or not supported():
        return tensor.detach().to(dtype)
    out = empty(tensor.shape, dtype)
    out.copy_(tensor.detach())
    return out
