"""ONNX export (`moe-serve export-onnx`) proven against the torch engine with onnxruntime (CPU): logits
within 1e-4 at every k and in one mixed-k batch, 32 greedy tokens with the KV cache, classifier
probabilities; the k range enforced; models the graph cannot express refused, naming the feature."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_serve import LLM, SamplingParams
from moe_serve.errors import ValidationError
from moe_serve.exporters.base import ExportError, ExportOptions
from moe_serve.layers.routers import RouterConfig, router_config
from moe_serve.model_config import ClassifierConfig, ExpertsPerToken, FFNConfig
from moe_serve.registry import resolve_model
from moe_serve.testing import create_random_artifact
from tests.conftest import NUM_EXPERTS, classifier_config, lm_config, moe_config

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from moe_serve.exporters.onnx import export_onnx  # noqa: E402  (needs onnx)
from moe_serve.onnx_model import OnnxModel  # noqa: E402

pytestmark = pytest.mark.slow  # every test exports a graph (seconds each)

ATOL = 1e-4


def _tiny_lm(router: RouterConfig, **overrides):
    """The baby LM of tests/conftest.py with MoE in both layers and k from 1 to 4."""
    moe = moe_config(router=router, layers=(0, 1), experts_per_token=ExpertsPerToken(default=2))
    return lm_config(moe=moe, **overrides)


def _hypermoe_lm(k: int):
    """HyperMoE at its trained k: one adapter per selected set (C(4, 2) = 6 at k = 2)."""
    moe = moe_config(
        router=router_config("hyper_expert", normalize=False),
        layers=(0, 1),
        experts_per_token=ExpertsPerToken(default=k, min=k, max=k),
        hyper_expert=FFNConfig("adapter", 8, "relu", use_bias=True),
    )
    return lm_config(moe=moe)


def _hf_artifact(name: str, root: Path) -> Path:
    from moe_serve.exporters.hf import export_hf
    from tests.exporters.hf_models import save_hf_model

    return export_hf(save_hf_model(name, root / f"{name}-hf"), root / f"{name}-artifact", ExportOptions(progress=False))


# name -> how to get the artifact (a bundled name, or a function of a scratch directory)
LM_MODELS = {
    "topk-softmax": lambda root: create_random_artifact(root / "a", _tiny_lm(router_config("topk_softmax")), seed=1),
    "topk-softmax-all": lambda root: create_random_artifact(
        root / "a", _tiny_lm(router_config("topk_softmax", normalize=False)), seed=2
    ),
    "topk-uniform": lambda root: create_random_artifact(root / "a", _tiny_lm(router_config("topk_uniform")), seed=3),
    "hyper-expert-k2": lambda root: create_random_artifact(root / "a", _hypermoe_lm(2), seed=6),  # HyperMoE
    "mixtral": lambda root: _hf_artifact("mixtral", root),  # imported: GQA, SwiGLU experts, RMSNorm
    "qwen2-moe": lambda root: _hf_artifact("qwen2_moe", root),  # unnormalised, gated shared expert, a dense layer
    "qwen3-moe": lambda root: _hf_artifact("qwen3_moe", root),  # per-head q/k norm, YaRN rotary
    "olmoe": lambda root: _hf_artifact("olmoe", root),  # q/k norm over all heads, clip_qkv
    # sparsemixer routing, LayerNorm with bias, q/k/v/o and LM-head biases, longrope rotary
    "phimoe": lambda root: _hf_artifact("phimoe", root),
    # embedding, residual and attention scales, a logit divisor; and with an ungated shared expert
    "granitemoe": lambda root: _hf_artifact("granitemoe", root),
    "granitemoeshared": lambda root: _hf_artifact("granitemoeshared", root),
    "shakespeare-hyperrouter": "shakespeare-hyperrouter",  # Transformer-XL relative positions, post-norm
    "shakespeare-dense": "shakespeare-dense",  # no MoE layer
}
CLASSIFIERS = {
    "genre-topk": "genre-topk",
    "genre-smear": "genre-smear",  # soft_merge
    "genre-switch": "genre-switch",  # example_topk
    "genre-moesart": "genre-moesart",  # topk_uniform
    "tiny-first-pooler": lambda root: create_random_artifact(
        root / "a",
        classifier_config(
            classifier=ClassifierConfig(labels=("a", "b", "c"), pooling="first", pooler_dense=True),
            moe=moe_config(expert=FFNConfig("mlp", 24, "gelu_tanh", use_bias=True)),
        ),
        seed=4,
    ),
    "tiny-last-relative": lambda root: create_random_artifact(
        root / "a",
        classifier_config(
            classifier=ClassifierConfig(labels=("a", "b"), pooling="last"), position="relative", norm_position="post"
        ),
        seed=5,
    ),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (artifact directory, ONNX directory), exported once per module."""
    cache: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            source = {**LM_MODELS, **CLASSIFIERS}[name]
            artifact = resolve_model(source) if isinstance(source, str) else source(root)
            result = export_onnx(artifact, root / "onnx")
            assert result.max_abs_diff is not None and result.max_abs_diff <= ATOL
            cache[name] = (artifact, result.path)
        return cache[name]

    return get


def _k_range(llm: LLM) -> list[int]:
    moe = llm.config.moe
    return list(range(moe.min_k, moe.max_k + 1)) if moe is not None else [None]


def _prompts(vocab: int, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, min(vocab, 256), (n,), generator=generator).tolist() for n in lengths]


def _engine_logits(llm: LLM, prompts: list[list[int]], ks: list[int | None]) -> list[np.ndarray]:
    with torch.inference_mode():
        hidden, lens = llm.engine.runner.forward_sequences(prompts, [k or 1 for k in ks])
        logits = llm.artifact.model.lm_logits(hidden)
    return [part.numpy() for part in logits.split(lens)]


def _onnx_logits(runner: OnnxModel, prompts: list[list[int]], ks: list[int | None]) -> list[np.ndarray]:
    """One left-padded batch, no past (prefill)."""
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    logits, _ = runner.lm_step(ids, mask, runner.experts_per_token(ks, len(prompts)))
    return [logits[row, width - len(p) :] for row, p in enumerate(prompts)]


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", list(LM_MODELS))
def test_lm_logits_match_the_engine_at_every_k_and_in_a_mixed_k_batch(exported, name: str) -> None:
    artifact, graph = exported(name)
    llm, runner = LLM(artifact), OnnxModel(graph)
    prompts = _prompts(llm.config.vocab_size, (7, 12), seed=1)
    for k in _k_range(llm):
        diff = _max_diff(_onnx_logits(runner, prompts, [k, k]), _engine_logits(llm, prompts, [k, k]))
        assert diff <= ATOL, f"k={k}: {diff}"
    ks = _k_range(llm)
    mixed = [ks[0], ks[-1], ks[len(ks) // 2], ks[0]]
    prompts = _prompts(llm.config.vocab_size, (5, 17, 9, 30), seed=2)
    assert _max_diff(_onnx_logits(runner, prompts, mixed), _engine_logits(llm, prompts, mixed)) <= ATOL


@pytest.mark.parametrize("name", list(LM_MODELS))
def test_32_greedy_tokens_with_the_kv_cache_equal_the_engine(exported, name: str) -> None:
    artifact, graph = exported(name)
    llm, runner = LLM(artifact), OnnxModel(graph)
    ks = _k_range(llm)
    ks = [ks[0], ks[-1]]  # one batch of two rows with different k (and different prompt lengths)
    prompts = _prompts(llm.config.vocab_size, (6, 11), seed=3)
    params = [SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, experts_per_token=k) for k in ks]
    expected = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert runner.generate_greedy(prompts, 32, ks) == expected


@pytest.mark.parametrize("name", list(CLASSIFIERS))
def test_classifier_probabilities_equal_the_engine(exported, name: str) -> None:
    artifact, graph = exported(name)
    llm, runner = LLM(artifact), OnnxModel(graph)
    texts = ["Now is the winter of our discontent", "Alas, poor Yorick!", "To be, or not to be, that is the question"]
    tokens = [llm.tokenizer.encode(t) for t in texts]
    labels = list(llm.config.classifier.labels)
    for k in _k_range(llm):
        want = [[out.probs[label] for label in labels] for out in llm.classify(texts, k)]
        np.testing.assert_allclose(runner.classify(tokens, k), want, atol=ATOL, rtol=0, err_msg=f"k={k}")
    ks = _k_range(llm)
    mixed = [ks[-1], ks[0], ks[len(ks) // 2]]
    want = [[out.probs[label] for label in labels] for out in llm.classify(texts, mixed)]
    np.testing.assert_allclose(runner.classify(tokens, mixed), want, atol=ATOL, rtol=0)


def test_metadata_carries_the_k_range_labels_and_tokenizer(exported) -> None:
    artifact, graph = exported("genre-smear")
    llm = LLM(artifact)
    proto = onnx.load(str(graph / "model.onnx"))
    props = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(props["moe_serve.experts_per_token"]) == {"default": 8, "min": 1, "max": 8}
    assert json.loads(props["moe_serve.labels"]) == list(llm.config.classifier.labels)
    assert props["moe_serve.task"] == "sequence_classification" and props["moe_serve.router"] == "soft_merge"
    runner = OnnxModel(graph)
    assert runner.tokenizer.encode("Ay, madam, it is common.") == llm.tokenizer.encode("Ay, madam, it is common.")
    assert runner.config == llm.config
    onnx.checker.check_model(str(graph / "model.onnx"), full_check=True)
    assert sorted(p.name for p in graph.iterdir()) == ["model.onnx"]


def test_k_out_of_range_is_a_clear_error(exported) -> None:
    runner = OnnxModel(exported("topk-softmax")[1])
    for bad in (0, NUM_EXPERTS + 1):
        with pytest.raises(ValidationError, match=f"experts_per_token must be between 1 and 4, got {bad}"):
            runner.generate_greedy([[1, 2, 3]], 4, bad)
    with pytest.raises(ValidationError, match="experts_per_token has 1 entries for 2 rows"):
        runner.experts_per_token([2], 2)
    dense = OnnxModel(exported("shakespeare-dense")[1])
    with pytest.raises(ValidationError, match="has no MoE layers"):
        dense.generate_greedy([[1, 2]], 2, 2)
    with pytest.raises(ValidationError, match="exceed the model's context of 256 positions"):
        runner.generate_greedy([[1] * 250], 8)


def test_external_data_export_passes_the_full_check_and_matches(exported, tmp_path: Path) -> None:
    artifact, inline = exported("topk-softmax")
    result = export_onnx(artifact, tmp_path / "external", external_data=True)
    assert result.external_data and result.files == ("model.onnx", "model.onnx.data")
    assert (tmp_path / "external" / "model.onnx").stat().st_size < 1 << 20  # the graph only, no weights
    onnx.checker.check_model(str(result.path / "model.onnx"), full_check=True)
    prompts = _prompts(260, (9, 4), seed=5)
    external_logits = _onnx_logits(OnnxModel(result.path), prompts, [1, 3])
    assert _max_diff(external_logits, _onnx_logits(OnnxModel(inline), prompts, [1, 3])) == 0.0


@pytest.fixture
def unknown_router_kind():
    """A stateless router kind the graph does not know, registered for one test only."""
    from moe_serve import router_registry
    from moe_serve.layers.routers import base

    class Unsupported(base.Router):
        def route(self, logits, top_k, max_k, state=None):
            raise NotImplementedError

    router_registry.register("test_expert_choice")(Unsupported)
    yield
    del router_registry._REGISTRY["test_expert_choice"]


def test_models_the_graph_cannot_express_are_refused_naming_the_feature(unknown_router_kind, tmp_path: Path) -> None:
    from moe_serve.cli import main

    messages = {
        "similarity": "router kind 'similarity' keeps per-token routing state in the KV cache "
        r"\(graph-of-tokens routing",
        "test_expert_choice": "router kind 'test_expert_choice' has no ONNX graph; export-onnx expresses "
        "example_topk, hyper_expert, soft_merge, sparsemixer, topk_softmax, topk_uniform",
    }
    for kind, message in messages.items():
        artifact = create_random_artifact(tmp_path / kind, _tiny_lm(router_config(kind)))
        with pytest.raises(ExportError, match=message):
            export_onnx(artifact, tmp_path / f"{kind}-onnx")
        assert not (tmp_path / f"{kind}-onnx").exists()
        assert main(["export-onnx", str(artifact), str(tmp_path / f"{kind}-cli")]) == 2


def test_cli_export_onnx(tmp_path: Path, capsys) -> None:
    from moe_serve.cli import main

    dst = tmp_path / "genre-topk-onnx"
    assert main(["export-onnx", "genre-topk", str(dst), "--json"]) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    assert report["files"] == ["model.onnx"] and not report["external_data"] and report["max_abs_diff"] <= ATOL
    assert main(["export-onnx", "genre-topk", str(dst)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["export-onnx", "genre-topk", str(dst), "--overwrite", "--no-verify"]) == 0
    assert "max abs diff" not in capsys.readouterr().out


def test_an_encoder_config_with_no_moe_layers_is_exported(tmp_path: Path) -> None:
    config = dataclasses.replace(classifier_config(), moe=None)
    artifact = create_random_artifact(tmp_path / "dense", config)
    runner = OnnxModel(export_onnx(artifact, tmp_path / "onnx").path)
    want = [list(out.probs.values()) for out in LLM(artifact).classify(["hello there", "hi"])]
    np.testing.assert_allclose(runner.classify([list(b"hello there"), list(b"hi")]), want, atol=ATOL, rtol=0)


def test_cost_against_k_reports_every_k_and_a_mixed_batch(exported) -> None:
    from moe_serve.exporters.onnx.cost import measure

    results = measure(exported("topk-softmax")[1], rounds=1, prefill=(2, 8), decode=(3, 4))
    assert list(results) == ["1", "2", "3", "4", "mixed"]
    assert all(r["prefill_ms"] > 0 and r["decode_ms"] > 0 for r in results.values())


def test_a_graph_that_is_not_a_moe_serve_export_is_refused(tmp_path: Path) -> None:
    from onnx import TensorProto, helper

    from moe_serve.errors import ArtifactError

    x, y = (helper.make_tensor_value_info(name, TensorProto.FLOAT, [1]) for name in "xy")
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "model.onnx"))
    with pytest.raises(ArtifactError, match="is not a moe-serve ONNX export"):
        OnnxModel(tmp_path)
    with pytest.raises(ArtifactError, match="has no model.onnx"):
        OnnxModel(tmp_path / "missing")
