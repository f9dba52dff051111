"""How to run a model (EngineConfig) and what one request may ask for (RequestLimits), separate from
ModelConfig (what the model is). Each default is written here once: the command line derives its options
from these fields (`help` in each field's metadata), the server and the batch runner take the objects."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_serve.errors import ValidationError
from moe_serve.options import option
from moe_serve.sampling_params import check_int

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    device: str = option("auto", "auto (CUDA when present, else CPU), cpu, cuda or cuda:N")
    dtype: str = option("auto", "auto (bfloat16 on CUDA, float32 on CPU), float32, float16 or bfloat16")
    max_num_seqs: int = option(64, "sequences decoded together in one step (also the number of KV-cache slots)")
    max_model_len: int | None = option(None, "longest prompt + completion in tokens (default: the model's context)")
    verify_checksums: bool = option(True, "check the artifact's sha256 checksums when loading", cli=False)
    kv_cache_tokens: int | None = option(
        None,
        "KV-cache budget in tokens: running sequences reserve prompt + max_tokens each; a request that can never "
        "fit is refused, others wait (default: max_num_seqs x max_model_len)",
    )
    max_waiting: int = option(256, "requests queued per model before new ones are refused with 429")

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_waiting", self.max_waiting, 1)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 1)
        if self.kv_cache_tokens is not None:
            check_int("kv_cache_tokens", self.kv_cache_tokens, 1)
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValidationError(
                f"dtype must be auto or one of {', '.join(_DTYPES)}; got {self.dtype!r}", parameter="dtype"
            )

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return _DTYPES[self.dtype]


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one API request may ask for, the same over HTTP and in batch files."""

    max_tokens_cap: int = option(4096, "the largest max_tokens a request may ask for")

    def __post_init__(self) -> None:
        check_int("max_tokens_cap", self.max_tokens_cap, 1)
