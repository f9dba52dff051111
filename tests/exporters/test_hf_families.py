"""Phi-3.5-MoE (`phimoe`) and Granite-MoE (`granitemoe`, `granitemoeshared`) through `export hf`, proven against
transformers itself on tiny random models (tests/exporters/hf_models.py, FAMILIES): at the trained k, at k = 1
and at the largest k, greedy tokens equal `generate`'s and the top log-probabilities agree within
LOGPROB_ATOL, through one whole prefill, a prefill in chunks and decode; every position's logits agree in one
forward. Then what each family's conventions became in the artifact, and what is refused by name.

transformers' Phi router takes two sparsemixer steps whatever num_experts_per_tok says, so the reference at
another k is transformers' own model with its `sparsemixer` taking top_k steps (`sparsemixer_steps`, proven
equal to the original, bit for bit, at two): moe-serve's meaning of k for that router
(moe_serve/layers/routers/sparsemixer.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from transformers.models.phimoe import modeling_phimoe

from moe_serve import LLM, EngineConfig, SamplingParams
from moe_serve.engine.block_manager import RELEASED
from moe_serve.engine.kv_cache import kv_layout
from moe_serve.errors import ValidationError
from moe_serve.exporters import mxfp4
from moe_serve.exporters.base import ExportError
from moe_serve.exporters.hf import export_hf
from moe_serve.layers.routers import router_class, router_config
from moe_serve.moe_policy import MoEPolicy
from tests.conftest import edit_config
from tests.exporters.hf_models import FAMILIES, LONGROPE_ORIGINAL, NUM_EXPERTS, save_hf_model
from tests.exporters.parity import LOGITS_ATOL, NEW, NO_PROGRESS, PROMPT, Engines, check_parity, export_all


def sparsemixer_steps(scores: torch.Tensor, jitter_eps: float, training: bool, top_k: int = 2):
    """transformers' eval-mode `sparsemixer` (modeling_phimoe) with its two steps written as a loop of top_k:
    each step masks the experts already chosen and those too far below its maximum, takes the argmax, and
    weights it by the masked softmax."""
    assert not training
    masked_scores, multipliers, selected = scores, [], []
    for _ in range(top_k):
        with torch.no_grad():
            threshold, max_ind = masked_scores.max(dim=-1, keepdim=True)
            factor = scores.abs().clamp(min=threshold)
            mask = ((threshold - scores) / factor) > (2 * jitter_eps)
        gates = torch.softmax(masked_scores.masked_fill(mask, float("-inf")), dim=-1)
        multipliers.append(gates.gather(dim=-1, index=max_ind))
        selected.append(max_ind)
        masked_scores = torch.scatter(masked_scores, -1, max_ind, float("-inf"))
    return torch.cat(multipliers, dim=-1), torch.cat(selected, dim=-1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (HF directory, artifact directory)."""
    return export_all(tmp_path_factory.mktemp("hf-families"), FAMILIES, save_hf_model, first_seed=11)


@pytest.fixture(scope="module")
def engines(exported) -> Engines:
    return Engines(exported)


def transformers_model(src: Path, name: str, k: int, monkeypatch: pytest.MonkeyPatch):
    if name == "phimoe":  # its router passes top_k = num_experts_per_tok to sparsemixer, which ignores it
        monkeypatch.setattr(modeling_phimoe, "sparsemixer", sparsemixer_steps)
    return FAMILIES[name][0].from_pretrained(src, num_experts_per_tok=k).eval()


def _k(src: Path, which: str) -> int:
    """The trained k (the source's num_experts_per_tok); 1, or 2 where 1 is the trained k (Llama 4), so
    that three k are tested; or the largest served (every expert, or every expert of the groups a
    group-limited router keeps: GLM-4.5)."""
    config = json.loads((src / "config.json").read_text())
    trained = config["num_experts_per_tok"]
    if which == "trained":
        return trained
    if which == "small":
        return 2 if trained == 1 else 1
    return config["topk_group"] * NUM_EXPERTS // config["n_group"] if "topk_group" in config else NUM_EXPERTS


def test_sparsemixer_steps_is_transformers_sparsemixer_at_two_steps() -> None:
    scores = torch.randn(4000, NUM_EXPERTS, generator=torch.Generator().manual_seed(0)) * 0.5
    for eps in (0.01, 0.3):
        theirs, ours = modeling_phimoe.sparsemixer(scores, eps, False), sparsemixer_steps(scores, eps, False)
        assert all(torch.equal(a, b) for a, b in zip(theirs, ours, strict=True))


def test_the_router_kind_is_transformers_sparsemixer_at_two_and_its_steps_at_every_k() -> None:
    scores = torch.randn(4000, NUM_EXPERTS, generator=torch.Generator().manual_seed(1)) * 0.5
    router = router_class("sparsemixer")(router_config("sparsemixer", jitter_eps=0.3), NUM_EXPERTS)
    for k in range(1, NUM_EXPERTS + 1):
        ids, weights = router.route(scores, torch.full((len(scores),), k), k)
        want_weights, want_ids = (
            modeling_phimoe.sparsemixer(scores, 0.3, False) if k == 2 else sparsemixer_steps(scores, 0.3, False, k)
        )
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights), k
    assert router.is_approximate(1, NUM_EXPERTS, 2) and not router.is_approximate(2, NUM_EXPERTS, 2)


@pytest.mark.parametrize("which", ["trained", "small", "max"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_tokens_and_logprobs_equal_transformers_through_prefill_chunks_and_decode(
    exported, engines, monkeypatch, name: str, which: str
) -> None:
    src, _ = exported[name]
    k = _k(src, which)
    check_parity(engines[name], transformers_model(src, name, k, monkeypatch), k, len(name) + k, monkeypatch)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_requests_at_three_k_batched_together_each_give_their_own_result_bitwise(exported, engines, name) -> None:
    """The product's promise for every family: a step holding k = 1, the trained k and the largest (prompts of
    different lengths, their blocks interleaved) gives each request exactly what it gets alone: tokens and
    log-probabilities bitwise. (Llama 4's sigmoid router and GLM-4.5's broke it by an ulp: torch.sigmoid takes
    another loop by the tensor's size; vocabulary.sigmoid does not.)"""
    src, _ = exported[name]
    whole, _ = engines[name]
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (n,), generator=generator).tolist() for n in (11, 23, 7)]
    ks = sorted({_k(src, "small"), _k(src, "trained"), _k(src, "max")})
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, experts_per_token=k, logprobs=3) for k in ks]
    prompts = prompts[: len(params)]
    together = [out.outputs[0] for out in whole.generate(prompts, params)]
    for prompt, param, got in zip(prompts, params, together, strict=True):
        alone = whole.generate([prompt], param)[0].outputs[0]
        assert (got.token_ids, got.logprobs, got.top_logprobs) == (alone.token_ids, alone.logprobs, alone.top_logprobs)


def test_phimoe_conventions_in_the_artifact(exported) -> None:
    llm = LLM(exported["phimoe"][1])
    config = llm.config
    assert config.norm == "layernorm" and config.attention_bias and config.attention_out_bias and config.lm_head_bias
    assert config.moe.router.kind == "sparsemixer" and config.moe.router.jitter_eps == 0.3
    assert config.rope_scaling.type == "longrope" and config.rope_scaling.attention_factor == 1.2
    assert config.max_position_embeddings == LONGROPE_ORIGINAL  # capped: the short regime only
    assert config.moe.default_k == 2 and config.is_approximate(1) and not config.is_approximate(2)
    with pytest.raises(ValidationError, match="moe.policy top_p is not defined for router kind sparsemixer"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, moe=MoEPolicy(p=0.5)))


def test_granite_conventions_in_the_artifact(exported) -> None:
    granite = LLM(exported["granitemoe"][1]).config
    scales = (granite.embedding_scale, granite.residual_scale, granite.attention_scale, granite.logits_divisor)
    assert scales == (3.0, 0.4, 0.1, 2.5)  # embedding, residual and attention multipliers, logits_scaling
    assert granite.moe.router.kind == "topk_softmax" and granite.moe.router.normalize
    assert granite.moe.shared_expert is None
    shared = LLM(exported["granitemoeshared"][1]).config
    assert shared.moe.shared_expert.kind == "glu" and shared.moe.shared_expert.intermediate_size == 56
    assert not shared.moe.shared_expert_gate and shared.moe.default_k == 3


def test_what_cannot_be_served_exactly_is_refused_by_name(tmp_path: Path, caplog) -> None:
    phi = save_hf_model("phimoe", tmp_path / "phi")
    dst = tmp_path / "dst"
    edit_config(phi, sliding_window=32)  # transformers' Phi slides in every layer: served as such
    windowed = LLM(export_hf(phi, tmp_path / "window", NO_PROGRESS)).config
    assert [a.window for a in windowed.layer_attention] == [32, 32]
    edit_config(phi, sliding_window=1024)  # wider than every position served: nothing to serve
    with caplog.at_level(logging.WARNING):
        assert LLM(export_hf(phi, tmp_path / "wide-window", NO_PROGRESS)).config.layer_attention is None
    assert "max_position_embeddings 512 is capped to it" in caplog.text
    qwen = save_hf_model("qwen2_moe", tmp_path / "qwen")
    edit_config(qwen, use_sliding_window=True, sliding_window=16)  # its own rule for which layers slide
    with pytest.raises(ExportError, match="use_sliding_window is not supported .sliding_window 16, shorter"):
        export_hf(qwen, dst, NO_PROGRESS)
    edit_config(phi, rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ExportError, match="rope type 'yarn' is not supported for phimoe .supported: default, longrope"):
        export_hf(phi, dst, NO_PROGRESS)
    granite = save_hf_model("granitemoe", tmp_path / "granite")
    edit_config(granite, residual_multiplier=None)
    with pytest.raises(ExportError, match="residual_multiplier must be a number; got None"):
        export_hf(granite, dst, NO_PROGRESS)
    edit_config(granite, residual_multiplier=0.0)
    with pytest.raises(ExportError, match=r"residual_scale must be in \(0, 1e\+06\]"):
        export_hf(granite, dst, NO_PROGRESS)
    assert not dst.exists()


def test_gpt_oss_conventions_in_the_artifact_and_each_one_matters(exported) -> None:
    """Windows on the sliding layers only, sinks, biased router and experts, the clamped SwiGLU; serving the
    same weights without the windows, or without the sinks, moves the logits: the parity test sees both."""
    src, artifact = exported["gpt_oss"]
    llm = LLM(artifact)
    config = llm.config
    assert [a.window for a in config.layer_attention] == [8, None, 8, None] and config.attention_sinks
    expert = config.moe.expert
    assert (expert.activation, expert.swiglu_alpha, expert.swiglu_limit, expert.use_bias) == (
        "swigluoai",
        1.702,
        1.0,
        True,
    )
    assert config.moe.router.use_bias and config.moe.router.normalize and config.attention_out_bias
    assert config.attention_features == ("sliding-window attention", "attention sinks")
    sequence = torch.randint(0, 300, (1, 36), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = FAMILIES["gpt_oss"][0].from_pretrained(src).eval()(sequence).logits[0]

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            hidden, _ = llm.engine.runner.forward_padded(sequence.tolist(), [2])
            return llm.artifact.model.lm_logits(hidden)[0]

    torch.testing.assert_close(logits(), want, atol=LOGITS_ATOL, rtol=0)
    attns = [layer.attn for layer in llm.artifact.model.layers]
    windows, sinks = [a.window for a in attns], [a.sinks.detach().clone() for a in attns]
    for a in attns:
        a.window = None
    assert (logits() - want).abs().max() > 1e-2
    for a, window in zip(attns, windows, strict=True):
        a.window = window
        a.sinks.data.fill_(float("-inf"))  # a sink of weight exp(-inf) = 0: plain softmax
    assert (logits() - want).abs().max() > 1e-2
    for a, sink in zip(attns, sinks, strict=True):
        a.sinks.data.copy_(sink)
    torch.testing.assert_close(logits(), want, atol=LOGITS_ATOL, rtol=0)


def _mxfp4_encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] float -> MXFP4 blocks [..., rows, cols / 32, 16] and scales [..., rows, cols / 32] (the
    nearest E2M1 value of each weight over a power-of-two block scale)."""
    table = torch.tensor(mxfp4.FP4_E2M1)
    groups = weight.reshape(*weight.shape[:-1], -1, mxfp4.BLOCK)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - table).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_gpt_oss_mxfp4_experts_import_as_their_dequantized_values(tmp_path: Path) -> None:
    """The released checkpoints ship experts as MXFP4 blocks and scales: exported, they give the artifact a
    float checkpoint holding the dequantized values gives (whose parity with transformers is tested above)."""
    from safetensors.torch import load_file, save_file

    src = save_hf_model("gpt_oss", tmp_path / "float", seed=5)
    tensors = load_file(src / "model.safetensors")
    packed = dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _mxfp4_encode(tensors[name].transpose(1, 2))  # the checkpoint's [N, out, in]
        tensors[name] = mxfp4.dequantize(blocks, scales, torch.float32, name).transpose(1, 2).contiguous()
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    quantized = tmp_path / "mxfp4"
    shutil.copytree(src, quantized)
    save_file(packed, quantized / "model.safetensors", metadata={"format": "pt"})
    ours = load_file(export_hf(src, tmp_path / "a", NO_PROGRESS) / "model.safetensors")
    theirs = load_file(export_hf(quantized, tmp_path / "b", NO_PROGRESS) / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
    assert any("experts.gate_proj" in n for n in ours)


def test_paths_without_windows_or_sinks_refuse_gpt_oss_by_name(exported, tmp_path: Path) -> None:
    """The ONNX export and CUDA graphs name what they lack (the vLLM plugin: tests/vllm/test_plugin_offline.py;
    the decode stack: tests/unit/engine/test_decode_stack.py); the engine serves the model eagerly."""
    from moe_serve.engine.decode_graphs import unsupported_reason
    from moe_serve.exporters.onnx.export import export_onnx

    artifact = exported["gpt_oss"][1]
    with pytest.raises(ExportError, match="the ONNX export does not support sliding-window attention, attention sinks"):
        export_onnx(artifact, tmp_path / "onnx", verify=False)
    assert not (tmp_path / "onnx").exists()
    reason = unsupported_reason(LLM(artifact).config)
    assert (
        reason == "sliding-window attention, attention sinks run the torch attention, which reads lengths on the host"
    )


def test_llama4_conventions_in_the_artifact_and_each_one_matters(exported) -> None:
    """Chunks on the rotary layers, a global NoPE layer with temperature tuning and without the q/k norm, the
    sigmoid router scaling each expert's input; serving the same weights without any one of these moves the
    logits: the parity test sees each."""
    src, artifact = exported["llama4"]
    llm = LLM(artifact)
    config = llm.config
    assert [(a.chunk, a.rotary, a.qk_norm) for a in config.layer_attention] == [(8, True, True)] * 3 + [
        (None, False, False)
    ]
    assert (config.attention_temperature.floor_scale, config.attention_temperature.scale) == (4.0, 0.1)
    assert config.moe.router.kind == "topk_sigmoid" and config.moe.weights_scale_input
    assert config.moe.layers == (1, 3) and config.ffn.intermediate_size == 80 and config.moe.shared_expert
    assert config.rope_scaling.type == "llama3" and config.qk_norm == "per_head"
    sequence = torch.randint(0, 300, (1, 36), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = FAMILIES["llama4"][0].from_pretrained(src).eval()(sequence).logits[0]

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            hidden, _ = llm.engine.runner.forward_padded(sequence.tolist(), [1])
            return llm.artifact.model.lm_logits(hidden)[0]

    torch.testing.assert_close(logits(), want, atol=LOGITS_ATOL, rtol=0)
    layers = llm.artifact.model.layers
    moe_blocks = [layer.moe for layer in layers if layer.is_moe]
    changes = [
        (layers[0].attn, "chunk", None),  # a rotary layer attending past its chunk
        (layers[3].attn, "temperature", None),  # the NoPE layer without temperature tuning
        *((block, "config", dataclasses.replace(block.config, weights_scale_input=False)) for block in moe_blocks),
    ]
    for target, name, value in changes:
        kept = getattr(target, name)
        setattr(target, name, value)
        assert (logits() - want).abs().max() > 1e-3, name
        setattr(target, name, kept)
    torch.testing.assert_close(logits(), want, atol=LOGITS_ATOL, rtol=0)
    with pytest.raises(ExportError, match="does not support local attention chunks, layers without rotary"):
        from moe_serve.exporters.onnx.export import check_exportable

        check_exportable(config)


@pytest.mark.slow
def test_a_multimodal_llama4_checkpoint_exports_its_text_model(tmp_path: Path, caplog) -> None:
    """Llama 4's released checkpoints are Llama4ForConditionalGeneration: the text model's config under
    text_config and its tensors under language_model.; the export serves the text (greedy tokens equal
    transformers' on text alone) and says the images are not served."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration, Llama4VisionConfig

    text = FAMILIES["llama4"][1]()
    vision = Llama4VisionConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vision_output_dim=32,
        projector_input_dim=32, projector_output_dim=32, image_size=28, patch_size=14,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Llama4ForConditionalGeneration(Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict()))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.15 + (1.0 if name.endswith("norm.weight") else 0.0))
    src = tmp_path / "hf"
    model.eval().save_pretrained(src)
    reference = save_hf_model("llama4", tmp_path / "tokenizer-source")
    shutil.copy(reference / "tokenizer.json", src / "tokenizer.json")
    with caplog.at_level(logging.WARNING):
        artifact = export_hf(src, tmp_path / "artifact", NO_PROGRESS)
    assert "exporting its text model only (images are not served)" in caplog.text
    prompt = torch.randint(0, 300, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    tokens = prompt[0].tolist()
    with torch.no_grad():  # its own text model, greedy (its forward and generate fail on text alone in 5.24)
        for _ in range(NEW):
            tokens.append(int(model.language_model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    got = LLM(artifact).generate([prompt[0].tolist()], params)[0].outputs[0].token_ids
    assert got == tokens[PROMPT:]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral_window", "gpt_oss", "llama4"])
def test_a_sliding_window_model_gives_back_the_blocks_its_window_left(exported, monkeypatch, name: str) -> None:
    """A window of 8 keys, blocks of 16: Mixtral slides on every layer (one KV group), gpt-oss on alternate
    layers (a full and a sliding group of two layers each, engine.kv_cache); Llama 4 reads local chunks of 8
    on three layers of four (a full group and three chunked ones, a layer each). Over 200 generated tokens a
    local group holds at most the two blocks its window can span plus the one it fills while the full group
    keeps them all, and the tokens still equal transformers' (the window's keys are all there; no released
    block is read). A second run of the same prompt finds its first two blocks in the prefix cache (a local
    group's within its reach only) and generates the same tokens."""
    src, artifact = exported[name]
    llm = LLM(artifact, EngineConfig(block_size=16))
    reaches = {"mixtral_window": (8,), "gpt_oss": (None, 8), "llama4": (None, 8, 8, 8)}[name]
    assert llm.engine.blocks.reaches == reaches
    held: list[list[int]] = []
    update = llm.engine.scheduler.update

    def recording(output, failed=()) -> None:
        update(output, failed)
        seq = output.scheduled[0].seq
        held.append([sum(b != RELEASED for b in table) for table in seq.block_tables])

    monkeypatch.setattr(llm.engine.scheduler, "update", recording)
    prompt = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(6))
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    got = llm.generate([prompt[0].tolist()], params)[0].outputs[0].token_ids
    with torch.no_grad():
        model = FAMILIES[name][0].from_pretrained(src).eval()
        want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=200, do_sample=False)
    assert got == want[0, 40:].tolist()
    assert len(held) > 150
    for group, reach in enumerate(reaches):
        most = max(step[group] for step in held[1:])
        assert most == 15 if reach is None else most <= 3  # 240 tokens take 15 blocks without the release
    assert llm.engine.blocks.num_used_blocks == 0  # and the finished sequence gave back the rest
    again = llm.generate([prompt[0].tolist()], params)[0]
    assert again.outputs[0].token_ids == got and llm.engine.blocks.stats.hit_tokens == 32


def test_keys_a_released_config_omits_mean_what_transformers_defaults_them_to(caplog) -> None:
    """Released configs leave keys to their config class's defaults (Llama 4 Scout: no_rope_layers [], no
    temperature or chunk keys, llama3 scaling with equal frequency factors, a 10M context; gpt-oss trimmed):
    the export reads them as transformers does."""
    from moe_serve.exporters.hf import convert_config

    scout = {
        "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "vocab_size": 300, "hidden_size": 64,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 48, "intermediate_size_mlp": 80, "num_local_experts": 4, "num_experts_per_tok": 1,
        "no_rope_layers": [], "max_position_embeddings": 10485760,
        "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192}, "rope_theta": 500000.0,
    }  # fmt: skip
    with caplog.at_level(logging.WARNING):
        config = convert_config(scout)
    assert [(a.chunk, a.rotary, a.qk_norm) for a in config.layer_attention] == [(8192, True, True)] * 3 + [
        (None, False, False)
    ] + [(8192, True, True)] * 3 + [(None, False, False)]
    temperature = config.attention_temperature
    assert (temperature.floor_scale, temperature.scale, config.qk_norm, config.norm_eps) == (
        8192,
        0.1,
        "per_head",
        1e-5,
    )
    assert config.rope_scaling.low_freq_factor == config.rope_scaling.high_freq_factor == 1.0
    assert config.max_position_embeddings == 1 << 20 and "capped to it" in caplog.text
    layout = kv_layout(config)  # its global layers read every key, its chunked ones release what is behind
    assert layout.reaches == (None, 8192, 8192, 8192) and layout.groups[0].layers == (3, 7)
    trimmed = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 300, "hidden_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 4096,
    }  # fmt: skip
    config = convert_config(trimmed)
    assert [a.window for a in config.layer_attention] == [128, None, 128, None]
    assert config.attention_bias and config.attention_out_bias and config.moe.expert.swiglu_limit == 7.0
    assert (
        config.rope_scaling.type == "yarn" and config.rope_scaling.factor == 32.0 and not config.rope_scaling.truncate
    )


def test_glm4_moe_conventions_in_the_artifact_and_partial_rotary_matters(exported) -> None:
    """DeepSeek-V3's router with ordinary attention, per-head q/k norms and half of each head rotating: the
    same weights with every dim rotating give other logits, so the parity test sees the partial rotary."""
    from moe_serve.layers.positions import rotary_cos_sin

    src, artifact = exported["glm4_moe"]
    llm = LLM(artifact)
    config = llm.config
    router = config.moe.router
    assert (config.rotary_dim, config.head_dim, config.qk_norm, config.attention_bias) == (8, 16, "per_head", True)
    assert (router.kind, router.groups, router.groups_kept, router.correction_bias, router.scale) == (
        "grouped_topk", 4, 2, True, 1.5
    )  # fmt: skip
    assert config.moe.layers == (1, 2) and config.moe.shared_expert.intermediate_size == 32 and config.moe.max_k == 4
    sequence = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = FAMILIES["glm4_moe"][0].from_pretrained(src).eval()(sequence).logits[0]

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            hidden, _ = llm.engine.runner.forward_padded(sequence.tolist(), [2])
            return llm.artifact.model.lm_logits(hidden)[0]

    torch.testing.assert_close(logits(), want, atol=LOGITS_ATOL, rtol=0)
    full = rotary_cos_sin(torch.arange(config.max_position_embeddings), 16, config.rope_theta)
    for layer in llm.artifact.model.layers:
        layer.attn._rotary = full
    assert (logits() - want).abs().max() > 1e-3
