"""A KV cache with one slot (row) per running sequence, keys at their absolute positions.

Rows are allocated as long as the longest running sequence needs and grow by doubling (up to
max_len), so memory follows use. Slot bookkeeping is plain Python.
"""

from __future__ import annotations

import torch

from moe_serve.model_config import ModelConfig


class KVCache:
    def __init__(
        self, config: ModelConfig, num_slots: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        assert config.num_kv_heads is not None and config.head_dim is not None
        self._row_shape = (config.num_kv_heads, config.head_dim)  # [G, Dh]
        self._num_layers = config.num_layers
        self._device, self._dtype = device, dtype
        self.num_slots = num_slots
        self.max_len = max_len
        self.length = 0
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def ensure_length(self, length: int) -> None:
        """Make every row hold at least `length` positions, keeping what is cached."""
        if length <= self.length:
            return
        new_length = min(max(length, 2 * self.length, 64), self.max_len)
        g, dh = self._row_shape
        shape = (self.num_slots, g, new_length, dh)  # [slots, G, positions, Dh]
        grown = []
        for i in range(self._num_layers):
            k = torch.zeros(shape, device=self._device, dtype=self._dtype)
            v = torch.zeros(shape, device=self._device, dtype=self._dtype)
            if self.layers:
                k[:, :, : self.length] = self.layers[i][0]
                v[:, :, : self.length] = self.layers[i][1]
            grown.append((k, v))
        self.layers, self.length = grown, new_length
