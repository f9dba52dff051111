"""The artifact's config.json as vLLM reads it, and the one check of what the plugin can serve."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig
from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.transformers_utils.config import HFConfigParser, register_config_parser

from moe_serve.artifact import CONFIG_FILE, WEIGHTS_FILE, check_checksums, check_tensors, read_manifest, weights_spec
from moe_serve.engine.kv_cache import router_state_sizes
from moe_serve.layers.routers import router_class
from moe_serve.model_config import ModelConfig
from moe_serve.vllm_plugin.parallel import Shards
from moe_serve.vllm_plugin.parallel import problems as parallel_problems
from moe_serve.weights import packed_refusal

logger = logging.getLogger(__name__)

ARCHITECTURE = "MoeServeForCausalLM"  # what vLLM's registry knows an artifact by (its config's architectures)

MODEL_TYPE = "moe_serve"
# vLLM's CPU attention kernels (vllm/v1/attention/backends/cpu_attn.py) take these head sizes.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class MoeServeConfig(PretrainedConfig):
    """The Hugging Face-style fields vLLM reads, derived from the artifact's ModelConfig (kept whole in
    `moe_serve_model`, the `model` object of config.json)."""

    model_type = MODEL_TYPE

    def __init__(self, moe_serve_model: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.moe_serve_model = moe_serve_model
        if moe_serve_model is not None:
            config = ModelConfig.from_dict(moe_serve_model)
            moe = config.moe
            eos = config.eos_token_id
            kwargs.update(
                architectures=[ARCHITECTURE],
                vocab_size=config.vocab_size,
                hidden_size=config.hidden_size,
                num_hidden_layers=config.num_layers,
                num_attention_heads=config.num_heads,
                num_key_value_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                max_position_embeddings=config.max_position_embeddings,
                rope_theta=config.rope_theta,
                num_experts=moe.num_experts if moe is not None else 0,
                num_experts_per_tok=moe.default_k if moe is not None else 0,
                tie_word_embeddings=config.tie_word_embeddings,
                bos_token_id=config.bos_token_id,
                eos_token_id=list(eos) if isinstance(eos, tuple) else eos,
            )
        super().__init__(**kwargs)

    @property
    def model_config(self) -> ModelConfig:
        assert self.moe_serve_model is not None
        return ModelConfig.from_dict(self.moe_serve_model)


def is_artifact(model: str | Path) -> bool:
    path = Path(model) / CONFIG_FILE
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("format") == "moe-serve"
    except (OSError, ValueError, AttributeError):
        return False


def unsupported(config: ModelConfig) -> list[str]:
    """What in this model vLLM's kernels or this plugin cannot run, each named (empty: it serves)."""
    problems = []
    if config.task != "causal_lm":
        problems.append(
            f"task {config.task} (the plugin serves causal LMs; vLLM's pooling runners take no per-request k)"
        )
    if config.position == "relative":
        problems.append(
            "Transformer-XL relative attention (position: relative): vLLM's attention kernels have no relative term"
        )
    elif config.position != "rotary":
        problems.append(f"position {config.position} (the plugin implements rotary positions)")
    if config.attention_features:  # before head_dim: latent attention's is its rope part only
        problems.append(
            f"{', '.join(config.attention_features)} (the plugin's attention is vLLM's over per-head keys and "
            "values, called without them)"
        )
    if config.latent_attention is None and config.head_dim not in CPU_HEAD_SIZES and _on_cpu():
        sizes = ", ".join(map(str, CPU_HEAD_SIZES))
        problems.append(f"head_dim {config.head_dim} (vLLM's CPU attention takes {sizes})")
    if config.moe is not None:
        kind = router_class(config.moe.router.kind)
        if kind.per_sequence:
            problems.append(
                f"router {config.moe.router.kind}: one routing decision per whole sequence, which needs every "
                "token of the sequence at once"
            )
        if router_state_sizes(config) or kind.reads_attention:
            problems.append(
                f"router {config.moe.router.kind}: per-sequence routing state kept beside the KV cache, which "
                "vLLM's cache does not hold"
            )
    return problems


class MoeServeConfigParser(HFConfigParser):
    """vLLM's "hf" parser, except for moe-serve artifacts: their config.json is a moe-serve manifest."""

    def parse(
        self,
        model: str | Path,
        trust_remote_code: bool,
        revision: str | None = None,
        code_revision: str | None = None,
        **kwargs: Any,
    ):  # noqa: E501
        if not is_artifact(model):
            return super().parse(model, trust_remote_code, revision, code_revision, **kwargs)
        path = Path(model)
        manifest, config = read_manifest(path)
        spec = weights_spec(manifest, config, path)
        if spec is not None:
            raise ValueError(
                f"moe-serve artifact {model} cannot run in vLLM: " + packed_refusal(spec, "the vLLM plugin")
            )
        weights = path / WEIGHTS_FILE
        stat = weights.stat()
        _check_artifact(str(path), stat.st_size, stat.st_mtime_ns)
        problems = unsupported(config)
        if problems:
            raise ValueError(f"moe-serve artifact {model} cannot run in vLLM: " + "; ".join(problems))
        hf_config = MoeServeConfig(moe_serve_model=manifest["model"])
        return hf_config.to_dict(), hf_config


@functools.lru_cache(maxsize=8)
def _check_artifact(path: str, size: int, mtime_ns: int) -> None:
    """What moe_serve.artifact.load_artifact checks before anything is allocated (vLLM reads the safetensors
    file itself): checksums, every tensor's name and shape. vLLM parses the config several times per
    process; the weights are hashed once per file version (size and modification time)."""
    manifest, config = read_manifest(path)
    check_checksums(Path(path), manifest.get("checksums") or {})
    with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as f:
        check_tensors(config, {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})


class ModelConfigHook(VerifyAndUpdateConfig):
    """vLLM's per-architecture config hook (MODELS_CONFIG_MAP): runs once, where the engine's config is
    built, before any worker starts."""

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        from vllm.platforms import current_platform

        from moe_serve.vllm_plugin import requests

        parallel = vllm_config.parallel_config
        refusals = []
        if parallel.pipeline_parallel_size > 1:
            refusals.append("pipeline parallelism (use --tensor-parallel-size or --data-parallel-size)")
        if parallel.enable_expert_parallel and parallel.data_parallel_size > 1:
            refusals.append(
                "--enable-expert-parallel with --data-parallel-size above 1 (the plugin splits experts across "
                "the tensor-parallel ranks only)"
            )
        shards = Shards(0, parallel.tensor_parallel_size, parallel.enable_expert_parallel)
        refusals += parallel_problems(vllm_config.model_config.hf_config.model_config, shards)
        if not (current_platform.is_cpu() or current_platform.is_cuda()):
            refusals.append(
                f"platform {current_platform.device_type or 'unknown'}: per-request k is wired into vLLM's CPU "
                "build (V1 runner) and its CUDA build (V2 runner, or V1 with VLLM_USE_V2_MODEL_RUNNER=0)"
            )
        if parallel.use_ubatching:
            refusals.append(
                "micro-batching (--enable-dbo, --ubatch-size): vLLM splits a step's inputs per micro-batch, and "
                "each token's k would not follow them"
            )
        if vllm_config.speculative_config is not None:
            refusals.append(
                "speculative decoding (--speculative-config): draft tokens would be verified at a k the draft "
                "model never saw, and the plugin's per-token k does not cover draft positions"
            )
        if vllm_config.model_config.runner_type != "generate":
            refusals.append(
                f"--runner {vllm_config.model_config.runner_type} (the plugin serves generation; per-request k "
                "does not reach vLLM's pooling runner)"
            )
        worker = CPU_WORKER if current_platform.is_cpu() else GPU_WORKER
        if parallel.worker_cls not in ("auto", worker):
            refusals.append(f"--worker-cls {parallel.worker_cls} (the plugin installs its own, {worker})")
        if refusals:
            raise ValueError("moe-serve's vLLM plugin does not support " + "; ".join(refusals))
        parallel.worker_cls = worker
        if current_platform.is_cuda():
            _eager_on_gpu(vllm_config)
        model_config = vllm_config.model_config
        validator = requests.VALIDATOR_V2 if vllm_config.use_v2_model_runner else requests.VALIDATOR
        model_config.logits_processors = [*(model_config.logits_processors or []), validator]
        requests.serve(model_config.hf_config.model_config)


CPU_WORKER = "moe_serve.vllm_plugin.worker.MoeServeCPUWorker"
GPU_WORKER = "moe_serve.vllm_plugin.worker.MoeServeGPUWorker"


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _eager_on_gpu(vllm_config: Any) -> None:
    """CUDA graphs off on GPU until a GPU run has shown replay equal to eager: the forward is graph-safe by
    construction (static shapes, k on the device, the Triton MoE without host syncs; moe_serve.kernels.cuda),
    but no GPU with vLLM's GPU build has run it (docs/vllm.md)."""
    from vllm.config.compilation import CUDAGraphMode

    compilation = vllm_config.compilation_config
    if compilation.cudagraph_mode not in (None, CUDAGraphMode.NONE):
        logger.warning(
            "moe-serve's vLLM plugin sets cudagraph_mode to NONE (was %s): its graph replay has not yet been "
            "checked against eager on a GPU",
            compilation.cudagraph_mode,
        )
    compilation.cudagraph_mode = CUDAGraphMode.NONE


def register() -> None:
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    AutoConfig.register(MODEL_TYPE, MoeServeConfig, exist_ok=True)
    register_config_parser("hf")(MoeServeConfigParser)
    MODELS_CONFIG_MAP[ARCHITECTURE] = ModelConfigHook
