"""The onnxruntime backend (EngineConfig.backend = "onnxruntime") behind the engine: the same scheduler,
paged cache, sampling and outputs as the torch backend, the forward pass run by an exported graph. Proven
against the torch backend on every bundled demo and an imported Mixtral (greedy tokens equal, log-probs
within 1e-4, classifier probabilities), and on its own: a request alone equals it in a mixed-k batch, with
chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from moe_serve import LLM, SamplingParams
from moe_serve.artifact import Artifact
from moe_serve.config import EngineConfig
from moe_serve.engine.onnx_backend import ExportedModel
from moe_serve.errors import ArtifactError, ValidationError
from moe_serve.registry import resolve_model
from tests.exporters.test_onnx import _hf_artifact
from tests.routing_checks import spy_preemptions

pytest.importorskip("onnxruntime")

from moe_serve.exporters.onnx import export_onnx  # noqa: E402
from moe_serve.exporters.onnx.cache import cache_dir, cached_export, load_servable, servable  # noqa: E402

pytestmark = pytest.mark.slow  # each model is exported once (seconds)

ATOL = 1e-4
PROMPTS = [
    "ROMEO.\nBut soft, what light through yonder window breaks?",
    "JULIET.\n",
    "HAMLET.\nTo be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
    "arrows of outrageous fortune, or to take arms against a sea of troubles",
    "O",
]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    return _hf_artifact("mixtral", tmp_path_factory.mktemp("mixtral"))


def _source(name: str, mixtral: Path) -> Path:
    return mixtral if name == "mixtral" else resolve_model(name)


def _ks(llm: LLM, count: int) -> list[int | None]:
    moe = llm.config.moe
    if moe is None:
        return [None] * count
    return [moe.min_k + i % (moe.max_k - moe.min_k + 1) for i in range(count)]


def _generate(llm: LLM, prompts: list[str], ks: list[int | None], max_tokens: int = 16):
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=2, ignore_eos=True, experts_per_token=k)
        for k in ks
    ]
    return [out.outputs[0] for out in llm.generate(prompts, params)]


def _assert_same(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["shakespeare-smoe", "shakespeare-hyperrouter", "shakespeare-dense", "mixtral"])
def test_generation_and_scores_equal_the_torch_backend_in_one_mixed_k_batch(name: str, mixtral: Path) -> None:
    source = _source(name, mixtral)
    torch_llm = LLM(source)
    # A small step budget: the long prompt is prefilled in chunks that share steps with decodes.
    onnx_llm = LLM(cached_export(source), EngineConfig(backend="onnxruntime", max_num_batched_tokens=32))
    assert isinstance(onnx_llm.artifact, ExportedModel)  # the graph, no torch model
    prompts = PROMPTS if name != "mixtral" else [[1 + (7 * i + j) % 90 for j in range(5 + 9 * i)] for i in range(4)]
    ks = _ks(torch_llm, 8)
    _assert_same(_generate(onnx_llm, prompts * 2, ks), _generate(torch_llm, prompts * 2, ks))
    if name != "mixtral":
        for k in ks[:4]:
            want, got = torch_llm.score(PROMPTS[:3], k), onnx_llm.score(PROMPTS[:3], k)
            for a, b in zip(got, want, strict=True):
                assert a.num_tokens == b.num_tokens and a.experts == b.experts
                assert a.total_logprob == pytest.approx(b.total_logprob, abs=ATOL * a.num_tokens)


@pytest.mark.parametrize("name", ["genre-topk", "genre-smear", "genre-moesart"])
def test_classifier_probabilities_equal_the_torch_backend(name: str) -> None:
    torch_llm, onnx_llm = LLM(name), LLM(cached_export(name), backend="onnxruntime")
    texts = ["Exit, pursued by a bear.", "Now is the winter of our discontent", "A kingdom for a horse!", "Ay"]
    ks = _ks(torch_llm, len(texts))
    for got, want in zip(onnx_llm.classify(texts, ks), torch_llm.classify(texts, ks), strict=True):
        assert got.label == want.label and got.experts_per_token == want.experts_per_token
        assert got.probs.keys() == want.probs.keys()
        torch.testing.assert_close(
            torch.tensor(list(got.probs.values())), torch.tensor(list(want.probs.values())), atol=1e-5, rtol=0
        )


@pytest.fixture(scope="module")
def onnx_smoe() -> LLM:
    return LLM(cached_export("shakespeare-smoe"), EngineConfig(backend="onnxruntime", max_num_batched_tokens=48))


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_a_request_alone_equals_it_in_a_mixed_k_batch(onnx_smoe: LLM, k: int) -> None:
    alone = _generate(onnx_smoe, [PROMPTS[2]], [k], max_tokens=24)
    others = [1 + (i * 3 + k) % 8 for i in range(8)]
    prompts = PROMPTS + PROMPTS[:2] + [PROMPTS[2]] + PROMPTS[2:]  # the target 7th of 9, others mid-prefill
    batch = _generate(onnx_smoe, prompts, [*others[:6], k, *others[6:]], max_tokens=24)
    # Padding and run shapes differ with the batch, and onnxruntime's kernels are not batch-invariant bitwise
    # (the torch backend's are): equal tokens, log-probs within 1e-5.
    assert batch[6].token_ids == alone[0].token_ids
    torch.testing.assert_close(torch.tensor(batch[6].logprobs), torch.tensor(alone[0].logprobs), atol=1e-5, rtol=0)


def test_prefix_cache_hits_and_preemption_keep_results() -> None:
    prompt = PROMPTS[0]
    roomy = LLM(cached_export("shakespeare-smoe"), backend="onnxruntime")
    want = _generate(roomy, [prompt], [2], max_tokens=24)
    hits = roomy.engine.blocks.stats.hit_tokens
    again = _generate(roomy, [prompt], [2], max_tokens=24)  # its prompt's full blocks come from the cache
    assert roomy.engine.blocks.stats.hit_tokens > hits
    _assert_same(again, want)
    # 12 blocks of 16 tokens for 6 sequences of ~80 tokens: sequences are preempted, then recomputed.
    tight = LLM(
        cached_export("shakespeare-smoe"), backend="onnxruntime", kv_cache_tokens=192, enable_prefix_caching=False
    )
    preempted = spy_preemptions(tight)
    outs = _generate(tight, [prompt] * 6, [2] * 6, max_tokens=24)
    assert preempted
    for out in outs:
        _assert_same([out], want)


def test_what_the_graph_cannot_run_is_refused_naming_the_field(onnx_smoe: LLM) -> None:
    with pytest.raises(ValidationError, match="torch backend only") as info:
        onnx_smoe.generate(["x"], SamplingParams(max_tokens=2, moe={"policy": "top_p", "p": 0.5}))
    assert info.value.parameter == "moe"
    with pytest.raises(ValidationError) as info:
        onnx_smoe.generate(["x"], SamplingParams(max_tokens=2, experts_per_token=9))
    assert info.value.parameter == "experts_per_token"
    with pytest.raises(ValidationError, match="fp32") as info:
        LLM(cached_export("shakespeare-smoe"), backend="onnxruntime", dtype="bfloat16")
    assert info.value.parameter == "dtype"
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        with pytest.raises(ValidationError, match="onnxruntime-gpu") as info:
            LLM(cached_export("shakespeare-smoe"), backend="onnxruntime", device="cuda")
        assert info.value.parameter == "device"
    with pytest.raises(ValidationError, match="backend must be one of torch, onnxruntime"):
        EngineConfig(backend="tensorrt")


def test_an_artifact_is_exported_once_and_an_export_directory_is_served_as_is(tmp_path: Path, monkeypatch) -> None:
    config = EngineConfig(backend="onnxruntime")
    first = Path(servable("genre-topk", config))  # exported into the cache (if no earlier test did)
    assert first.parent.parent == cache_dir() and first.name == "genre-topk"  # served under its own name
    stamp = os.stat(first / "model.onnx").st_mtime_ns

    def no_export(*args, **kwargs):
        raise AssertionError("exported again")

    monkeypatch.setattr("moe_serve.exporters.onnx.export.export_onnx", no_export)
    assert Path(servable("genre-topk", config)) == first and os.stat(first / "model.onnx").st_mtime_ns == stamp
    assert servable("genre-topk", EngineConfig()) == "genre-topk"  # torch: the artifact itself
    loaded = load_servable("genre-topk", config)  # what the front ends call: the cached export, opened
    assert isinstance(loaded, ExportedModel) and loaded.path == first
    assert isinstance(load_servable("genre-topk", EngineConfig()), Artifact)
    monkeypatch.undo()
    llm = LLM(first, config)
    assert llm.engine.inputs.name == "genre-topk" and llm.artifact.quality is not None  # the demo's table

    exported = export_onnx("shakespeare-dense", tmp_path / "dense-onnx").path
    llm = LLM(exported, backend="onnxruntime")
    assert llm.engine.inputs.name == "dense-onnx"
    want = _generate(LLM("shakespeare-dense"), PROMPTS[:2], [None] * 2)
    _assert_same(_generate(llm, PROMPTS[:2], [None] * 2), want)
    # The runtime opens exports only (it never imports an exporter): an artifact is refused, naming the way.
    with pytest.raises(ArtifactError, match="is not an ONNX export.*cached_export"):
        LLM("shakespeare-dense", backend="onnxruntime")


@pytest.mark.parametrize("name", ["shakespeare-smoe", "genre-smear", "genre-moesart"])
def test_the_graph_counts_the_same_expert_load_as_the_torch_model(name: str) -> None:
    """expert_counts (token routers, and soft_merge's one decision per row counted for each of its tokens)."""
    loads = []
    for backend in ("torch", "onnxruntime"):
        llm = LLM(cached_export(name) if backend == "onnxruntime" else name, backend=backend)
        llm.engine.runner.track_expert_load()
        ks = _ks(llm, 4)
        if llm.config.is_causal:
            _generate(llm, PROMPTS, ks, max_tokens=8)
        else:
            llm.classify([p[:40] for p in PROMPTS], ks)
        loads.append(llm.engine.runner.read_expert_load())
        assert not any(any(counts) for counts in llm.engine.runner.read_expert_load().values())  # reset
    assert loads[0] == loads[1] and sum(map(sum, loads[0].values())) > 0
