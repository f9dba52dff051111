"""Artifacts of packed weights (bf16, int8, int4): `moe-serve quantize`, loading and its validation, packing at
load (EngineConfig.weights), the runtimes that refuse them, and what a packed model computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moe_serve import LLM, SamplingParams
from moe_serve.artifact import CONFIG_FILE, WEIGHTS_FILE, load_artifact, save_artifact
from moe_serve.config import EngineConfig
from moe_serve.errors import ArtifactError, ValidationError
from moe_serve.kernels.packed import PACKED_FORMATS, PackedWeight, WeightFormat, dequantize, quantize
from moe_serve.layers.routers import router_config
from moe_serve.model_config import FFNConfig
from moe_serve.quantize import quantize_artifact
from moe_serve.testing import random_state_dict
from moe_serve.tokenizer import Tokenizer, byte_level_tokenizer
from moe_serve.weights import packable_weights
from tests.conftest import classifier_config, edit_config, edit_weights, lm_config, moe_config

FORMATS = [f.value for f in PACKED_FORMATS]


def packable_config():
    """Every linear's input features a multiple of 32, so every packable weight packs."""
    return lm_config(hidden_size=64, moe=moe_config(expert=FFNConfig("glu", 64)))


@pytest.fixture
def float_artifact(tmp_path: Path) -> Path:
    config = lm_config()
    return save_artifact(
        tmp_path / "float", config, random_state_dict(config, seed=1), Tokenizer(byte_level_tokenizer())
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_writes_version_2_with_the_packed_weights_and_their_scales(
    tmp_path: Path, float_artifact: Path, fmt: str
) -> None:
    out = quantize_artifact(float_artifact, tmp_path / fmt, fmt, progress=False)
    manifest = json.loads((out / CONFIG_FILE).read_text())
    assert manifest["format_version"] == 2
    assert manifest["weights"]["format"] == fmt
    config = load_artifact(float_artifact).config
    expected = packable_weights(config, WeightFormat(fmt))
    assert sorted(manifest["weights"]["packed"]) == sorted(expected)
    assert "lm_head.weight" in expected and "layers.1.moe.router.weight" not in expected
    # The experts' down projection reads 48 features, not a multiple of the group of 32: it stays as it was
    # (the kernel takes each of a bank's matrices in its own format).
    assert ("layers.1.moe.experts.down_proj.weight" in expected) == (fmt == "bf16")
    assert "layers.1.moe.experts.gate_proj.weight" in expected
    assert "layers.0.ffn.fc1.weight" in expected
    stored = load_file(out / WEIGHTS_FILE)
    source = load_file(float_artifact / WEIGHTS_FILE)
    for name in expected:
        if fmt == "bf16":
            assert stored[name].dtype == torch.bfloat16
        else:
            assert stored[f"{name}.qdata"].dtype == (torch.int8 if fmt == "int8" else torch.uint8)
            assert stored[f"{name}.scales"].dtype == torch.float16
            packed = PackedWeight(
                WeightFormat(fmt), stored[f"{name}.qdata"], stored[f"{name}.scales"], source[name].shape
            )
            assert torch.equal(dequantize(packed), quantize(source[name], WeightFormat(fmt)).dequantize())
    assert torch.equal(stored["layers.1.moe.router.weight"], source["layers.1.moe.router.weight"])
    assert load_artifact(out).weights.format.value == fmt  # type: ignore[union-attr]


def test_packed_weights_read_fewer_bytes(tmp_path: Path) -> None:
    config = packable_config()
    src = save_artifact(tmp_path / "float", config, random_state_dict(config), Tokenizer(byte_level_tokenizer()))
    sizes = {
        fmt: (quantize_artifact(src, tmp_path / fmt, fmt, progress=False) / WEIGHTS_FILE).stat().st_size
        for fmt in FORMATS
    }
    assert sizes["int4"] < sizes["int8"] < sizes["bf16"] < (src / WEIGHTS_FILE).stat().st_size


def test_quantize_refuses_a_packed_source_and_an_unknown_format(tmp_path: Path, float_artifact: Path) -> None:
    packed = quantize_artifact(float_artifact, tmp_path / "int8", "int8", progress=False)
    with pytest.raises(ArtifactError, match="already stores int8 weights"):
        quantize_artifact(packed, tmp_path / "again", "int4", progress=False)
    with pytest.raises(ArtifactError, match="--weights must be one of bf16, int8, int4; got 'int3'"):
        quantize_artifact(float_artifact, tmp_path / "x", "int3", progress=False)
    with pytest.raises(ArtifactError, match="already exists"):
        quantize_artifact(float_artifact, packed, "int8", progress=False)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantized_artifact_serves_like_its_float_weights_packed_at_load(
    tmp_path: Path, float_artifact: Path, fmt: str
) -> None:
    """One definition of packing: the artifact `quantize` writes and EngineConfig.weights at load give the same
    tokens and the same logprobs, bitwise."""
    stored = LLM(quantize_artifact(float_artifact, tmp_path / fmt, fmt, progress=False))
    at_load = LLM(float_artifact, EngineConfig(weights=fmt))
    for k in (1, 2, 4):
        params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, experts_per_token=k)
        a = stored.generate(["To be, or not", "Exit"], params)
        b = at_load.generate(["To be, or not", "Exit"], params)
        for x, y in zip(a, b, strict=True):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            assert x.outputs[0].logprobs == y.outputs[0].logprobs


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_logits_match_a_float_model_of_the_dequantized_weights(tmp_path: Path, fmt: str) -> None:
    """What the kernels compute with packed weights is what the float model of their dequantized values computes
    (fp32 accumulation either way; only the order of additions differs)."""
    config = packable_config()
    state = random_state_dict(config, seed=2)
    src = save_artifact(tmp_path / "float", config, state, Tokenizer(byte_level_tokenizer()))
    packed_path = quantize_artifact(src, tmp_path / fmt, fmt, progress=False)
    packed = load_artifact(packed_path)
    reference_state = dict(state)
    for name in packed.weights.packed:  # type: ignore[union-attr]
        reference_state[name] = quantize(state[name], WeightFormat(fmt)).dequantize()
    reference = save_artifact(tmp_path / "dequantized", config, reference_state, Tokenizer(byte_level_tokenizer()))
    texts = ["Now is the winter of our discontent", "Exit, pursued by a bear."]
    for k in (1, 2, 4):
        got = LLM(packed_path).score(texts, experts_per_token=k, return_token_logprobs=True)
        want = LLM(reference).score(texts, experts_per_token=k, return_token_logprobs=True)
        for g, w in zip(got, want, strict=True):
            assert g.token_logprobs == pytest.approx(w.token_logprobs, abs=2e-4)


def test_packable_weights_leave_what_is_read_as_floats(tmp_path: Path) -> None:
    smear = packable_weights(classifier_config(), WeightFormat.BF16)
    assert not any(".moe.experts." in name for name in smear)  # SMEAR averages its experts' parameters
    assert "layers.0.attn.o_proj.weight" in smear and not any("classifier" in n or "embed" in n for n in smear)
    attention = lm_config(moe=moe_config(router=router_config("attention", heads=(0,))))
    names = packable_weights(attention, WeightFormat.BF16)
    assert "layers.1.attn.o_proj.weight" not in names  # its router reads W_O per head
    assert "layers.0.attn.o_proj.weight" in names
    tied = packable_weights(lm_config(tie_word_embeddings=True), WeightFormat.INT8)
    assert "lm_head.weight" not in tied


def _weights_entry(key: str, value):
    return lambda manifest: manifest["weights"].__setitem__(key, value)


ROUTER = "layers.1.moe.router.weight"


@pytest.mark.parametrize(
    "edit, message",
    [
        (_weights_entry("format", "int3"), "weights format must be one of bf16, int8, int4; got 'int3'"),
        (_weights_entry("group_size", 64), "weights group_size 64 is not supported; this runtime reads 32"),
        (lambda m: m["weights"]["packed"].append(ROUTER), f"weight '{ROUTER}' cannot be stored as int8"),
        (lambda m: m.__setitem__("format_version", 1), '"weights" needs format_version 2'),
        (_weights_entry("packed", "all"), 'weights "packed" must be a list of tensor names'),
        (lambda m: m["weights"]["packed"].pop(), 'weights "packed" must list every packable weight of this model'),
        (lambda m: m["weights"]["packed"].append(m["weights"]["packed"][0]), "lists '.*' twice"),
        (_weights_entry("scale_dtype", "f32"), "the weights section has no field 'scale_dtype' for int8 weights"),
    ],
    ids=["format", "group", "router", "version", "packed", "partial", "twice", "unknown"],
)
def test_a_bad_weights_section_is_refused_by_name(tmp_path: Path, float_artifact: Path, edit, message: str) -> None:
    out = quantize_artifact(float_artifact, tmp_path / "int8", "int8", progress=False)
    edit_config(out, edit)
    with pytest.raises(ArtifactError, match=message):
        load_artifact(out, verify_checksums=False)


QDATA, SCALES = "lm_head.weight.qdata", "lm_head.weight.scales"


def _replace(name: str, change):
    return lambda tensors: tensors.__setitem__(name, change(tensors[name]))


def _poke(name: str, value: float):
    return lambda tensors: tensors[name].__setitem__((0, 0), value)


@pytest.mark.parametrize(
    "edit, message",
    [
        (_replace(QDATA, lambda t: t.to(torch.int16)), f"tensor '{QDATA}' has dtype I16; int8 weights store I8 there"),
        (
            _replace(SCALES, lambda t: t[:, :1].contiguous()),
            rf"tensor '{SCALES}' has shape \[260, 1\], expected \[260, 2\]",
        ),
        (_poke(SCALES, float("nan")), f"tensor '{SCALES}' in model.safetensors holds NaN"),
        (_poke(QDATA, -128), r"holds -128; int8 weights lie in \[-127, 127\]"),
        (lambda t: t.pop(SCALES), f"missing tensor '{SCALES}'"),
    ],
    ids=["dtype", "shape", "nan", "range", "missing"],
)
def test_bad_packed_tensors_are_refused_by_name(tmp_path: Path, edit, message: str) -> None:
    config = packable_config()
    src = save_artifact(tmp_path / "float", config, random_state_dict(config), Tokenizer(byte_level_tokenizer()))
    out = quantize_artifact(src, tmp_path / "int8", "int8", progress=False)
    edit_weights(out, edit)
    with pytest.raises(ArtifactError, match=message):
        load_artifact(out)


def test_packed_weights_refuse_another_device_or_activation_dtype(tmp_path: Path, float_artifact: Path) -> None:
    out = quantize_artifact(float_artifact, tmp_path / "int4", "int4", progress=False)
    with pytest.raises(ArtifactError, match="int4 weights run with float32 activations; --dtype bfloat16 is refused"):
        load_artifact(out, dtype=torch.bfloat16)
    with pytest.raises(ArtifactError, match="int4 weights are read by the CPU kernels; they cannot run on meta"):
        load_artifact(out, device="meta")
    with pytest.raises(ArtifactError, match="already stores int4 weights; it cannot be packed again as int8"):
        load_artifact(out, pack_as=WeightFormat.INT8)
    with pytest.raises(ValidationError, match="--weights packs the torch backend's weights"):
        EngineConfig(weights="int8", backend="onnxruntime")


def test_the_onnx_export_refuses_packed_weights(tmp_path: Path, float_artifact: Path) -> None:
    pytest.importorskip("onnx")
    from moe_serve.exporters.base import ExportError
    from moe_serve.exporters.onnx import export_onnx

    out = quantize_artifact(float_artifact, tmp_path / "int8", "int8", progress=False)
    with pytest.raises(ExportError, match="stores int8 weights .* the ONNX export takes artifacts of float weights"):
        export_onnx(out, tmp_path / "onnx", verify=False)


@pytest.mark.slow
def test_a_quantized_classifier_classifies_as_the_float_model_of_its_dequantized_weights(tmp_path: Path) -> None:
    config = classifier_config(hidden_size=64)
    state = random_state_dict(config, seed=4)
    tokenizer = Tokenizer(byte_level_tokenizer())
    src = save_artifact(tmp_path / "float", config, state, tokenizer)
    texts = ["Exit, pursued by a bear.", "Now is the winter of our discontent"]
    for fmt in FORMATS:
        packed = quantize_artifact(src, tmp_path / fmt, fmt, progress=False)
        reference = dict(state)
        for name in load_artifact(packed).weights.packed:  # type: ignore[union-attr]
            reference[name] = quantize(state[name], WeightFormat(fmt)).dequantize()
        want = LLM(save_artifact(tmp_path / f"{fmt}-dequantized", config, reference, tokenizer)).classify(texts)
        for got, expected in zip(LLM(packed).classify(texts), want, strict=True):
            assert got.probs == pytest.approx(expected.probs, abs=1e-5)
