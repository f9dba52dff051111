"""evaluation.divergence: the KL of next-token distributions and the routers' top-k set agreement per MoE layer
between a reference model and candidates, on the same texts at a given k."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_serve import LLM
from moe_serve.evaluation.divergence import divergence_from_reference
from moe_serve.layers.moe import MoEBlock
from moe_serve.testing import create_random_artifact
from tests.conftest import lm_config, moe_config

TEXTS = [[(7 * i + j) % 200 + 1 for j in range(40)] for i in range(5)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = lm_config(num_layers=3, moe=moe_config(layers=(0, 1, 2)))
    return create_random_artifact(tmp_path_factory.mktemp("divergence") / "model", config, seed=11)


def _model(path: Path):  # noqa: ANN202
    return LLM(path).artifact.model


def test_a_model_agrees_with_itself_everywhere(model_path: Path) -> None:
    reference, same = _model(model_path), _model(model_path)
    found = divergence_from_reference(reference, {"same": same}, TEXTS, k=2)["same"]
    moe_layers = sum(isinstance(m, MoEBlock) for m in reference.modules())
    assert moe_layers > 1 and len(found.topk_agreement) == moe_layers
    assert found.kl == 0.0 and found.topk_agreement == [1.0] * moe_layers
    assert not any("_count" in vars(m) for m in reference.modules())  # the recording is undone


def test_a_changed_router_lowers_its_layers_agreement_only(model_path: Path) -> None:
    reference, changed = _model(model_path), _model(model_path)
    blocks = [m for m in changed.modules() if isinstance(m, MoEBlock)]
    with torch.no_grad():
        blocks[-1].router.weight.copy_(torch.randn_like(blocks[-1].router.weight))
    blocks[-1]._router = None  # the prepared copy of the router's weights (MoEBlock.prepare) is read again
    found = divergence_from_reference(reference, {"changed": changed}, TEXTS, k=2)["changed"]
    assert found.topk_agreement[:-1] == [1.0] * (len(blocks) - 1)  # earlier layers see the same inputs
    assert 0.0 <= found.topk_agreement[-1] < 0.9 and found.kl > 0
