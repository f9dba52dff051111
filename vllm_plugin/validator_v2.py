"""The request validator for vLLM's V2 model runner, whose logits processors implement another interface than
the V1 runner's (requests.ExpertsPerTokenValidator): the same validation, no logit changed, and no row ever
taken (add_request returns False, so the sampler skips it)."""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor

from moe_serve.vllm_plugin.requests import validate_request


class ExpertsPerTokenValidatorV2(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        validate_request(sampling_params)

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        return False

    def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        return logits
