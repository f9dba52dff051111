"""DeepSeek-V2 and DeepSeek-V3 (`deepseek_v2`, `deepseek_v3`) through `export hf`, proven against transformers on
tiny random models built with its own classes: at the trained k, at k = 1 and at the largest k the group limit
reaches, greedy tokens equal `generate`'s and the top log-probabilities agree within LOGPROB_ATOL, through one
whole prefill, a prefill in chunks and decode, and again on a prefix-cache hit; every position's logits agree in
one forward. The models cover multi-head latent attention with and without q_lora_rank, V3's interleaved and
plain rope layouts with YaRN (mscale, mscale_all_dim), attention biases, dense first layers, shared experts,
V3's sigmoid routing with a correction bias over groups, and V2's greedy and group-limited softmax routing.

Then the router kind against transformers' own router modules at every k, the KV memory of latent attention
against its budget, and what refuses what, by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    PreTrainedTokenizerFast,
)
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from moe_serve import LLM, EngineConfig, SamplingParams
from moe_serve.engine import decode_graphs, decode_stack
from moe_serve.errors import ConfigError, ValidationError
from moe_serve.exporters.base import ExportError
from moe_serve.exporters.hf import export_hf
from moe_serve.exporters.onnx.export import check_exportable
from moe_serve.layers.routers import router_class, router_config
from moe_serve.model_config import ExpertsPerToken, MoEConfig
from moe_serve.moe_policy import MoEPolicy
from moe_serve.summary import format_summary, summarize
from moe_serve.tokenizer import END_OF_TEXT, byte_level_tokenizer
from tests.conftest import edit_config
from tests.exporters.parity import (
    NO_PROGRESS,
    TOP,
    Engines,
    assert_generates,
    check_parity,
    export_all,
    transformers_reference,
)

NUM_EXPERTS = 8

# fmt: off
COMMON = dict(vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, bos_token_id=None,
              eos_token_id=None, pad_token_id=None, intermediate_size=96, moe_intermediate_size=32,
              n_routed_experts=NUM_EXPERTS, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
              num_hidden_layers=3, first_k_dense_replace=1,
              rms_norm_eps=1e-5)  # apart from the q_a / kv_a norms' own 1e-6
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 0.8, "mscale_all_dim": 1.0}
MODELS = {
    # V3 as released: q_lora_rank, interleaved rope, 2 of 4 groups kept by their top-2 sums, a correction bias,
    # normalised weights scaled by 2.5, one shared expert; YaRN whose mscales change both cos/sin and the scale.
    "v3": (DeepseekV3ForCausalLM, lambda: DeepseekV3Config(
        **COMMON, q_lora_rank=24, n_group=4, topk_group=2, num_experts_per_tok=3, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=128, rope_parameters=YARN)),
    # V3 with the plain rotate-half layout, one group, unnormalised weights and no shared expert.
    "v3_plain": (DeepseekV3ForCausalLM, lambda: DeepseekV3Config(
        **COMMON, q_lora_rank=24, n_group=1, topk_group=1, num_experts_per_tok=2, n_shared_experts=0,
        routed_scaling_factor=1.5, norm_topk_prob=False, rope_interleave=False, max_position_embeddings=256)),
    # V2-Lite: no q_lora_rank (q_proj), greedy softmax routing, two shared experts.
    "v2_lite": (DeepseekV2ForCausalLM, lambda: DeepseekV2Config(
        **COMMON, q_lora_rank=None, topk_method="greedy", num_experts_per_tok=2, n_shared_experts=2,
        routed_scaling_factor=1.0)),
    # V2: q_lora_rank, 2 of 4 groups kept by their best score, scaled weights, biases on q_a, kv_a and o.
    "v2": (DeepseekV2ForCausalLM, lambda: DeepseekV2Config(
        **COMMON, q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2, num_experts_per_tok=3,
        n_shared_experts=1, routed_scaling_factor=4.0, attention_bias=True)),
}
# fmt: on
REACHABLE = {"v3": 4, "v3_plain": NUM_EXPERTS, "v2_lite": NUM_EXPERTS, "v2": 4}  # topk_group * experts per group


def build_model(name: str, seed: int):
    """Random weights larger than transformers' init, and a random correction bias, so that routing (groups
    included) and logits are far from uniform."""
    model_class, make_config = MODELS[name]
    torch.manual_seed(seed)
    model = model_class(make_config()).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            values = torch.randn(p.shape, generator=generator) * 0.15
            p.copy_(values + 1.0 if "norm" in param_name and param_name.endswith("weight") else values)
        for buffer_name, b in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=generator) * 0.1)
    return model


def save_model(name: str, directory: Path, seed: int = 0) -> Path:
    build_model(name, seed).save_pretrained(directory)
    PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(), eos_token=END_OF_TEXT).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (HF directory, artifact directory)."""
    return export_all(tmp_path_factory.mktemp("hf-deepseek"), MODELS, save_model, first_seed=21)


@pytest.fixture(scope="module")
def engines(exported) -> Engines:
    return Engines(exported)


def _k(src: Path, name: str, which: str) -> int:
    if which == "trained":
        return json.loads((src / "config.json").read_text())["num_experts_per_tok"]
    return 1 if which == "1" else REACHABLE[name]


def _transformers_reference(src: Path, name: str, k: int, prompt: torch.Tensor):
    return transformers_reference(MODELS[name][0].from_pretrained(src, num_experts_per_tok=k).eval(), prompt)


@pytest.mark.parametrize("which", ["trained", "1", "max"])
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_and_logprobs_equal_transformers_through_prefill_chunks_and_decode(
    exported, engines, monkeypatch, name: str, which: str
) -> None:
    src, _ = exported[name]
    k = _k(src, name, which)
    model = MODELS[name][0].from_pretrained(src, num_experts_per_tok=k).eval()
    check_parity(engines[name], model, k, len(name) + k, monkeypatch)


def test_a_prefix_cache_hit_reads_the_latents_it_cached(exported) -> None:
    """The second request for a prompt takes its first blocks from the prefix cache (latents written by the first)
    and still gives transformers' tokens and log-probabilities."""
    src, artifact = exported["v3"]
    k = 3
    prompt = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(5))
    sequence, expected, _ = _transformers_reference(src, "v3", k, prompt)
    llm = LLM(artifact, EngineConfig(block_size=16))
    for _ in range(2):
        assert_generates(llm, prompt[0].tolist(), k, sequence[0, 40:].tolist(), expected)
    assert llm.engine.blocks.stats.hit_tokens == 32  # the second prompt's two whole blocks


def test_requests_at_different_k_batched_together_each_give_their_own_result(exported, engines) -> None:
    """Batch invariance: steps hold k = 1, 3 and 4 (prompts of different lengths, their blocks interleaved); each
    request equals itself alone, bitwise: on the CPU the latent attention and the absorbed per-head maps are C++
    kernels whose rows do not depend on each other (with batched matmuls for the maps, the log-probabilities
    moved by 5e-7 with the batch)."""
    whole, _ = engines["v3"]
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 300, (n,), generator=generator).tolist() for n in (11, 23, 7)]
    params = [
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, experts_per_token=k, logprobs=TOP)
        for k in (1, 3, 4)
    ]
    together = [out.outputs[0] for out in whole.generate(prompts, params)]
    for prompt, param, got in zip(prompts, params, together, strict=True):
        alone = whole.generate([prompt], param)[0].outputs[0]
        assert got.token_ids == alone.token_ids
        assert got.logprobs == alone.logprobs


def test_packed_weights_serve_latent_attention(exported) -> None:
    """int8 packing (`--weights int8`) covers the q, kv_a and o projections whose rows split into groups of 32
    (here q_a and kv_a, whose input is the hidden size 64; q_b's 24 and o's 48 do not), never kv_b_proj (read per
    head). The packed model computes what the float model does on the dequantized weights (measured: equal)."""
    artifact = exported["v2"][1]
    packed, floats = LLM(artifact, EngineConfig(weights="int8")), LLM(artifact)
    names = packed.artifact.weights.packed  # type: ignore[union-attr]
    assert {f"layers.{i}.attn.{p}.weight" for i in range(3) for p in ("q_a_proj", "kv_a_proj")} <= set(names)
    assert not any("kv_b_proj" in name for name in names)
    model = floats.artifact.model
    with torch.no_grad():
        for name in names:
            module, _, attr = name.rpartition(".")
            getattr(model.get_submodule(module), attr).copy_(
                getattr(packed.artifact.model.get_submodule(module), attr).dequantize(torch.float32)
            )
    model.prepare()
    sequence = [torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(2)).tolist()]
    with torch.inference_mode():
        logits = [
            llm.artifact.model.lm_logits(llm.engine.runner.forward_padded(sequence, [3])[0]) for llm in (packed, floats)
        ]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)
    assert (
        packed.generate(sequence, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    )


def _router_cases():
    """(transformers' router module, our router config) with the same settings; weights and bias random."""
    generator = torch.Generator().manual_seed(3)
    v3 = DeepseekV3TopkRouter(MODELS["v3"][1]())
    v2 = DeepseekV2TopkRouter(MODELS["v2"][1]())
    greedy = DeepseekV2TopkRouter(MODELS["v2_lite"][1]())
    with torch.no_grad():
        for module in (v3, v2, greedy):
            module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.3)
        v3.e_score_correction_bias.copy_(torch.randn(NUM_EXPERTS, generator=generator) * 0.1)
    # fmt: off
    return {
        "v3": (v3, router_config("grouped_topk", score="sigmoid", groups=4, groups_kept=2, group_score="top2_sum",
                                 correction_bias=True, normalize=True, scale=2.5), 4),
        "v2": (v2, router_config("grouped_topk", score="softmax", groups=4, groups_kept=2, group_score="max",
                                 scale=4.0), 4),
        "v2_lite": (greedy, router_config("grouped_topk", score="softmax"), NUM_EXPERTS),
    }
    # fmt: on


@pytest.mark.parametrize("case", ["v3", "v2", "v2_lite"])
def test_the_router_kind_is_transformers_router_at_every_k(case: str) -> None:
    module, config, reachable = _router_cases()[case]
    x = torch.randn(3000, 64, generator=torch.Generator().manual_seed(4))
    logits = F.linear(x, module.weight)
    router = router_class("grouped_topk")(config, NUM_EXPERTS)
    router.bind({"correction_bias": module.e_score_correction_bias} if config.correction_bias else {})
    for k in range(1, reachable + 1):
        module.top_k = k
        with torch.no_grad():
            _, want_weights, want_ids = module(x)  # its order within a row is topk's (sorted=False)
        ids, weights = router.route(logits, torch.full((len(x),), k), k)
        order = want_ids.argsort(dim=-1)
        assert torch.equal(ids.sort(dim=-1).values, want_ids.gather(1, order)), k
        ours = weights.gather(1, ids.argsort(dim=-1))
        torch.testing.assert_close(ours, want_weights.gather(1, order), atol=1e-6, rtol=1e-6)
    # The slow reference, one token at a time, and a batch of mixed k (each row routed as if alone).
    token_k = torch.randint(1, reachable + 1, (len(x),), generator=torch.Generator().manual_seed(6))
    ids, weights = router.route(logits, token_k, reachable)
    bias = module.e_score_correction_bias.tolist() if config.correction_bias else None
    for row in range(0, len(x), 100):
        k = int(token_k[row])
        chosen, want = router.reference_route(logits[row].double().tolist(), k, bias)
        assert ids[row, :k].tolist() == chosen and (ids[row, k:] == -1).all()
        torch.testing.assert_close(
            weights[row, :k].double(), torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=0
        )
    assert not router.is_approximate(1, NUM_EXPERTS, 3)


def test_the_group_limit_changes_routing_in_these_models() -> None:
    """Keeping 2 of 4 groups, and the correction bias, each change some token's experts: the tests above see both."""
    module, config, _ = _router_cases()["v3"]
    x = torch.randn(3000, 64, generator=torch.Generator().manual_seed(4))
    logits = F.linear(x, module.weight)
    k = torch.full((len(x),), 4)
    router = router_class("grouped_topk")(config, NUM_EXPERTS)
    router.bind({"correction_bias": module.e_score_correction_bias})
    ungrouped = router_class("grouped_topk")(router_config("grouped_topk", correction_bias=True), NUM_EXPERTS)
    ungrouped.bind({"correction_bias": module.e_score_correction_bias})
    unbiased = router_class("grouped_topk")(router_config("grouped_topk", groups=4, groups_kept=2), NUM_EXPERTS)
    ids = router.route(logits, k, 4)[0].sort(dim=-1).values
    for other in (ungrouped, unbiased):
        assert (other.route(logits, k, 4)[0].sort(dim=-1).values != ids).any(dim=-1).float().mean() > 0.1


# ---- what the artifact holds, and what is refused -------------------------------------------------------------


def test_deepseek_conventions_in_the_artifact(exported) -> None:
    config = LLM(exported["v3"][1]).config
    mla = config.latent_attention
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        24, 16, 16, 8, 12,
    )  # fmt: skip
    assert mla.norm_eps == 1e-6 and config.norm_eps == 1e-5 and config.head_dim == 8
    mscale = 0.1 * 1.0 * torch.log(torch.tensor(4.0)).item() + 1.0  # yarn_get_mscale(factor, mscale_all_dim)
    assert config.attention_scale == pytest.approx(24**-0.5 * mscale**2)
    router = config.moe.router
    assert router.kind == "grouped_topk" and (router.groups, router.groups_kept) == (4, 2)
    assert router.correction_bias and router.normalize and router.scale == 2.5 and router.score == "sigmoid"
    assert config.moe.layers == (1, 2) and config.moe.shared_expert.intermediate_size == 32
    assert (config.moe.default_k, config.moe.max_k) == (3, 4)
    lite = LLM(exported["v2_lite"][1]).config
    assert lite.latent_attention.q_lora_rank is None and lite.moe.shared_expert.intermediate_size == 64
    assert lite.moe.router.score == "softmax" and lite.moe.router.groups == 1 and lite.moe.max_k == NUM_EXPERTS
    assert lite.attention_scale == pytest.approx(24**-0.5)
    assert LLM(exported["v3_plain"][1]).config.moe.shared_expert is None
    text = format_summary(summarize(exported["v3"][1]))  # moe-serve inspect
    assert "the KV cache holds 24 values per token per layer (per-head keys and values: 144)" in text
    assert "router grouped_topk (sigmoid, 2 of 4 groups by top2_sum, correction bias, normalized, scale=2.5)" in text


def test_a_k_the_group_limit_cannot_reach_is_refused_by_name(exported) -> None:
    llm = LLM(exported["v3"][1])
    reason = (
        "grouped_topk keeps 2 of its 4 expert groups .2 experts each. as trained, so a token reaches at most 4 experts"
    )
    with pytest.raises(
        ValidationError, match=f"experts_per_token must be between 1 and 4, got 5: router kind {reason}"
    ):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, experts_per_token=5))
    with pytest.raises(ValidationError, match="moe.policy top_p is not defined for router kind grouped_topk"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, moe=MoEPolicy(p=0.5)))
    moe = llm.config.moe
    with pytest.raises(ConfigError, match=f"experts_per_token.max .5. is beyond the group limit: router kind {reason}"):
        MoEConfig(moe.num_experts, moe.layers, moe.expert, moe.router, ExpertsPerToken(default=3, max=5))


def test_the_kv_memory_of_latent_attention_against_its_budget(exported) -> None:
    """The cache keeps kv_lora_rank + qk_rope_head_dim values per token per layer, 24 here (96 bytes in fp32),
    where each head's keys and values would take 4 * (16 + 8 + 12) = 144 (576 bytes): the same budget holds
    6 times the tokens, and the engine allocates exactly the blocks the latent size gives."""
    budget = 3 << 20
    llm = LLM(exported["v3"][1], EngineConfig(kv_cache_memory=budget, block_size=16))
    config, shape, cache = llm.config, llm.engine.cache_shape, llm.engine.runner.cache
    per_token_layer = config.latent_attention.cache_width * 4
    assert per_token_layer == 96 and config.latent_attention.full_kv_width(config.num_heads) * 4 == 576
    assert shape.bytes_per_block == config.num_layers * 16 * per_token_layer  # 3 layers x 16 tokens x 96 bytes
    assert shape.num_blocks == budget // shape.bytes_per_block == 682
    assert cache.layers == [] and len(cache.latent) == config.num_layers
    allocated = sum(c.latent.numel() * c.latent.element_size() for c in cache.latent)
    assert allocated == (shape.num_blocks + 1) * shape.bytes_per_block  # the pool and its one scratch block
    assert llm.engine.inputs.kv_capacity == 682 * 16


def test_every_path_that_cannot_serve_latent_attention_refuses_it_by_name(exported) -> None:
    llm = LLM(exported["v2_lite"][1])
    config = llm.config
    assert "multi-head latent attention" in config.attention_features  # the vLLM plugin refuses these at load
    with pytest.raises(ExportError, match="the ONNX export does not support multi-head latent attention"):
        check_exportable(config)
    assert "multi-head latent attention" in decode_graphs.unsupported_reason(config)
    reason = decode_stack.unsupported_reason(llm.artifact.model, llm.engine.runner.cache)
    assert reason is not None and "multi-head latent attention" in reason
    assert llm.engine.runner.decode_stack is None


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        ("v2_lite", dict(norm_topk_prob=True), "norm_topk_prob true is not supported for deepseek_v2"),
        ("v2_lite", dict(topk_method="noaux_tc"), "topk_method 'noaux_tc' is not supported for deepseek_v2"),
        ("v3", dict(moe_layer_freq=2), "moe_layer_freq 2 is not supported"),
        ("v2_lite", dict(mlp_bias=True), "mlp_bias true .biases on the dense and shared MLPs. is not supported"),
        ("v3", dict(n_group=3), "num_experts .8. must split into 3 equal groups"),
        (
            "v3",
            dict(quantization_config={"quant_method": "fp8"}),
            "quantized DeepSeek checkpoints .quantization_config 'fp8'",
        ),
        (
            "v3",
            dict(num_experts_per_tok=5),
            "num_experts_per_tok 5 is beyond what its groups reach: topk_group 2 of n_group 4, 2 experts each",
        ),
    ],
)
def test_what_cannot_be_served_exactly_is_refused_at_export_by_name(tmp_path, exported, name, changes, message) -> None:
    src = shutil.copytree(exported[name][0], tmp_path / "src")
    edit_config(src, **changes)
    with pytest.raises(ExportError, match=message):
        export_hf(src, tmp_path / "dst", NO_PROGRESS)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_keys_a_released_config_omits_mean_what_transformers_defaults_them_to(version: str) -> None:
    """save_pretrained writes every key; a released config.json may leave some to the config class. Trimmed
    to its sizes, a config converts to what transformers' own class makes of it."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    from moe_serve.exporters.hf import convert_config

    trimmed = {
        "architectures": [f"Deepseek{version.upper()}ForCausalLM"], "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 4, "num_experts_per_tok": 2,
    }  # fmt: skip
    theirs = (DeepseekV3Config if version == "v3" else DeepseekV2Config)(**trimmed)
    config = convert_config(trimmed)
    moe, mla = config.moe, config.latent_attention
    assert moe.num_experts == theirs.n_routed_experts and moe.layers[0] == theirs.first_k_dense_replace
    assert moe.shared_expert.intermediate_size == theirs.n_shared_experts * theirs.moe_intermediate_size
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_rope_head_dim) == (
        theirs.q_lora_rank, theirs.kv_lora_rank, theirs.qk_rope_head_dim
    )  # fmt: skip
    assert moe.router.scale == theirs.routed_scaling_factor and config.eos_token_id == theirs.eos_token_id
    if version == "v3":
        assert (moe.router.groups, moe.router.groups_kept) == (theirs.n_group, theirs.topk_group)
        assert moe.router.normalize is theirs.norm_topk_prob
