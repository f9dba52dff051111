"""A new router kind is one module plus its test. This file is both: it registers a throwaway kind with its
own setting, its own weighting (one the kernels do not have) and its own reference, and serves it through
moe-serve (config.json, the MoE block against the slow reference, the offline engine, the ONNX export)
without any other file knowing the kind."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moe_serve import LLM, SamplingParams
from moe_serve.config_schema import check_float
from moe_serve.errors import ConfigError, ValidationError
from moe_serve.kernels import ops
from moe_serve.kernels.vocabulary import Weighting
from moe_serve.layers.routers import Router, RouterConfig, RouterState, register, router_config, unregister
from moe_serve.model_config import ExpertsPerToken, ModelConfig
from moe_serve.moe_policy import MoEPolicy
from moe_serve.testing import create_random_artifact
from tests.conftest import lm_config, moe_config
from tests.unit.layers.test_moe_layer import EXPERTS, N, batch, make_block, run

KIND = "test_leader_share"


# ---- the kind's module --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class LeaderShareConfig(RouterConfig):
    share: float = 0.5  # the top expert's weight when k > 1; the others split the rest evenly

    def __post_init__(self) -> None:
        RouterConfig.__post_init__(self)
        check_float("router share", self.share, 0.0, 1.0, low_open=True)


class LeaderShare(Router):
    """Top-k by logit; the top expert weighs `share` (1 at k = 1), the other k - 1 share 1 - share evenly."""

    Config = LeaderShareConfig
    onnx_graph = True  # reads only its logits, in plain torch ops

    def __init__(self, config: RouterConfig, num_experts: int) -> None:
        super().__init__(config, num_experts)
        assert isinstance(config, LeaderShareConfig)
        self.share = config.share

    def route(
        self, logits: torch.Tensor, token_k: torch.Tensor, max_k: int, state: RouterState | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ids, _ = ops.topk_route(logits, token_k, max_k, Weighting.UNIFORM)
        k = token_k.float()[:, None]  # [R, 1]
        first = torch.where(k > 1, torch.full_like(k, self.share), torch.ones_like(k))
        rest = (1 - self.share) / (k - 1).clamp(min=1)
        slot = torch.arange(max_k, device=logits.device)[None, :]
        weights = torch.where(slot == 0, first, rest) * (ids >= 0)
        return ids, weights

    def reference_weights(self, logits: list[float], chosen: list[int]) -> list[float]:
        k = len(chosen)
        return [1.0] if k == 1 else [self.share] + [(1 - self.share) / (k - 1)] * (k - 1)


# ---- its test -----------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def leader_share() -> Iterator[None]:
    register(KIND)(LeaderShare)
    yield
    unregister(KIND)


def _lm(share: float = 0.7) -> ModelConfig:
    moe = moe_config(
        router=router_config(KIND, share=share, use_bias=True),
        layers=(0, 1),
        experts_per_token=ExpertsPerToken(default=2),
    )
    return lm_config(moe=moe)


def test_its_setting_is_parsed_validated_and_written_by_the_kind() -> None:
    config = _lm(share=0.7)
    data = config.to_dict()
    assert data["moe"]["router"] == {"kind": KIND, "use_bias": True, "share": 0.7}
    assert ModelConfig.from_dict(data) == config
    assert isinstance(ModelConfig.from_dict(data).moe.router, LeaderShareConfig)
    bad = {**data, "moe": {**data["moe"], "router": {**data["moe"]["router"], "share": 0.0}}}
    with pytest.raises(ConfigError, match=r"router share must be in \(0, 1\]"):
        ModelConfig.from_dict(bad)
    wrong_type = {**data, "moe": {**data["moe"], "router": {**data["moe"]["router"], "share": "half"}}}
    with pytest.raises(ConfigError, match="model.moe.router.share must be a number"):
        ModelConfig.from_dict(wrong_type)
    with pytest.raises(ConfigError, match=f"router kind {KIND} has no setting tau"):
        router_config(KIND, tau=2.0)


def test_the_block_matches_the_kinds_reference_at_every_k_and_mixed() -> None:
    from tests.reference_moe import reference_moe

    block = make_block(router_config(KIND, share=0.6), EXPERTS["glu_silu"], seed=5)
    x, mask = batch(seed=6)
    for ks in [[k] * x.shape[0] for k in range(1, N + 1)] + [[1, N, 3, 2]]:
        torch.testing.assert_close(run(block, x, mask, ks) * mask[..., None], reference_moe(block, x, mask, ks))


def test_it_serves_with_k_per_request(tmp_path: Path) -> None:
    llm = LLM(create_random_artifact(tmp_path / "a", _lm(), seed=3))
    prompt = [5, 9, 14, 2, 77]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, experts_per_token=k) for k in (1, 2, 4)]
    together = llm.generate([prompt] * 3, params)
    alone = [llm.generate([prompt], p)[0] for p in params]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert [o.experts_per_token for o in together] == [1, 2, 4]
    with pytest.raises(ValidationError, match=f"moe.policy top_p is not defined for router kind {KIND}"):
        llm.generate([prompt], SamplingParams(max_tokens=1, moe=MoEPolicy(p=0.5)))


@pytest.mark.slow
def test_it_exports_to_onnx_and_matches_the_engine(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    from moe_serve.exporters.onnx import export_onnx

    result = export_onnx(create_random_artifact(tmp_path / "a", _lm(), seed=4), tmp_path / "onnx")
    assert result.max_abs_diff is not None and result.max_abs_diff <= 1e-4
