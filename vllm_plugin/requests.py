"""A request's experts_per_token inside vLLM: validated before it is queued, part of its prefix-cache keys,
and read by the worker when it lays out a step."""

from __future__ import annotations

from typing import Any

import torch
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from moe_serve.errors import ValidationError
from moe_serve.model_config import ModelConfig
from moe_serve.validation import check_int

KEY = "experts_per_token"  # in vllm_xargs (REST) and SamplingParams.extra_args (Python)
VALIDATOR = "moe_serve.vllm_plugin.requests:ExpertsPerTokenValidator"  # vLLM's V1 runner
VALIDATOR_V2 = "moe_serve.vllm_plugin.validator_v2:ExpertsPerTokenValidatorV2"  # its V2 runner (a GPU build's)
# Per-request moe-serve fields vLLM would otherwise carry without effect: refused by name.
NOT_IN_VLLM = {"moe": "top-p policies (moe) choose k per token and are not wired into vLLM; give experts_per_token"}

_served: ModelConfig | None = None  # the artifact of this process's engine (ModelConfigHook sets it)


def serve(config: ModelConfig) -> None:
    global _served
    _served = config


def requested_k(params: Any, default: int, low: int, high: int) -> int:
    """The k a request asked for (SamplingParams.extra_args), or the model's default. The validator refused
    anything else where vLLM validates; a request that reached the engine by a path that skips validation
    gets the default for a non-integer and the nearest allowed k for one out of range, never a crash."""
    value = ((getattr(params, "extra_args", None) or {}) if params is not None else {}).get(KEY)
    if value is None or isinstance(value, bool) or not isinstance(value, int):
        return default
    return min(max(value, low), high)


def validate_request(sampling_params: Any) -> None:
    """A request's moe-serve fields, checked where vLLM accepts it: VLLMValidationError is vLLM's HTTP 400 (and
    LLM.generate's exception), naming the field."""
    extra = sampling_params.extra_args or {}
    for name, why in NOT_IN_VLLM.items():
        if name in extra:
            raise VLLMValidationError(f"{name}: {why}", parameter=name, value=extra[name])
    value = extra.get(KEY)
    if value is None:
        return
    moe = _served.moe if _served is not None else None
    try:
        if moe is None:
            raise ValidationError(f"{KEY} was given but the served model has no MoE layers", parameter=KEY)
        check_int(KEY, value, moe.min_k, moe.max_k)  # moe-serve's own rule and wording
    except ValidationError as exc:
        raise VLLMValidationError(str(exc), parameter=KEY, value=value) from None


class ExpertsPerTokenValidator(LogitsProcessor):
    """Changes no logit: a V1-runner logits processor only for `validate_params`, which vLLM calls in the
    process that accepts the request, before it is queued (validator_v2.py: the V2 runner's twin)."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        validate_request(sampling_params)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass


def register() -> None:
    """Prefix caching keys a block by its tokens and the keys vLLM knows (LoRA, multimodal inputs, cache
    salt), not by extra_args; the same prompt at another k has other keys and values in every layer after
    the first MoE layer. vLLM 0.32 gathers a request's extra keys in kv_cache_utils; the LoRA part is
    looked up there at call time and is added to every block, so the request's k is added with it."""
    from vllm.v1.core import kv_cache_utils

    original = kv_cache_utils._gen_lora_extra_hash_keys
    if getattr(original, "moe_serve", False):
        return

    def lora_and_k_keys(request: Any) -> list:
        keys = original(request)
        params = getattr(request, "sampling_params", None)
        value = (params.extra_args or {}).get(KEY) if params is not None else None
        return keys if value is None else [*keys, (KEY, str(value))]  # as given: never raises here

    lora_and_k_keys.moe_serve = True  # type: ignore[attr-defined]
    kv_cache_utils._gen_lora_extra_hash_keys = lora_and_k_keys


def expand_k(
    request_k: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_reqs: int,
    num_tokens: int,
    pad_k: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Each token's k on the device, from each request's (the V2 runner's layout): request_k [R] by request
    slot, idx_mapping [B] the slot of each request in the step, query_start_loc [>= B + 1] the first token of
    each (cumulative), num_tokens the real tokens; the rest of `out` (padding up to a CUDA-graph size, out's
    length) gets pad_k. Written into `out` in place (a persistent buffer a captured graph reads) -> out.
    Device ops only: no host sync, no Python per token or request."""
    positions = torch.arange(out.shape[0], device=out.device, dtype=query_start_loc.dtype)
    if num_reqs == 0:
        return out.fill_(pad_k)
    ends = query_start_loc[1 : num_reqs + 1]  # [B] one past each request's last token
    request = torch.searchsorted(ends, positions, right=True).clamp(max=num_reqs - 1)  # [T]
    k = request_k[idx_mapping[:num_reqs][request]]
    return out.copy_(torch.where(positions < num_tokens, k, pad_k))
