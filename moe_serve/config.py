"""How to run a model (EngineConfig) and what one request may ask for (RequestLimits), separate from
ModelConfig (what the model is). Each default is written here once: the command line derives its options
from these fields (`help` in each field's metadata), the server and the batch runner take the objects."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_serve.errors import ValidationError
from moe_serve.kernels.packed import CPU_ACTIVATIONS, PACKED_FORMAT_NAMES
from moe_serve.options import option
from moe_serve.validation import check_int, check_number

BACKENDS = ("torch", "onnxruntime")  # what runs the forward pass: moe_serve.engine.backend
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    device: str = option("auto", "auto (CUDA when present, else CPU), cpu, cuda or cuda:N")
    dtype: str = option("auto", "auto (bfloat16 on CUDA, float32 on CPU), float32, float16 or bfloat16")
    backend: str = option(
        "torch",
        "torch, or onnxruntime: an ONNX export of the model (an export directory, or an artifact exported on first "
        "use into ~/.cache/moe-serve/onnx); fp32, one k per request (no moe policies)",
        choices=BACKENDS,
    )
    weights: str | None = option(
        None,
        "pack the artifact's float weights as they load: bf16, int8 or int4 (fp16 scale per group of 32), read by the "
        "CPU kernels with float32 activations; an artifact written by `moe-serve quantize` carries its format already",
        choices=PACKED_FORMAT_NAMES,
    )
    cpu_activations: str = option(
        "fp32",
        "the lowest precision the CPU kernels may round a packed weight's input to: fp32 (exact); bf16: bf16 weights "
        "read bf16 activations (vdpbf16ps, on CPUs with AVX-512 BF16; else fp32); int8: as bf16, and int8 and int4 "
        "weights read int8 activations (blocks of 32, an fp32 scale each, integer dot products); auto: as int8 but "
        "attention's projections, which keep fp32 (docs/weight-formats.md)",
        choices=CPU_ACTIVATIONS,
    )
    cuda_graphs: bool = option(
        True,
        "on CUDA, replay captured graphs for steps that only decode (batch-size buckets up to --max-num-seqs); "
        "--no-cuda-graphs runs every step eagerly",
    )
    cpu_decode_stack: bool = option(
        True,
        "on the CPU, run the layers of decode-only steps in one C++ call (plain top-k MoE decoders: "
        "docs/architecture.md §6); --no-cpu-decode-stack runs them layer by layer in Python",
    )
    max_num_seqs: int = option(64, "sequences in one engine step")
    max_num_batched_tokens: int = option(
        2048, "tokens in one engine step (prompts are prefilled in chunks; a classified input must fit whole)"
    )
    max_model_len: int | None = option(None, "longest prompt + completion in tokens (default: the model's context)")
    verify_checksums: bool = option(True, "check the artifact's sha256 checksums when loading", cli=False)
    kv_cache_memory: int = option(
        1 << 30, "bytes of KV cache (paged in blocks, allocated once; suffixes KiB, MiB, GiB accepted)", type="size"
    )
    kv_cache_tokens: int | None = option(
        None, "the KV-cache budget counted in tokens instead (a request that can never fit is refused)"
    )
    block_size: int = option(16, "tokens per KV-cache block")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompt prefixes computed at the same k")
    max_join_stall: float = option(
        3.0, "while sequences decode, a step that prefills a prompt chunk costs at most this many decode steps"
    )
    long_prefill_threshold: int = option(
        512,
        "a prompt (or scored or classified input) of more tokens than this is long while it is prefilled (see "
        "--max-long-prefills, --long-prefill-chunk)",
    )
    long_prefill_chunk: int = option(
        128,
        "a long prompt's chunk per step: at most this many tokens and, deeper in the prompt, at most what this many "
        "cost from its start (beside decodes, the join-stall bound), so that steps stay short and a newly arrived "
        "request waits at most one short step",
    )
    long_prefill_alone_ms: float = option(
        80.0,
        "when long prompts are all the engine runs (bulk scoring), a step's chunk may cost this many ms (by the "
        "measured costs) instead of --long-prefill-chunk tokens: throughput as without the limits, and a request "
        "arriving meanwhile waits at most this long for the step in flight",
    )
    max_long_prefills: int = option(
        1,
        "long prompts prefilled at once; more wait while shorter requests queued behind them are admitted (a "
        "16-input /v1/score cannot hold a short completion back)",
    )
    max_waiting: int = option(256, "requests queued per model before new ones are refused with 429")
    target_itl_ms: float | None = option(
        None,
        'inter-token latency target (ms) for requests with experts_per_token "auto": each step the engine runs '
        "them at the highest k that holds it at the current load, and lowers k before it refuses work",
    )
    target_ttft_ms: float | None = option(
        None, 'with --target-itl-ms: also lower "auto" k while the time to first token runs over this (ms)'
    )

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_waiting",
            "block_size",
            "kv_cache_memory",
            "long_prefill_threshold",
            "long_prefill_chunk",
            "max_long_prefills",
        ):
            check_int(name, getattr(self, name), 1)
        for name in ("max_model_len", "kv_cache_tokens"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        if not self.long_prefill_alone_ms >= 0.0:
            raise ValidationError(
                f"long_prefill_alone_ms must be at least 0, got {self.long_prefill_alone_ms}",
                parameter="long_prefill_alone_ms",
            )
        if not self.max_join_stall >= 1.0:
            raise ValidationError(
                f"max_join_stall must be at least 1, got {self.max_join_stall}", parameter="max_join_stall"
            )
        if self.backend not in BACKENDS:
            raise ValidationError(
                f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}", parameter="backend"
            )
        for name in ("target_itl_ms", "target_ttft_ms"):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name), 0.0, 3_600_000.0)
                if getattr(self, name) == 0:
                    raise ValidationError(f"{name} must be greater than 0, got 0", parameter=name)
        if self.target_ttft_ms is not None and self.target_itl_ms is None:
            raise ValidationError(
                'target_ttft_ms needs target_itl_ms (the latency target that enables experts_per_token "auto")',
                parameter="target_ttft_ms",
            )
        if self.weights is not None and self.weights not in PACKED_FORMAT_NAMES:
            raise ValidationError(
                f"weights must be one of {', '.join(PACKED_FORMAT_NAMES)}; got {self.weights!r}", parameter="weights"
            )
        if self.cpu_activations not in CPU_ACTIVATIONS:
            raise ValidationError(
                f"cpu_activations must be one of {', '.join(CPU_ACTIVATIONS)}; got {self.cpu_activations!r}",
                parameter="cpu_activations",
            )
        if self.weights is not None and self.backend != "torch":
            raise ValidationError(
                f"--weights packs the torch backend's weights; --backend {self.backend} runs an ONNX export of the "
                "float weights",
                parameter="weights",
            )
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
    max_prompts: int = option(256, "prompts in one completion request")
    max_inputs: int = option(256, "inputs in one classify or score request")
    max_request_tokens: int = option(
        262144,
        "a request's total work: the tokens of all its prompts (completions) or inputs (classify, score) together",
    )

    def __post_init__(self) -> None:
        for name in ("max_tokens_cap", "max_prompts", "max_inputs", "max_request_tokens"):
            check_int(name, getattr(self, name), 1)

    def check_work(self, token_counts: list[int], parameter: str) -> None:
        """Refuse (400, naming `parameter`) a request whose prompts or inputs hold more than
        `max_request_tokens` tokens together."""
        total = sum(token_counts)
        if total > self.max_request_tokens:
            raise ValidationError(
                f"{parameter} has {len(token_counts)} item(s) of {total} tokens in all; at most "
                f"{self.max_request_tokens} tokens per request (max_request_tokens, --max-request-tokens)",
                parameter=parameter,
            )
