"""--cpu-activations (EngineConfig.cpu_activations): fp32 is the exact mode; int8 (and auto) gives int8 and int4
weights int8 activations, bf16 (and int8 and auto) gives bf16 weights bf16 activations where the CPU has AVX-512
BF16 (fp32 elsewhere). Under rounded activations a request's tokens and log-probabilities are the same alone
and in a batch with other k, bitwise, and near the fp32-activation ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_serve import LLM, SamplingParams
from moe_serve.artifact import save_artifact
from moe_serve.config import EngineConfig
from moe_serve.errors import ValidationError
from moe_serve.kernels import has_bf16_dot
from moe_serve.kernels.packed import PackedWeight
from moe_serve.model_config import FFNConfig
from moe_serve.testing import random_state_dict
from moe_serve.tokenizer import Tokenizer, byte_level_tokenizer
from tests.conftest import lm_config, moe_config

pytestmark = pytest.mark.cpu_kernels

PROMPTS = ["To be, or not to be", "Exit, pursued by a bear", "O", "Now is the winter"]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = lm_config(hidden_size=64, moe=moe_config(expert=FFNConfig("glu", 64)))  # every K a multiple of 32
    path = tmp_path_factory.mktemp("cpu-activations") / "model"
    return save_artifact(path, config, random_state_dict(config, seed=3), Tokenizer(byte_level_tokenizer()))


def packed_weights(llm: LLM) -> dict[str, PackedWeight]:
    """Every packed weight a module holds, by module name (attention's fused projections included)."""
    model = llm.artifact.model
    return {
        f"{name}.{attr}": value
        for name, module in model.named_modules()
        for attr, value in vars(module).items()
        if isinstance(value, PackedWeight)
    }


BF16 = "bf16" if has_bf16_dot() else "fp32"  # what bf16 weights read where a mode allows bf16


@pytest.mark.parametrize(
    "weights, mode, reads",
    [
        ("int8", "int8", "int8"),
        ("int4", "int8", "int8"),
        ("int8", "bf16", "fp32"),
        ("int8", "fp32", "fp32"),
        ("bf16", "int8", BF16),
        ("bf16", "bf16", BF16),
        ("bf16", "fp32", "fp32"),
    ],
)
def test_the_mode_reaches_the_weights_it_names(artifact: Path, weights: str, mode: str, reads: str) -> None:
    llm = LLM(artifact, EngineConfig(weights=weights, cpu_activations=mode))
    found = packed_weights(llm)
    assert found and {w.activations for w in found.values()} == {reads}
    assert llm.artifact.weights_label == (f"{weights}:{mode}" if reads != "fp32" else weights)


@pytest.mark.parametrize("weights, reads", [("int8", "int8"), ("int4", "int8"), ("bf16", BF16)])
def test_auto_keeps_attention_in_fp32_activations(artifact: Path, weights: str, reads: str) -> None:
    llm = LLM(artifact, EngineConfig(weights=weights, cpu_activations="auto"))
    found = packed_weights(llm)
    attention = {name: w for name, w in found.items() if ".attn." in name}
    assert attention and all(w.activations == "fp32" for w in attention.values())
    assert all(w.activations == reads for name, w in found.items() if name not in attention)
    assert llm.artifact.weights_label == (f"{weights}:auto" if reads != "fp32" else weights)


def test_an_unknown_mode_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="cpu_activations must be one of fp32, bf16, int8, auto; got 'int4'"):
        EngineConfig(cpu_activations="int4")


def _generate(llm: LLM, ks: list[int]) -> list[tuple]:
    params = [SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, experts_per_token=k) for k in ks]
    outputs = llm.generate(PROMPTS[: len(ks)], params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


ROUNDED = ["int8", "int4", pytest.param("bf16", marks=pytest.mark.bf16_dot)]  # the formats with rounded activations


@pytest.mark.parametrize("weights", ROUNDED)
def test_rounded_activations_keep_each_request_the_same_in_a_mixed_k_batch(artifact: Path, weights: str) -> None:
    llm = LLM(artifact, EngineConfig(weights=weights, cpu_activations="int8"))
    ks = [1, 2, 4, 3]
    together = _generate(llm, ks)
    for i, k in enumerate(ks):
        params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, experts_per_token=k)
        alone = llm.generate([PROMPTS[i]], params)[0].outputs[0]
        assert (alone.token_ids, alone.logprobs) == together[i]


@pytest.mark.parametrize("weights", ROUNDED)
def test_rounded_activations_score_near_fp32_activations(artifact: Path, weights: str) -> None:
    texts = ["Now is the winter of our discontent", "Exit, pursued by a bear."]
    exact = LLM(artifact, EngineConfig(weights=weights)).score(texts, experts_per_token=2, return_token_logprobs=True)
    rounded = LLM(artifact, EngineConfig(weights=weights, cpu_activations="int8")).score(
        texts, experts_per_token=2, return_token_logprobs=True
    )
    # A rounded activation can flip a near-tied router choice (a random model has many): one token's log-probability
    # moved 0.18 here; on average they move a few thousandths.
    differences = [
        abs(a - b)
        for e, r in zip(exact, rounded, strict=True)
        for a, b in zip(e.token_logprobs, r.token_logprobs, strict=True)
    ]
    assert 0 < sum(differences) / len(differences) < 0.02 and max(differences) < 0.5


def test_quality_rows_name_the_activations_with_the_format() -> None:
    from moe_serve.errors import ArtifactError
    from moe_serve.quality import QualityTable

    row = {"dataset": "shakespeare", "k": 2, "metric": "bits_per_byte", "value": 2.4}
    table = QualityTable.parse(json.dumps({"results": [{**row, "weights": "int4:int8"}]}), "quality.json")
    assert table.rows[0].weights == "int4:int8" and table.rows[0].series.endswith("(int4:int8)")
    assert QualityTable.parse(json.dumps({"results": [{**row, "weights": "int8:auto"}]}), "q").rows[0].weights
    assert QualityTable.parse(json.dumps({"results": [{**row, "weights": "bf16:bf16"}]}), "q").rows[0].weights
    for bad in ("int8:bf16", "int8:int4", "int8:", "bf16:fp16"):
        with pytest.raises(ArtifactError, match=f"weights must be one of bf16, int8, int4, each optionally.*{bad!r}"):
            QualityTable.parse(json.dumps({"results": [{**row, "weights": bad}]}), "quality.json")
    with pytest.raises(ArtifactError, match="'int8:fp32'"):  # one spelling: int8
        QualityTable.parse(json.dumps({"results": [{**row, "weights": "int8:fp32"}]}), "quality.json")
