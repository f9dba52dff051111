"""The plugin's V2 model state (vllm_plugin/model_state.py) driven through vLLM 0.33's own classes on CPU
tensors, step by step as the V2 runner drives it, and the per-token k expansion against a reference."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

from moe_serve.testing import create_random_artifact
from moe_serve.vllm_plugin.requests import expand_k
from tests.conftest import lm_config

pytestmark = pytest.mark.vllm_gpu

DEFAULT_K, MIN_K, MAX_K = 2, 1, 4
MAX_REQS, MAX_TOKENS = 8, 64


def reference_k(request_k: dict[int, int], slots: list[int], counts: list[int], padded: int) -> list[int]:
    """Each request's k repeated over its tokens, in batch order; padding gets the smallest k."""
    ks = [request_k[slot] for slot, n in zip(slots, counts, strict=True) for _ in range(n)]
    return ks + [MIN_K] * (padded - len(ks))


@pytest.mark.parametrize("seed", range(20))
def test_expand_k_matches_the_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_reqs = int(rng.integers(0, 7))
    slots = rng.permutation(MAX_REQS)[:num_reqs].tolist()
    counts = rng.integers(1, 9, num_reqs).tolist()
    request_k = {slot: int(rng.integers(MIN_K, MAX_K + 1)) for slot in range(MAX_REQS)}
    num_tokens = sum(counts)
    padded = num_tokens + int(rng.integers(0, 5))
    query_start_loc = torch.tensor(np.concatenate([[0], np.cumsum(counts)] + [[num_tokens]] * 2), dtype=torch.int32)
    out = torch.full((padded,), -7, dtype=torch.int64)
    expand_k(
        torch.tensor([request_k[s] for s in range(MAX_REQS)]),
        torch.tensor(slots, dtype=torch.int64),
        query_start_loc,
        num_reqs,
        num_tokens,
        MIN_K,
        out,
    )
    assert out.tolist() == reference_k(request_k, slots, counts, padded)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    config = lm_config(hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=64, max_position_embeddings=256)
    return create_random_artifact(tmp_path_factory.mktemp("v2") / "baby", config, seed=1)


def engine_config(artifact: Path) -> object:
    """vLLM's real engine config for a plugin artifact (the plugin's config hook runs in it)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(artifact), dtype="float32", max_num_seqs=MAX_REQS, max_num_batched_tokens=MAX_TOKENS)
    return args.create_engine_config()


@pytest.fixture(scope="module")
def vllm_config(artifact: Path) -> object:
    """Shared by the tests that only read it."""
    return engine_config(artifact)


@dataclasses.dataclass
class KRange:
    """The model attributes the model state reads (the plugin's model sets them from the artifact)."""

    default_k: int = DEFAULT_K
    min_k: int = MIN_K
    max_k: int = MAX_K


def new_request(req_id: str, k: int | None) -> NewRequestData:
    params = SamplingParams(max_tokens=4, extra_args=None if k is None else {"experts_per_token": k})
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=[1, 2, 3],
        mm_features=[],
        sampling_params=params,
        pooling_params=None,
        block_ids=([0],),
        num_computed_tokens=0,
        lora_request=None,
        prefill_token_ids=[1, 2, 3],
    )


def step_batch(slots: list[int], counts: list[int], padded: int) -> InputBatch:
    """A real InputBatch (vLLM's dummy constructor), laid out as the runner lays out a step: requests in
    `slots` (their request-state indices) with `counts` tokens each, padded to `padded` tokens."""
    num_reqs, num_tokens = len(slots), sum(counts)
    batch = InputBatch.make_dummy(num_reqs, num_tokens, InputBuffers(MAX_REQS, MAX_TOKENS, torch.device("cpu")))
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return dataclasses.replace(
        batch,
        idx_mapping=torch.tensor(slots, dtype=torch.int64),
        idx_mapping_np=np.asarray(slots),
        num_scheduled_tokens=np.asarray(counts, dtype=np.int32),
        num_tokens_after_padding=padded,
        query_start_loc=torch.from_numpy(starts),
        query_start_loc_np=starts,
    )


def test_model_state_gives_each_token_its_requests_k_step_by_step(vllm_config) -> None:
    """Chunked prefill, decodes, a request leaving and its slot reused, requests without k, padding: the
    per-token k the model receives equals the reference at every step, in one persistent buffer."""
    from vllm.v1.worker.gpu.model_states import resolve_model_state_cls

    from moe_serve.vllm_plugin.model import MoeServeForCausalLM
    from moe_serve.vllm_plugin.model_state import KWARG, MoeServeModelState

    assert resolve_model_state_cls(vllm_config, MoeServeForCausalLM) is MoeServeModelState
    state = MoeServeModelState(vllm_config, KRange(), None, torch.device("cpu"))
    captured = state.prepare_dummy_inputs(4, 16)[KWARG]  # what a CUDA graph would hold

    ks: dict[int, int] = {}

    def add(slot: int, k: int | None) -> None:
        state.add_request(slot, new_request(f"r{slot}-{k}", k))
        ks[slot] = DEFAULT_K if k is None else k

    def run(slots: list[int], counts: list[int], padded: int) -> None:
        got = state.prepare_inputs(step_batch(slots, counts, padded), None)[KWARG]
        assert got.tolist() == reference_k(ks, slots, counts, padded)
        assert got.data_ptr() == captured.data_ptr()  # the same buffer every step: a replay reads this step's k

    add(0, 1)
    add(3, 4)
    state.apply_staged_writes()
    run([0, 3], [5, 3], 16)  # two prompts' first chunks, padded
    add(5, None)  # no k: the model's default
    state.apply_staged_writes()
    run([0, 3, 5], [1, 2, 6], 16)  # a decode, a second chunk, a new prompt
    state.remove_request("r0-1")
    add(0, 3)  # slot 0 reused by another request
    state.apply_staged_writes()
    run([5, 0, 3], [1, 4, 1], 8)  # the runner's order is not the slots'
    run([3], [1], 1)  # batch of one, no padding


def test_out_of_range_k_is_clamped_not_crashing(vllm_config) -> None:
    """The validator refuses a bad k before it is queued; a request that skipped it gets the nearest k."""
    from moe_serve.vllm_plugin.model_state import KWARG, MoeServeModelState

    state = MoeServeModelState(vllm_config, KRange(), None, torch.device("cpu"))
    state.add_request(1, new_request("big", 99))
    state.add_request(2, new_request("text", "two"))  # type: ignore[arg-type]
    state.apply_staged_writes()
    got = state.prepare_inputs(step_batch([1, 2], [2, 1], 4), None)[KWARG]
    assert got.tolist() == [MAX_K, MAX_K, DEFAULT_K, MIN_K]


def test_gpu_platform_is_served_eagerly_with_the_gpu_worker(artifact: Path, monkeypatch) -> None:
    """The config hook on a CUDA platform: not refused; the GPU worker installed; CUDA graphs off until a
    GPU run shows replay equal to eager; speculative decoding and micro-batching refused by name."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.platforms import current_platform

    from moe_serve.vllm_plugin.config import GPU_WORKER, ModelConfigHook

    config = engine_config(artifact)  # its own: the hook is run on it again below
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    config.parallel_config.worker_cls = "auto"
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    ModelConfigHook.verify_and_update_config(config)
    assert config.parallel_config.worker_cls == GPU_WORKER
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    for field, value, refusal in (("speculative_config", object(), "speculative decoding"),):
        config.parallel_config.worker_cls = "auto"
        with monkeypatch.context() as patch:
            patch.setattr(config, field, value)
            with pytest.raises(ValueError, match=refusal):
                ModelConfigHook.verify_and_update_config(config)
    config.parallel_config.worker_cls = "auto"
    with monkeypatch.context() as patch:
        patch.setattr(config.parallel_config, "enable_dbo", True)
        with pytest.raises(ValueError, match="micro-batching"):
            ModelConfigHook.verify_and_update_config(config)


def test_the_v2_runner_loads_the_plugins_validator_and_it_refuses_a_bad_k(artifact: Path, monkeypatch) -> None:
    """Under the V2 runner vLLM loads logits processors through its V2 loader, which takes only its own
    interface (in the API process and in the worker): the hook gives it the V2 validator."""
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_by_fqcns

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    config = engine_config(artifact)
    assert config.use_v2_model_runner
    (validator,) = _load_v2_logitsprocs_by_fqcns(config.model_config.logits_processors)
    validator.validate_params(SamplingParams(extra_args={"experts_per_token": MAX_K}))
    with pytest.raises(VLLMValidationError, match="experts_per_token"):
        validator.validate_params(SamplingParams(extra_args={"experts_per_token": MAX_K + 1}))
    assert validator(config, None).add_request(0, SamplingParams()) is False  # the sampler skips it


def test_gpu_worker_classes_import() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    from moe_serve.vllm_plugin.worker import MoeServeGPUWorker

    assert issubclass(MoeServeGPUWorker, Worker)


def test_artifact_fixture_is_real(vllm_config) -> None:
    assert Path(vllm_config.model_config.model).is_dir()
