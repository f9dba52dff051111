"""Storage dtypes an exporter may write, by the names the command line accepts."""

from __future__ import annotations

import torch

STORAGE_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
