"""Hugging Face MoE import, proven against transformers itself: logits at several k, greedy generation,
mixed-k batches, and clear errors for what cannot be exported."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from moe_serve import LLM, SamplingParams
from moe_serve.exporters.base import ExportError, ExportOptions
from moe_serve.exporters.hf import ARCHITECTURES, export_hf
from tests.conftest import edit_config
from tests.exporters.hf_models import MODELS, NUM_EXPERTS, build_hf_model, save_hf_model

NO_PROGRESS = ExportOptions(progress=False)

ARCHS = list(MODELS)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (HF directory, artifact directory)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in ARCHS:
        src = save_hf_model(name, root / f"{name}-hf", seed=len(name))
        out[name] = (src, export_hf(src, root / f"{name}-artifact", NO_PROGRESS))
    return out


def hf_logits(src: Path, name: str, k: int, input_ids: torch.Tensor) -> torch.Tensor:
    model_class, _ = MODELS[name]
    model = model_class.from_pretrained(src, num_experts_per_tok=k).eval()
    with torch.no_grad():
        return model(input_ids).logits


def our_logits(llm: LLM, input_ids: torch.Tensor, k: int) -> torch.Tensor:
    with torch.inference_mode():
        hidden, _ = llm.engine.runner.forward_padded(input_ids.tolist(), [k] * input_ids.shape[0])
        return llm.artifact.model.lm_logits(hidden)


@pytest.mark.parametrize("name", ARCHS)
def test_logits_match_transformers_at_trained_and_other_k(exported, name: str) -> None:
    src, artifact = exported[name]
    llm = LLM(artifact)
    trained_k = json.loads((src / "config.json").read_text())["num_experts_per_tok"]
    assert llm.config.moe.default_k == trained_k
    input_ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    for k in sorted({trained_k, 1, 2, NUM_EXPERTS}):
        torch.testing.assert_close(
            our_logits(llm, input_ids, k), hf_logits(src, name, k, input_ids), atol=1e-4, rtol=1e-4, msg=f"k={k}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("name", ARCHS)
def test_greedy_generation_matches_transformers_generate(exported, name: str) -> None:
    src, artifact = exported[name]
    llm = LLM(artifact)
    prompt = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    model_class, _ = MODELS[name]
    hf = model_class.from_pretrained(src).eval()
    with torch.no_grad():
        expected = hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False, min_new_tokens=32
        )
    ours = llm.generate([prompt[0].tolist()], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    assert ours.outputs[0].token_ids == expected[0, 12:].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name", ARCHS)
def test_mixed_k_batch_equals_each_request_alone(exported, name: str) -> None:
    _, artifact = exported[name]
    llm = LLM(artifact)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=generator).tolist() for n in (5, 17, 9, 30)]
    ks = [1, 2, NUM_EXPERTS, 3]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, experts_per_token=k) for k in ks]
    together = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together, strict=True):
        alone = llm.generate([prompt], p)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert out.experts_per_token == p.experts_per_token


@pytest.mark.slow
def test_qwen2_moe_layout_and_conventions(exported) -> None:
    llm = LLM(exported["qwen2_moe"][1])
    moe = llm.config.moe
    assert moe.layers == (0, 1, 3)  # mlp_only_layers=[2] stays dense
    assert moe.router.normalize is False and moe.shared_expert_gate
    assert llm.config.attention_bias
    assert LLM(exported["mixtral"][1]).config.moe.router.normalize is True
    assert LLM(exported["olmoe"][1]).config.qk_norm == "full"
    qwen3 = LLM(exported["qwen3_moe"][1]).config
    assert qwen3.qk_norm == "per_head" and qwen3.rope_scaling.type == "yarn" and qwen3.moe.layers == (1,)


@pytest.mark.slow
def test_sharded_checkpoint_with_index_and_bf16_storage(tmp_path: Path) -> None:
    src = save_hf_model("mixtral", tmp_path / "hf", max_shard_size="100KB")
    assert (src / "model.safetensors.index.json").is_file()
    artifact = export_hf(src, tmp_path / "out", ExportOptions(dtype=torch.bfloat16, progress=False))
    llm = LLM(artifact)
    input_ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(4))
    model = build_hf_model("mixtral", seed=0)
    with torch.no_grad():
        # The artifact's rounding: every parameter but the router (kept fp32, docs/architecture.md §3); not the
        # rotary buffers either (those are computed).
        for name, p in model.named_parameters():
            if not name.endswith(".gate.weight"):
                p.copy_(p.to(torch.bfloat16).float())
        expected = model(input_ids).logits
    torch.testing.assert_close(our_logits(llm, input_ids, 2), expected, atol=1e-4, rtol=1e-4)


def test_unsupported_and_broken_sources_fail_before_writing(tmp_path: Path) -> None:
    src = save_hf_model("olmoe", tmp_path / "hf")
    dst = tmp_path / "dst"

    edit_config(src, architectures=["LlamaForCausalLM"])
    with pytest.raises(
        ExportError,
        match=re.escape(f"unsupported architecture LlamaForCausalLM; supported: {', '.join(ARCHITECTURES)}") + "$",
    ):
        export_hf(src, dst, NO_PROGRESS)
    edit_config(src, architectures=["OlmoeForCausalLM"], moe_intermediate_size=1, intermediate_size=50)
    with pytest.raises(
        ExportError,
        match=r"checkpoint tensor 'model.layers.0.mlp.experts.0.gate_proj.weight' has shape \[48, 64\], "
        r"expected \[50, 64\]",
    ):
        export_hf(src, dst, NO_PROGRESS)
    edit_config(src, intermediate_size=48, num_hidden_layers=3)
    with pytest.raises(ExportError, match="checkpoint tensor 'model.layers.2.input_layernorm.weight' is missing"):
        export_hf(src, dst, NO_PROGRESS)
    assert not dst.exists() and [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_missing_shard_and_pickle_only_checkpoints(tmp_path: Path) -> None:
    src = save_hf_model("mixtral", tmp_path / "sharded", max_shard_size="100KB")
    shard = sorted(src.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ExportError, match=f"missing shard {shard.name} listed in model.safetensors.index.json"):
        export_hf(src, tmp_path / "dst", NO_PROGRESS)
    pickled = save_hf_model("mixtral", tmp_path / "pickled")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(
        ExportError, match="only a pickle checkpoint \\(pytorch_model.bin\\); only safetensors are read"
    ):
        export_hf(pickled, tmp_path / "dst", NO_PROGRESS)


def test_cli_exports_and_inspect_reports(tmp_path: Path, capsys) -> None:
    from moe_serve.cli import main

    src = save_hf_model("qwen2_moe", tmp_path / "hf")
    dst = tmp_path / "artifact"
    assert main(["export", "hf", str(src), str(dst), "--dtype", "bf16", "--quiet"]) == 0, capsys.readouterr().err
    assert main(["export", "hf", str(src), str(dst)]) == 2 and "already exists" in capsys.readouterr().err
    assert main(["inspect", str(dst), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["moe"]["experts_per_token"] == {"default": 4, "min": 1, "max": NUM_EXPERTS}
    assert summary["provenance"]["source_architecture"] == "Qwen2MoeForCausalLM"
    assert summary["moe"]["shared_expert"] == "glu x80 (sigmoid-gated)"


def test_export_packs_weights_on_request_and_inspect_names_the_format(tmp_path: Path, capsys) -> None:
    """`export hf --weights int8` writes a version-2 artifact of int8 weights; inspect names the format."""
    from moe_serve.cli import main

    src = save_hf_model("mixtral", tmp_path / "hf")
    dst = tmp_path / "artifact"
    assert main(["export", "hf", str(src), str(dst), "--weights", "int8", "--quiet"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["inspect", str(dst), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["format_version"] == 2 and summary["weights"]["format"] == "int8"
    assert summary["weights"]["packed"] > 0
    assert main(["inspect", str(dst)]) == 0
    assert "int8 weights" in capsys.readouterr().out
