"""A static KV cache: one slot (row) per running sequence, keys at their absolute positions.

Slot bookkeeping is plain Python; the tensors are allocated once for `num_slots` x `max_len`.
"""

from __future__ import annotations

import torch

from moe_serve.model_config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, num_slots: int, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        assert config.num_kv_heads is not None and config.head_dim is not None
        shape = (num_slots, config.num_kv_heads, max_len, config.head_dim)  # [slots, G, max_len, Dh]
        self.layers = [
            (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
            for _ in range(config.num_layers)
        ]
        self.num_slots = num_slots
        self.max_len = max_len
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)
