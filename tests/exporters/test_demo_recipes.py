"""The demo recipes' own claims: the router diagnostics measure what they say, HyperRouter's embedding
rate equalises router steps with SMoE's, a run's initial weights are rebuilt from its seed, and the
multi-seed summary picks and states the best seed."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from moe_serve.quality import QualityRow, QualityTable
from moe_serve.registry import resolve_model
from recipes import build_demos, diagnostics, train
from recipes.transformer_xl import HyperRouterGate, MemTransformerLM, TXLConfig

# fmt: off
TINY = dict(d_model=32, n_head=2, d_head=16, n_layer=2, num_experts=4, d_expert=16, d_inner=32, moe_index=(0, 1),
            hyper_size=48, top_k_min=2, top_k_max=4, dropout=0.0)
# fmt: on
DATA = torch.randint(0, 256, (2048,), generator=torch.Generator().manual_seed(0))


def tiny(method: str, seed: int = 0) -> MemTransformerLM:
    torch.manual_seed(seed)
    model = MemTransformerLM(TXLConfig(method=method, **TINY)).eval()
    with torch.no_grad():  # experts far apart, so that which ones a token gets changes the output
        for ff in diagnostics.moe_layers(model):
            ff.experts.htoh4.weight.mul_(30)
            ff.experts.h4toh.weight.mul_(30)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("method", ["smoe", "hyperrouter", "similarity", "hypermoe"])
def test_untrained_router_swaps_to_zero_and_a_moved_router_does_not(method: str) -> None:
    initial = tiny(method)
    model = copy.deepcopy(initial)
    same = diagnostics.router_diagnostics(model, initial, DATA, 32, [1, 2])
    assert all(cell["delta"] == 0 for cell in same["swap_to_init_bits_per_byte"].values())
    assert all(layer["relative_change"] == 0 and layer["cosine_to_init"] == 1 for layer in same["movement"])
    with torch.no_grad():  # a router that moved: its gate (e for HyperRouter) pushed far from init
        for ff in diagnostics.moe_layers(model):
            for p in ff.gate.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 5)
    moved = diagnostics.router_diagnostics(model, initial, DATA, 32, [1, 2])
    assert all(layer["relative_change"] > 0.5 for layer in moved["movement"])
    assert any(abs(cell["delta"]) > 1e-3 for cell in moved["swap_to_init_bits_per_byte"].values())
    # the swap is undone: the trained figure is the model's own, before and after
    assert moved["swap_to_init_bits_per_byte"]["1"]["trained"] == pytest.approx(
        diagnostics.router_diagnostics(model, initial, DATA, 32, [1])["swap_to_init_bits_per_byte"]["1"]["trained"]
    )


def test_entropy_is_that_of_the_routing_distribution() -> None:
    model = tiny("smoe")
    with torch.no_grad():
        for ff in diagnostics.moe_layers(model):
            ff.gate.gate.weight.zero_()
            ff.gate.gate.bias.zero_()
    uniform = diagnostics.routing_entropy(model, DATA, 32)
    assert uniform == pytest.approx([math.log(4)] * 2, abs=1e-4)
    with torch.no_grad():  # one expert's bias far above the rest: near-certain routing
        for ff in diagnostics.moe_layers(model):
            ff.gate.gate.bias[2] = 30.0
    assert all(e < 1e-3 for e in diagnostics.routing_entropy(model, DATA, 32))


def test_hyperrouter_gain_is_the_routers_change_per_unit_step_of_e() -> None:
    gate = tiny("hyperrouter").layers[0].pos_ff.gate
    assert isinstance(gate, HyperRouterGate)
    gain = train.router_gain(gate)
    generator = torch.Generator().manual_seed(5)
    changes = []
    with torch.no_grad():
        for _ in range(16):
            sign = torch.randint(0, 2, gate.embedding.shape, generator=generator).float() * 2 - 1
            eps = 1e-3  # the hypernetwork is piecewise linear: a small step stays on one piece
            weight, bias = gate.router(gate.embedding + eps * sign)
            w0, b0 = gate.router()
            changes.append(torch.cat([weight - w0, (bias - b0)[:, None]], 1).div(eps).pow(2).mean().item())
    assert gain == pytest.approx(math.sqrt(sum(changes) / len(changes)), rel=0.15)
    assert gain < 0.2  # the frozen hypernetwork shrinks router steps: why e gets its own rate
    optimizer, record = train.lm_optimizer(tiny("hyperrouter"), 1e-3)
    scales = [g.get("lr_scale", 1.0) for g in optimizer.param_groups]
    assert scales[0] == 1.0 and len(scales) == 3 and all(s > 5 for s in scales[1:])
    assert record["optimizer"] == "adam" and record["weight_decay"] == 0.0
    assert len(record["hyperrouter_embedding_lr_scale"]) == 2


def test_a_runs_initial_weights_are_rebuilt_from_its_seed(tmp_path: Path) -> None:
    """recipes.train seeds torch and builds the model first: diagnostics.rebuild relies on it."""
    torch.manual_seed(7)
    model = MemTransformerLM(train.lm_config("smoe"))  # what train_lm builds first under seed 7
    start = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    train.save_checkpoint(tmp_path, model, {"seed": 7, "model": model.cfg.to_dict(), "method": "smoe"})
    trained, initial = diagnostics.rebuild(tmp_path, json.loads((tmp_path / "training_config.json").read_text()))
    for name, tensor in initial.state_dict().items():
        torch.testing.assert_close(tensor, start[name], atol=0, rtol=0, msg=name)
    torch.testing.assert_close(trained.state_dict()["r_w_bias"], start["r_w_bias"] + 1.0)


def rows(values: dict[int, float], metric: str = "bits_per_byte", model: str | None = None) -> list[QualityRow]:
    return [QualityRow("shakespeare", k, metric, v, model) for k, v in values.items()]


def test_seed_summary_and_best_seed() -> None:
    per_seed = {0: rows({1: 3.0, 2: 2.8}), 1: rows({1: 2.9, 2: 2.7}), 2: rows({1: 3.1, 2: 2.6})}
    assert build_demos.best_seed(per_seed, "causal_lm") == 1  # lowest mean over k (2.80 vs 2.90, 2.85)
    summary = build_demos.seed_summary("smoe-lm", per_seed, 1, "causal_lm", "settings")
    first = summary["quality"][0]
    assert (first["k"], first["metric"], first["mean"]) == (1, "bits_per_byte", 3.0)
    assert first["std"] == pytest.approx(0.1) and first["values"] == {"0": 3.0, "1": 2.9, "2": 3.1}
    assert summary["bundled_seed"] == 1 and "lowest mean bits_per_byte" in summary["chosen_by"]
    accuracy = {0: rows({1: 0.5}, "accuracy"), 1: rows({1: 0.7}, "accuracy")}
    assert build_demos.best_seed(accuracy, "sequence_classification") == 1
    assert build_demos.seed_summary("x", {0: rows({1: 1.0})}, 0, "causal_lm", "s")["quality"][0]["std"] is None


def test_seeds_of_an_earlier_build_count_when_their_runs_are_gone(tmp_path: Path, monkeypatch) -> None:
    """Seeds trained in an earlier sitting (recorded in the bundled demo's provenance) join the summary under
    the same recipe settings; the bundled demo, still the best seed, keeps its weights and gains the summary."""
    record = {"recipe": "smoe-lm", "method": "smoe", "steps": 1500, "seed": 1, "command": "python -m ..."}
    settings = build_demos.settings_sha256(record)
    assert settings == build_demos.settings_sha256({**record, "seed": 2, "metrics": {"x": 1}})
    assert settings != build_demos.settings_sha256({**record, "steps": 3000})
    earlier = {0: rows({1: 2.8, 2: 2.7}), 1: rows({1: 2.9, 2: 2.8}), 2: rows({1: 3.0, 2: 2.9})}
    bundled = tmp_path / "demo_models" / "shakespeare-smoe"
    bundled.mkdir(parents=True)
    provenance = {"seed": 0, "seeds": build_demos.seed_summary("smoe-lm", earlier, 0, "causal_lm", settings)}
    (bundled / "config.json").write_text(json.dumps({"provenance": provenance}))
    QualityTable(tuple(earlier[0])).write(bundled / "quality.json")
    run = tmp_path / "runs" / "smoe-lm" / "seed-1"
    run.mkdir(parents=True)
    (run / "checkpoint.safetensors").write_bytes(b"")
    (run / "training_config.json").write_text(json.dumps(record))
    (run / "artifact").mkdir()  # what evaluate_run exported: an SMoE trained at k = 4..8
    shutil.copy(resolve_model("shakespeare-smoe") / "config.json", run / "artifact" / "config.json")
    monkeypatch.setattr(build_demos, "BUNDLED_DIR", tmp_path / "demo_models")
    monkeypatch.setattr(build_demos, "evaluate_run", lambda *_: rows({1: 2.9, 2: 2.8}))  # seed 1, as recorded

    def no_export(*_):
        raise AssertionError("the bundled demo is the best seed already: nothing to export")

    monkeypatch.setattr(build_demos, "export", no_export)
    out = build_demos.bundle("shakespeare-smoe", "smoe-lm", "smoe", tmp_path / "runs", [0, 1, 2], None)
    assert [r.value for r in out] == [2.8, 2.7]
    seeds = json.loads((bundled / "config.json").read_text())["provenance"]["seeds"]
    assert seeds["seeds"] == [0, 1, 2] and seeds["bundled_seed"] == 0 and seeds["trained_k"] == [4, 5, 6, 7, 8]
    assert seeds["quality"][0]["values"] == {"0": 2.8, "1": 2.9, "2": 3.0}

    assert build_demos.earlier_seeds("shakespeare-smoe", settings, {1: rows({1: 2.9, 2: 2.8})}, [0, 1]) == {
        0: rows({1: 2.8, 2: 2.7}, model="shakespeare-smoe")
    }  # seeds outside the build's range are left out
    assert build_demos.earlier_seeds("shakespeare-smoe", "other settings", {}, [0, 1, 2]) == {}
    # a seed that measures differently now: the code changed, so none of the earlier figures count
    assert build_demos.earlier_seeds("shakespeare-smoe", settings, {1: rows({1: 2.95, 2: 2.8})}, [0, 1, 2]) == {}

    # no run of the recipe here at all: a demo whose provenance records every seed asked for stays as it is
    (run / "checkpoint.safetensors").unlink()
    kept = build_demos.bundle("shakespeare-smoe", "smoe-lm", "smoe", tmp_path / "runs", [0, 1, 2], None)
    assert [r.value for r in kept] == [2.8, 2.7]
    with pytest.raises(SystemExit, match="no trained run of smoe-lm"):
        build_demos.bundle("shakespeare-smoe", "smoe-lm", "smoe", tmp_path / "runs", [0, 1, 2, 3], None)
