"""The C++ decode stack (moe_serve.engine.decode_stack) computes what the Python layers compute, bitwise, in
mixed-k batches and in every weight format, and counts expert load the same; models it cannot run keep the
Python layers, with the reason."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from moe_serve import LLM, EngineConfig, SamplingParams
from moe_serve.engine.decode_stack import unsupported_reason
from moe_serve.engine.kv_cache import KVCache, cache_shape
from moe_serve.layers.routers import router_config
from moe_serve.model_config import FFNConfig, LayerAttention
from moe_serve.testing import create_random_artifact
from tests.conftest import lm_config, moe_config

pytestmark = pytest.mark.cpu_kernels

PROMPTS = ["To be, or not to be", "Exit, pursued", "O", "Now is the winter of our discontent made glorious"]


def mixtral_like(**overrides):
    """Every layer MoE, pre-norm RMSNorm, rotary: what the stack runs."""
    base = lm_config(
        hidden_size=64, num_layers=3, norm="rmsnorm", moe=moe_config(layers=(0, 1, 2), expert=FFNConfig("glu", 64))
    )
    return dataclasses.replace(base, **overrides)


CONFIGS = {
    "mixtral": mixtral_like(),
    # Every bias, plain MLP experts with ReLU, uniform weights, learned positions and a scaled embedding.
    "biases-mlp-uniform-learned": mixtral_like(
        attention_bias=True,
        attention_out_bias=True,
        position="learned",
        embedding_scale=2.0,
        moe=moe_config(
            layers=(0, 1, 2),
            expert=FFNConfig("mlp", 64, "relu", use_bias=True),
            router=router_config("topk_uniform", use_bias=True),
        ),
    ),
    # Granite's attention scale, embedding scale and logit divisor (its residual scale the stack refuses, below).
    "granite-scales": mixtral_like(attention_scale=0.2, embedding_scale=3.0, logits_divisor=2.5),
    # The LM head tied to the embeddings, with a bias, and no final norm.
    "tied-head-bias-no-final-norm": mixtral_like(tie_word_embeddings=True, lm_head_bias=True, final_norm=False),
    # Full-softmax weights (normalize: false) and GELU-tanh GLU experts.
    "softmax-all-gelu": mixtral_like(
        moe=moe_config(
            layers=(0, 1, 2),
            expert=FFNConfig("glu", 64, "gelu_tanh"),
            router=router_config("topk_softmax", normalize=False),
        )
    ),
}


def _run(
    path: Path, stack: bool, weights: str | None, policy: bool = False, activations: str = "fp32"
) -> tuple[list, dict, list]:
    llm = LLM(path, EngineConfig(cpu_decode_stack=stack, weights=weights, cpu_activations=activations))
    assert llm.artifact.weights_label == (weights if activations == "fp32" else f"{weights}:{activations}")
    runner = llm.engine.runner
    assert (runner.decode_stack is not None) == stack
    used: list[int] = []
    if stack:  # count the steps the stack ran through to the logits, so the test proves it ran
        original = runner.decode_stack.logits.__func__

        class Counting(type(runner.decode_stack)):  # type: ignore[misc]
            def logits(self, h, batch):
                used.append(h.shape[0])
                return original(self, h, batch)

        runner.decode_stack.__class__ = Counting
    runner.track_expert_load()
    params = [SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, experts_per_token=k) for k in (1, 2, 4, 3)]
    params[3] = SamplingParams(max_tokens=10, temperature=0.8, seed=7, logprobs=3, experts_per_token=3)  # sampled
    if policy:  # a top-p request in the batch: its steps run the Python layers
        params[0] = SamplingParams(max_tokens=3, temperature=0.0, logprobs=3, moe={"policy": "top_p", "p": 0.7})
    outputs = llm.generate(PROMPTS, params)  # one batch, mixed k
    tokens = [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].top_logprobs) for o in outputs]
    return tokens, runner.read_expert_load(), used


# Every format on one config (int8 and int4 with int8 activations too, bf16 with bf16 ones where the CPU has
# them), every config in fp32 and int4.
CASES = (
    [("mixtral", w, "fp32") for w in (None, "bf16", "int8", "int4")]
    + [("mixtral", w, "int8") for w in ("int8", "int4")]
    + [pytest.param("mixtral", "bf16", "bf16", marks=pytest.mark.bf16_dot)]
    + [(name, w, "fp32") for name in CONFIGS if name != "mixtral" for w in (None, "int4")]
)


@pytest.mark.parametrize("name, weights, activations", CASES)
def test_the_stack_equals_the_python_layers_bitwise_in_mixed_k_batches(
    tmp_path: Path, name: str, weights: str | None, activations: str
) -> None:
    path = create_random_artifact(tmp_path / name, CONFIGS[name], seed=5)
    python, python_load, _ = _run(path, False, weights, activations=activations)
    stack, stack_load, used = _run(path, True, weights, activations=activations)
    assert used and max(used) == len(PROMPTS)
    assert stack == python
    assert stack_load == python_load and sum(python_load[0]) > 0


def test_a_top_p_step_runs_the_python_layers(tmp_path: Path) -> None:
    path = create_random_artifact(tmp_path / "model", mixtral_like(), seed=5)
    python, _, _ = _run(path, False, None, policy=True)
    stack, _, used = _run(path, True, None, policy=True)
    assert stack == python
    assert used and max(used) == len(PROMPTS) - 1  # only the steps after the top-p request finished


def _cache(config) -> KVCache:
    return KVCache(config, cache_shape(config, torch.float32, 1 << 20, 16), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(norm_position="post"), "pre-norm RMSNorm"),
        (dict(position="relative"), "pre-norm RMSNorm"),
        (dict(moe=moe_config(layers=(1,), expert=FFNConfig("glu", 64))), "every layer must be an MoE layer"),
        (
            dict(moe=moe_config(layers=(0, 1, 2), expert=FFNConfig("glu", 64), shared_expert=FFNConfig("glu", 64))),
            "no shared expert",
        ),
        (dict(norm="layernorm"), "pre-norm RMSNorm"),  # Phi-3.5-MoE
        (dict(residual_scale=0.5), "residual unscaled (residual_scale is 0.5)"),  # Granite
        (
            dict(moe=moe_config(layers=(0, 1, 2), expert=FFNConfig("glu", 64), router=router_config("sparsemixer"))),
            "router kind sparsemixer is not a top-k of its logits under one of the kernels' weightings",
        ),
        (
            dict(attention_sinks=True, layer_attention=(LayerAttention(window=4), LayerAttention(), LayerAttention())),
            "plain attention only (this model has sliding-window attention, attention sinks)",
        ),  # gpt-oss
        (
            dict(moe=moe_config(layers=(0, 1, 2), expert=FFNConfig("glu", 64), weights_scale_input=True)),
            "weights_scale_input weights its input",
        ),  # Llama 4's convention, with a router the stack would otherwise take
        (
            dict(
                moe=moe_config(
                    layers=(0, 1, 2), expert=FFNConfig("glu", 64, "swigluoai", swiglu_alpha=1.7, swiglu_limit=7.0)
                )
            ),
            "plain activations (not swigluoai)",
        ),  # gpt-oss's experts without its attention
    ],
    ids=[
        "post-norm",
        "relative",
        "dense-layer",
        "shared-expert",
        "layernorm",
        "residual-scale",
        "sparsemixer",
        "gpt-oss",
        "weights-scale-input",
        "swigluoai",
    ],
)
def test_models_the_stack_cannot_run_keep_the_python_layers(overrides: dict, reason: str) -> None:
    from moe_serve.models import MoETransformer

    config = mixtral_like(**overrides)
    model = MoETransformer(config).eval()
    model.prepare()
    assert reason in (unsupported_reason(model, _cache(config)) or "")
    plain = MoETransformer(mixtral_like()).eval()
    plain.prepare()
    assert unsupported_reason(plain, _cache(mixtral_like())) is None
