"""Artifact save/load round trip, and one clear error per kind of bad artifact."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from moe_serve import LLM
from moe_serve.artifact import CONFIG_FILE, WEIGHTS_FILE, load_artifact, save_artifact
from moe_serve.errors import ArtifactError, ConfigError
from moe_serve.model_config import ModelConfig
from moe_serve.testing import random_state_dict
from moe_serve.tokenizer import Tokenizer, byte_level_tokenizer
from tests.conftest import classifier_config, edit_config, edit_weights, lm_config


@pytest.mark.parametrize("config", [lm_config(), classifier_config()], ids=["causal_lm", "classifier"])
def test_round_trip_preserves_config_tensors_and_tokenizer(tmp_path: Path, config: ModelConfig) -> None:
    state = random_state_dict(config, seed=3)
    tokenizer = Tokenizer(byte_level_tokenizer())
    path = save_artifact(tmp_path / "a", config, state, tokenizer, provenance={"exporter": "test"})
    artifact = load_artifact(path)
    assert artifact.config == config
    assert artifact.provenance["exporter"] == "test"
    loaded = artifact.model.state_dict()
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name
    assert artifact.tokenizer.encode("Exit, pursued by a bear.") == tokenizer.encode("Exit, pursued by a bear.")


def test_half_precision_storage_loads_as_fp32(tmp_path: Path) -> None:
    config = lm_config()
    state = random_state_dict(config)
    path = save_artifact(tmp_path / "a", config, state, Tokenizer(byte_level_tokenizer()), dtype=torch.bfloat16)
    assert (path / WEIGHTS_FILE).stat().st_size < sum(t.numel() for t in state.values()) * 2 + 100_000
    artifact = load_artifact(path)
    weight = artifact.model.embed_tokens.weight
    assert weight.dtype == torch.float32
    assert torch.equal(weight, state["embed_tokens.weight"].to(torch.bfloat16).float())


BAD_CONFIGS = {
    "unknown format_version": (lambda m: m.__setitem__("format_version", 99), "unknown format_version 99"),
    "unknown router kind": (
        lambda m: m["model"]["moe"]["router"].__setitem__("kind", "expert_choice"),
        "router kind must be one of",
    ),
    "k above num_experts": (
        lambda m: m["model"]["moe"]["experts_per_token"].__setitem__("max", 9),
        "experts_per_token range must satisfy 1 <= min <= default <= max <= num_experts (4)",
    ),
    "k default zero": (
        lambda m: m["model"]["moe"]["experts_per_token"].__setitem__("default", 0),
        "experts_per_token.default must be an integer between 1 and",
    ),
    "not a moe-serve config": (lambda m: m.__setitem__("format", "gguf"), "is not a moe-serve artifact config"),
    "missing field": (lambda m: m["model"].pop("hidden_size"), "model: missing required field 'hidden_size'"),
    "residual scale zero": (lambda m: m["model"].__setitem__("residual_scale", 0), "residual_scale must be in (0, "),
    "attention scale negative": (
        lambda m: m["model"].__setitem__("attention_scale", -0.5),
        "attention_scale must be in (0, ",
    ),
    "logits divisor not a number": (
        lambda m: m["model"].__setitem__("logits_divisor", "6"),
        "model.logits_divisor must be a number",
    ),
    "longrope past its short regime": (
        lambda m: m["model"].__setitem__("rope_scaling", _longrope(original=128)),
        "rope_scaling longrope is served in its short regime only, for positions below "
        "original_max_position_embeddings (128); max_position_embeddings 256 goes past it",
    ),
    "longrope factors of the wrong length": (
        lambda m: m["model"].__setitem__("rope_scaling", {**_longrope(original=256), "short_factor": [1.0, 2.0]}),
        "rope_scaling.short_factor needs head_dim / 2 = 4 values; got 2",
    ),
    "layer_attention of another length": (
        lambda m: m["model"].__setitem__("layer_attention", [{"window": 4}]),
        "layer_attention needs one entry per layer",
    ),
    "temperature without a NoPE layer": (
        lambda m: m["model"].__setitem__("attention_temperature", {"floor_scale": 4, "scale": 0.1}),
        "attention_temperature applies to layers without rotary",
    ),
    "swiglu limit on another activation": (
        lambda m: m["model"]["moe"]["expert"].__setitem__("swiglu_limit", 7.0),
        "swiglu_alpha and swiglu_limit go with activation swigluoai",
    ),
    "swigluoai without its limit": (
        lambda m: m["model"]["moe"]["expert"].update(kind="glu", activation="swigluoai", swiglu_alpha=1.7),
        "activation swigluoai needs ffn kind glu, swiglu_alpha and swiglu_limit",
    ),
    "llama3 scaling with low above high": (
        lambda m: m["model"].__setitem__(
            "rope_scaling",
            {
                "type": "llama3",
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "low_freq_factor": 4.0,
                "high_freq_factor": 1.0,
            },
        ),  # fmt: skip
        "rope_scaling llama3 needs 0 < low_freq_factor <= high_freq_factor; got 4.0, 1.0",
    ),
    "short factors without longrope": (
        lambda m: m["model"].__setitem__("rope_scaling", {"type": "linear", "factor": 2.0, "short_factor": [1.0]}),
        "rope_scaling.short_factor goes with type longrope only; got type linear",
    ),
}


def _longrope(original: int) -> dict:
    """Phi-3.5's rotary scaling for the test LM (head_dim 8: four frequencies)."""
    return {
        "type": "longrope",
        "factor": 4.0,
        "original_max_position_embeddings": original,
        "attention_factor": 1.2,
        "short_factor": [1.0, 1.5, 2.0, 3.0],
    }


@pytest.mark.parametrize("edit,message", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_bad_config_is_refused_with_a_clear_message(make_artifact, edit, message: str) -> None:
    path = make_artifact()
    edit_config(path, edit)
    with pytest.raises(ArtifactError, match=re.escape(message)):
        load_artifact(path)


BAD_WEIGHTS = {
    "missing tensor": (
        lambda t: t.pop("layers.1.moe.router.weight"),
        r"missing tensor 'layers.1.moe.router.weight' \(expected shape \[4, 32\]\)",
    ),
    "unexpected tensor": (
        lambda t: t.__setitem__("layers.0.moe.router.weight", torch.zeros(4, 32)),
        "unexpected tensor 'layers.0.moe.router.weight'",
    ),
    "wrong shape": (
        lambda t: t.__setitem__("layers.1.moe.experts.down_proj.weight", torch.zeros(4, 32, 47)),
        r"tensor 'layers.1.moe.experts.down_proj.weight' has shape \[4, 32, 47\], expected \[4, 32, 48\]",
    ),
    "integer dtype": (
        lambda t: t.__setitem__("norm.weight", torch.ones(32, dtype=torch.int32)),
        "tensor 'norm.weight' has dtype I32",
    ),
}


@pytest.mark.parametrize("edit,pattern", BAD_WEIGHTS.values(), ids=BAD_WEIGHTS.keys())
def test_bad_tensors_are_refused_naming_the_tensor(make_artifact, edit, pattern: str) -> None:
    path = make_artifact()
    edit_weights(path, edit)
    with pytest.raises(ArtifactError, match=pattern):
        load_artifact(path)


def test_checksum_mismatch_is_refused(make_artifact) -> None:
    path = make_artifact()
    data = bytearray((path / WEIGHTS_FILE).read_bytes())
    data[-1] ^= 0xFF  # flip bits in the last weight byte
    (path / WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum mismatch for model.safetensors: config.json records sha256"):
        load_artifact(path)
    load_artifact(path, verify_checksums=False)  # the user can opt out knowingly


def test_missing_files_and_directories(make_artifact, tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="is not an artifact directory"):
        load_artifact(tmp_path / "nope")
    path = make_artifact()
    (path / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match="has no tokenizer.json"):
        load_artifact(path)
    (path / CONFIG_FILE).write_text("{not json")
    with pytest.raises(ArtifactError, match="config.json is not valid JSON"):
        load_artifact(path)


def test_llm_names_a_missing_model(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="no artifact directory .*no bundled model of that name"):
        LLM(str(tmp_path / "missing"))


def test_failed_save_leaves_no_partial_artifact(tmp_path: Path) -> None:
    config = lm_config()
    state = random_state_dict(config)
    state["layers.1.moe.router.weight"] = torch.zeros(3, 32)
    with pytest.raises(ArtifactError, match="has shape \\[3, 32\\], expected \\[4, 32\\]"):
        save_artifact(tmp_path / "dst", config, state, Tokenizer(byte_level_tokenizer()))
    assert list(tmp_path.iterdir()) == []


def test_config_rejects_soft_merge_for_causal_lm() -> None:
    import dataclasses

    moe = dataclasses.replace(classifier_config().moe)
    with pytest.raises(ConfigError, match="soft_merge decides once per complete input"):
        lm_config(moe=moe)


def test_an_artifact_written_before_the_scale_fields_loads_with_the_same_results(make_artifact) -> None:
    """residual_scale, attention_scale and logits_divisor (Granite's multipliers) default to what every model
    computed before them: an artifact without them loads to the same config and the same logits."""
    path = make_artifact()
    old = shutil.copytree(path, path.parent / "written-before")
    edit_config(old, lambda m: [m["model"].pop(key) for key in ("residual_scale", "attention_scale", "logits_divisor")])
    assert "residual_scale" not in json.loads((old / CONFIG_FILE).read_text())["model"]
    llms = [LLM(path), LLM(old)]
    config = llms[1].config
    assert config == llms[0].config
    assert [config.residual_scale, config.attention_scale, config.logits_divisor] == [1, None, 1]
    with torch.inference_mode():
        logits = [
            llm.artifact.model.lm_logits(llm.engine.runner.forward_padded([[5, 9, 14, 2, 77]], [2])[0]) for llm in llms
        ]
    assert torch.equal(logits[0], logits[1])


def test_conventions_a_kind_cannot_follow_are_refused_by_name() -> None:
    """weights_scale_input (Llama 4) means nothing to a kind that decides once per input; a kind that reads
    the layer's attention computes it over every key, without windows or sinks."""
    import dataclasses

    from moe_serve.layers.routers import router_config
    from moe_serve.model_config import FFNConfig, LayerAttention
    from tests.conftest import moe_config

    with pytest.raises(ConfigError, match="moe.weights_scale_input is not defined for router kind soft_merge"):
        moe_config(expert=FFNConfig("adapter", 8), router=router_config("soft_merge"), weights_scale_input=True)
    reading = moe_config(router=router_config("attention", sigma=1.0, heads=(0,)), layers=(0,))
    with pytest.raises(ConfigError, match="router kind attention reads plain attention; this model has sliding-window"):
        dataclasses.replace(lm_config(moe=reading), layer_attention=(LayerAttention(window=4), LayerAttention()))


def test_a_models_layers_share_one_rotary_table() -> None:
    """The cos/sin tables are built once for a model's context and shared by its layers (positions.rotary_tables),
    equal to the tables built directly."""
    from moe_serve.layers.positions import rotary_cos_sin
    from moe_serve.models import MoETransformer

    config = lm_config()
    model = MoETransformer(config)
    model.prepare()
    first, *others = [layer.attn._rotary for layer in model.layers]
    assert others and all(t[0] is first[0] and t[1] is first[1] for t in others)
    want = rotary_cos_sin(torch.arange(config.max_position_embeddings), config.head_dim, config.rope_theta)
    assert torch.equal(first[0], want[0]) and torch.equal(first[1], want[1])
