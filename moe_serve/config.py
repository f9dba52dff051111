"""Engine configuration (how to run a model), separate from ModelConfig (what the model is)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_serve.errors import ValidationError
from moe_serve.sampling_params import check_int

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Args:
    device: "auto" (CUDA when present, else CPU), "cpu", "cuda" or "cuda:N".
    dtype: "auto" (bfloat16 on CUDA, float32 on CPU) or a name in float32/float16/bfloat16.
    max_num_seqs: sequences decoded together in one step (also the number of KV-cache slots).
    max_model_len: longest prompt + completion in tokens (None: the model's max_position_embeddings).
    verify_checksums: check the artifact's sha256 checksums when loading.
    kv_cache_tokens: KV-cache budget in tokens: running sequences reserve prompt + max_tokens each; a request
        that can never fit is refused, others wait (None: max_num_seqs * max_model_len).
    """

    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_model_len: int | None = None
    verify_checksums: bool = True
    kv_cache_tokens: int | None = None

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 1)
        if self.kv_cache_tokens is not None:
            check_int("kv_cache_tokens", self.kv_cache_tokens, 1)
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValidationError(f"dtype must be auto or one of {', '.join(_DTYPES)}; got {self.dtype!r}", parameter="dtype")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return _DTYPES[self.dtype]
