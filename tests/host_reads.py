"""HostReads: the ops of a region that would make a CUDA stream wait for the host, recorded on any device
(so CPU tests catch what would break a CUDA graph or stall every step)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    """Records the ops that read a tensor on the host or size their output by its values, and the host
    values made into tensors (lift_fresh: `t[i] = 0`, `torch.tensor(list)`), which on CUDA are copies
    from pageable memory that wait for the device."""

    SYNCING = {
        "_local_scalar_dense",
        "nonzero",
        "bincount",
        "masked_select",
        "unique",
        "repeat_interleave",
        "lift_fresh",
    }

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        indices = args[1] if name in ("index", "index_put", "index_put_", "_index_put_impl_") else ()
        if name in self.SYNCING or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))
