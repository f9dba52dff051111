"""Per-request k for vLLM's V2 model runner (its GPU default): a model-state class, which the runner takes
from the model (`MoeServeForCausalLM.get_model_state_cls`).

Each request's k is staged on the device when the request is added (one slot per request, vLLM's
StagedWriteTensor), and each step expands it to every token on the device (`requests.expand_k`) into one
persistent buffer: the same tensor is handed to the model at CUDA-graph capture (`prepare_dummy_inputs`)
and at every step (`prepare_inputs`), so a replayed graph, which passes no new inputs, reads this step's k.
Padding tokens (up to a graph's size) take the model's smallest k.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.worker.gpu.buffer_utils import StagedWriteTensor
from vllm.v1.worker.gpu.model_states.default import DefaultModelState

from moe_serve.vllm_plugin.requests import expand_k, requested_k

KWARG = "experts_per_token"  # the model's forward argument


class MoeServeModelState(DefaultModelState):
    def __init__(self, vllm_config: Any, model: Any, encoder_cache: Any, device: torch.device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        self.default_k, self.min_k, self.max_k = model.default_k, model.min_k, model.max_k
        self.request_k = StagedWriteTensor(self.max_num_reqs, torch.int64, device)  # [R] by request slot
        self.request_k.gpu.fill_(self.default_k)  # profiling and dummy runs read slots no request wrote
        self.token_k = torch.full((self.max_num_tokens,), self.min_k, dtype=torch.int64, device=device)  # [T]

    def add_request(self, req_index: int, new_req_data: Any) -> None:
        super().add_request(req_index, new_req_data)
        k = requested_k(new_req_data.sampling_params, self.default_k, self.min_k, self.max_k)
        self.request_k.stage_write_elem(req_index, k)

    def apply_staged_writes(self) -> None:
        super().apply_staged_writes()
        self.request_k.apply_write()

    def prepare_inputs(self, input_batch: Any, req_states: Any) -> dict[str, Any]:
        inputs = super().prepare_inputs(input_batch, req_states)
        out = self.token_k[: input_batch.num_tokens_after_padding]
        expand_k(
            self.request_k.gpu,
            input_batch.idx_mapping,
            input_batch.query_start_loc,
            input_batch.num_reqs,
            input_batch.num_tokens,
            self.min_k,
            out,
        )
        return {**inputs, KWARG: out}

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict[str, Any]:
        inputs = super().prepare_dummy_inputs(num_reqs, num_tokens)
        return {**inputs, KWARG: self.token_k[:num_tokens]}  # the buffer prepare_inputs fills, as captured
