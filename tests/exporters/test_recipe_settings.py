"""The recipes' settings, proven on tiny configs: the graph-routing LMs at k = 2 of 8 and the controls
(smoe-top1-lm, hypermoe-lb-lm) train, export and fold exactly at every k; the plain-routing diagnostic
measures what the graph mixing adds; HyperMoE's load-balancing loss is the released Switch code's; the
training precision is recorded and splits the settings; an LM trained with BOS and EOS exports them for
the server, chat and lm-evaluation-harness; the seeds summary keeps every seed's wall time and
diagnostics, and `moe-serve eval --stored` prints the controls beside the demos."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from moe_serve import LLM, SamplingParams
from moe_serve.exporters import transformer_xl
from moe_serve.quality import QualityRow
from moe_serve.registry import resolve_model
from recipes import build_demos, diagnostics, play_chat, train
from recipes.transformer_xl import MemTransformerLM, TXLConfig, switch_router_losses

# fmt: off
# Eight experts, so that k = 1 and 2 take the sparse dispatch the recipes train with (k < N / 2).
TINY = dict(d_model=32, n_head=2, d_head=16, n_layer=2, num_experts=8, d_expert=16, d_inner=32, moe_index=(0, 1),
            hyper_size=48, experts_embedding_dim=12, hypernetwork_bottleneck=20, adapter_dim=6, dropout=0.0)
# fmt: on
NEW_RECIPES = {  # recipe -> export format
    "similarity-lm": "similarity",
    "attention-lm": "attention",
    "smoe-top1-lm": "smoe",
    "hypermoe-lb-lm": "hypermoe",
}
DATA = torch.randint(0, 256, (2048,), generator=torch.Generator().manual_seed(0))


def tiny_recipe(name: str) -> train.Recipe:
    """The recipe's own settings (k, router, losses) on the tiny backbone, a handful of short steps."""
    recipe = train.RECIPES[name]
    return dataclasses.replace(recipe, steps=4, batch_size=2, seq_len=24, model={**TINY, **recipe.model})


def train_tiny(name: str, out: Path, monkeypatch) -> dict:
    """recipes.train's command on the tiny recipe (fp32); -> its training record."""
    monkeypatch.setitem(train.RECIPES, name, tiny_recipe(name))
    monkeypatch.setattr(diagnostics, "EVAL_BYTES", 4096)
    argv = [name, "--steps", "4", "--threads", "1", "--precision", "fp32", "--out", str(out)]
    assert train.main(argv) == 0
    return json.loads((out / "training_config.json").read_text())


def logits_at(llm: LLM, tokens: torch.Tensor, k: int) -> torch.Tensor:
    with torch.inference_mode():
        hidden, _ = llm.engine.runner.forward_padded(tokens.tolist(), [k] * len(tokens))
        return llm.artifact.model.lm_logits(hidden)


def test_the_recipes_settings() -> None:
    """Graph routing at K = 2 of N = 8 from the first step; the controls at HyperMoE's budget (N, k = 1)."""
    for name in ("similarity-lm", "attention-lm"):
        cfg = train.lm_config(train.RECIPES[name].method, train.RECIPES[name].model)
        assert (cfg.top_k_min, cfg.top_k_max, cfg.num_experts) == (2, 2, 8)
    assert train.lm_config("similarity", train.RECIPES["similarity-lm"].model).graph_tau == pytest.approx(128 / 2)
    hypermoe = train.lm_config("hypermoe", train.RECIPES["hypermoe-lm"].model)
    top1 = train.lm_config("smoe", train.RECIPES["smoe-top1-lm"].model)
    assert (top1.top_k_min, top1.top_k_max, top1.switch_router) == (1, 1, True)
    assert (top1.num_experts, top1.d_expert) == (hypermoe.num_experts, hypermoe.d_expert)
    assert train.RECIPES["smoe-top1-lm"].steps == train.RECIPES["hypermoe-lm"].steps
    lb = train.RECIPES["hypermoe-lb-lm"]
    assert (lb.router_aux_loss_coef, lb.router_z_loss_coef) == (1e-3, 1e-3) and lb.model == train.RECIPES[
        "hypermoe-lm"
    ].model
    assert {"shakespeare-smoe-top1", "shakespeare-hypermoe-lb"} == set(build_demos.CONTROLS)
    assert not set(build_demos.CONTROLS) & set(build_demos.LANGUAGE_MODELS)  # no weights bundled
    assert {r for r, _, _ in build_demos.CONTROLS.values()} <= set(train.RECIPES)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(NEW_RECIPES))
def test_new_recipe_trains_exports_and_folds_at_every_k(tmp_path: Path, monkeypatch, name: str) -> None:
    record = train_tiny(name, tmp_path / "run", monkeypatch)
    assert record["precision"] == "fp32" and record["train_seconds"] > 0
    found = record["metrics"]["diagnostics"]
    assert found["trained_k"] == train.RECIPES[name].model["top_k_max"]
    if name in ("similarity-lm", "attention-lm"):  # the plain-routing delta, per k, for every graph recipe
        plain = found["plain_routing_bits_per_byte"]
        assert set(plain) == {"1", "2", "4", "8"} and set(found["plain_routing_choices_changed"]) == set(plain)
        assert all(cell["delta"] == pytest.approx(cell["plain"] - cell["trained"], abs=2e-4) for cell in plain.values())
    else:
        assert "plain_routing_bits_per_byte" not in found
    assert all(sum(layer) == pytest.approx(1.0, abs=1e-3) for layer in found["expert_load"])

    model, _ = diagnostics.rebuild(tmp_path / "run", record)
    model.eval()
    fmt = NEW_RECIPES[name]
    llm = LLM(transformer_xl.export(fmt, tmp_path / "run", tmp_path / "artifact"))
    moe = llm.config.moe
    assert (llm.config.bos_token_id, llm.config.eos_token_ids, llm.config.add_bos_token) == (256, (256,), True)
    tokens = torch.randint(0, 257, (3, 30), generator=torch.Generator().manual_seed(1))
    for k in range(moe.min_k, moe.max_k + 1):  # every k the artifact allows
        model.set_top_k(k)
        with torch.no_grad():
            expected = model(tokens)
        torch.testing.assert_close(logits_at(llm, tokens, k), expected, atol=1e-5, rtol=1e-5, msg=f"k={k}")
    if name == "smoe-top1-lm":  # HyperMoE's Switch router: no bias, p_e not renormalised
        assert (moe.router.kind, moe.router.normalize, moe.router.use_bias) == ("topk_softmax", False, False)
        assert moe.default_k == 1 and not llm.config.is_approximate(1) and llm.config.is_approximate(2)
    trained = train.RECIPES[name].model["top_k_max"]  # the graph routers and the top-1 controls: one k
    assert build_demos.trained_ks(tmp_path / "artifact") == [trained]
    provenance = json.loads((tmp_path / "artifact" / "config.json").read_text())["provenance"]
    assert provenance["precision"] == "fp32" and provenance["train_seconds"] == record["train_seconds"]
    assert provenance["router_aux_loss_coef"] == train.RECIPES[name].router_aux_loss_coef


def graph_model(method: str, **overrides) -> MemTransformerLM:
    torch.manual_seed(0)
    model = MemTransformerLM(TXLConfig(method=method, **{**TINY, "top_k_min": 2, "top_k_max": 2, **overrides}))
    with torch.no_grad():  # experts far apart and a decided gate, so that which experts run changes the output
        for ff in diagnostics.moe_layers(model):
            ff.experts.htoh4.weight.mul_(30)
            ff.experts.h4toh.weight.mul_(30)
            ff.gate.gate.weight.mul_(10)
    return model.eval()


def test_plain_routing_delta_is_what_the_mixing_adds() -> None:
    """tau -> 0 makes the mixing the identity (post-LN inputs: x_i . x_j < x_i . x_i unless equal): no
    delta, no chosen set changed. A flat mixing (large tau) changes both, and the switch is undone."""
    sharp = graph_model("similarity", graph_tau=1e-4)
    found = diagnostics.router_diagnostics(sharp, graph_model("similarity", graph_tau=1e-4), DATA, 32, [1, 2])
    assert all(cell["delta"] == 0 for cell in found["plain_routing_bits_per_byte"].values())
    assert found["plain_routing_choices_changed"] == {"1": 0.0, "2": 0.0}
    flat = graph_model("similarity", graph_tau=1e4)
    found = diagnostics.router_diagnostics(flat, graph_model("similarity", graph_tau=1e4), DATA, 32, [1, 2])
    assert all(abs(cell["delta"]) > 1e-4 for cell in found["plain_routing_bits_per_byte"].values())
    assert all(share > 0.05 for share in found["plain_routing_choices_changed"].values())
    assert all(ff.use_graph for ff in diagnostics.graph_layers(flat))
    with diagnostics.plain_routing(flat):
        assert not any(ff.use_graph for ff in diagnostics.graph_layers(flat))
        plain = diagnostics.bits_per_byte(flat, DATA, 32)
    assert plain == pytest.approx(found["plain_routing_bits_per_byte"]["2"]["plain"], abs=1e-4)
    attention = graph_model("attention")
    assert "plain_routing_bits_per_byte" in diagnostics.router_diagnostics(attention, attention, DATA, 32, [2])
    assert "plain_routing_bits_per_byte" not in diagnostics.router_diagnostics(
        graph_model("smoe"), graph_model("smoe"), DATA, 32, [2]
    )


def hypermoe_model() -> MemTransformerLM:
    """graph_model's HyperMoE at k = 1, its generator scaled so that the HyperExpert's output matters (the
    released init makes it ~1e-4)."""
    model = graph_model("hypermoe", top_k_min=1, top_k_max=1)
    with torch.no_grad():
        for weight in diagnostics.hypermoe_layers(model)[0]._generator[0].decoder.parameters():
            weight.mul_(1000)
    return model


def test_fixed_hyper_expert_delta_is_what_the_selection_adds() -> None:
    """With every expert embedding zero the HyperExpert sees the same input whatever a token selected:
    fixing it costs nothing. Otherwise it does, and the patch is undone."""
    inert = hypermoe_model()
    with torch.no_grad():
        for ff in diagnostics.hypermoe_layers(inert):
            ff.n_experts_embedding.weight.zero_()
    found = diagnostics.router_diagnostics(inert, inert, DATA, 32, [1])
    assert found["fixed_hyper_expert_bits_per_byte"]["1"]["delta"] == 0
    live = hypermoe_model()
    found = diagnostics.router_diagnostics(live, live, DATA, 32, [1])
    cell = found["fixed_hyper_expert_bits_per_byte"]["1"]
    assert abs(cell["delta"]) > 1e-3 and cell["trained"] == found["swap_to_init_bits_per_byte"]["1"]["trained"]
    assert all("hyper_expert" not in vars(ff) for ff in diagnostics.hypermoe_layers(live))
    assert diagnostics.bits_per_byte(live, DATA, 32) == pytest.approx(cell["trained"], abs=1e-4)
    assert "fixed_hyper_expert_bits_per_byte" not in diagnostics.router_diagnostics(
        graph_model("smoe"), graph_model("smoe"), DATA, 32, [2]
    )


def released_switch_losses(logits: list[torch.Tensor], chosen: list[torch.Tensor]) -> tuple[float, float]:
    """The released code's functions, as written there, on its [batch, tokens of every layer, N] layout."""
    router_logits = torch.cat([x.transpose(0, 1) for x in logits], dim=1)  # [B, L * T, N]
    expert_indexes = torch.cat([i.transpose(0, 1) for i in chosen], dim=1)  # [B, L * T]
    num_groups, tokens_per_group, _ = router_logits.shape
    z = torch.sum(torch.logsumexp(router_logits, dim=-1) ** 2) / (num_groups * tokens_per_group)
    router_probs = torch.softmax(router_logits, dim=-1)
    num_experts = router_probs.shape[-1]
    expert_mask = torch.max(F.one_hot(expert_indexes.unsqueeze(2), num_experts), dim=-2).values.float()
    tokens_per_group_and_expert = torch.mean(expert_mask, dim=-2)
    router_prob_per_group_and_expert = torch.mean(router_probs, dim=-2)
    aux = torch.mean(tokens_per_group_and_expert * router_prob_per_group_and_expert) * (num_experts**2)
    return aux.item(), z.item()


def test_hypermoe_load_balancing_loss_is_the_released_switch_codes() -> None:
    torch.manual_seed(3)
    model = MemTransformerLM(TXLConfig(method="hypermoe", **{**TINY, "top_k_min": 1, "top_k_max": 1}))
    tokens = torch.randint(0, 257, (3, 20), generator=torch.Generator().manual_seed(4))
    model.eval()(tokens)
    with pytest.raises(RuntimeError, match="need a training forward"):
        switch_router_losses(model)  # eval keeps nothing
    model.train()(tokens)
    aux, z = switch_router_losses(model)
    routed = [layer.pos_ff.routed for layer in model.layers]
    want = released_switch_losses([r[0] for r in routed], [r[1].view(20, 3) for r in routed])
    assert (aux.item(), z.item()) == pytest.approx(want, rel=1e-6)
    (aux + z).backward()
    assert all(layer.pos_ff.gate.gate.weight.grad.abs().sum() > 0 for layer in model.layers)  # it trains the router
    with torch.no_grad():  # every token to expert 0 with probability ~1: aux = N (balanced: 1)
        for layer in model.layers:  # the MoE input's mean is the LayerNorm bias: 1 in every coordinate
            layer.dec_attn.layer_norm.bias.fill_(1.0)
            layer.pos_ff.gate.gate.weight.zero_()
            layer.pos_ff.gate.gate.weight[0] = 1.0
    model(tokens)
    assert switch_router_losses(model)[0].item() == pytest.approx(8.0, rel=0.05)


def test_precision_is_recorded_and_splits_the_settings(monkeypatch) -> None:
    monkeypatch.setattr(train, "native_bf16", lambda: False)
    assert train.resolve_precision("auto", "lm") == "fp32"  # emulated bf16 is ~8x slower: fp32 on such a CPU
    monkeypatch.setattr(train, "native_bf16", lambda: True)
    assert train.resolve_precision("auto", "lm") == "bf16" and train.resolve_precision("fp32", "lm") == "fp32"
    assert train.resolve_precision("auto", "clf") == "fp32"
    with pytest.raises(ValueError, match="classifier recipes train in fp32 only"):
        train.resolve_precision("bf16", "clf")
    record = {"recipe": "smoe-lm", "method": "smoe", "steps": 1500, "precision": "fp32", "seed": 0}
    settings = build_demos.settings_sha256(record)
    assert settings != build_demos.settings_sha256({**record, "precision": "bf16"})  # never one mean
    assert settings == build_demos.settings_sha256({**record, "seed": 1, "train_seconds": 1.0, "cpu_bf16_units": True})
    # The classifiers train in fp32 only: a record naming it hashes as the records bundled before it did.
    classifier = {"recipe": "smear-clf", "method": "smear", "task": "sequence_classification", "steps": 1200}
    assert build_demos.settings_sha256({**classifier, "precision": "fp32"}) == build_demos.settings_sha256(classifier)


def rows(values: dict[int, float]) -> list[QualityRow]:
    return [QualityRow("shakespeare", k, "bits_per_byte", v) for k, v in values.items()]


def facts(seconds: float, plain: float, load: list[float] | None = None) -> dict:
    cell = {"trained": 2.4, "plain": 2.4 + plain, "delta": plain}
    swap = {"trained": 2.4, "initial_router": 2.6, "delta": 0.2}
    return {
        "train_seconds": seconds,
        **({"load_average": load} if load else {}),
        "precision": "fp32",
        "cpu_bf16_units": False,
        "diagnostics": {"plain_routing_bits_per_byte": {"2": cell}, "swap_to_init_bits_per_byte": {"2": swap}},
    }


def test_seed_summary_keeps_every_seeds_wall_time_and_diagnostics() -> None:
    per_seed = {0: rows({2: 2.40}), 1: rows({2: 2.42}), 2: rows({2: 2.41})}
    runs = {0: facts(600.0, 0.10), 1: facts(660.0, 0.12), 2: facts(630.0, 0.11), 5: facts(1.0, 9.0)}
    summary = build_demos.seed_summary("similarity-lm", per_seed, 0, "causal_lm", "s", runs)
    assert set(summary["runs"]) == {"0", "1", "2"} and summary["precision"] == "fp32"  # seed 5: not in this mean
    assert summary["train_seconds"]["mean"] == 630.0 and summary["train_seconds"]["std"] == pytest.approx(30.0)
    plain = next(d for d in summary["diagnostics"] if d["name"] == "plain_routing_delta_bits_per_byte")
    assert (plain["k"], plain["mean"], plain["values"]) == (2, 0.11, {"0": 0.1, "1": 0.12, "2": 0.11})
    assert "runs" not in build_demos.seed_summary("x", per_seed, 0, "causal_lm", "s")  # older builds: as before
    record = {"train_seconds": 5.0, "precision": "bf16", "metrics": {"diagnostics": {"movement": []}}, "seed": 0}
    assert build_demos.run_facts(record) == {"train_seconds": 5.0, "precision": "bf16", "diagnostics": {"movement": []}}
    loaded = {**record, "load_average": [2.1, 2.0, 1.9]}  # a run key: the settings (and so the mean) stay one
    assert build_demos.run_facts(loaded)["load_average"] == [2.1, 2.0, 1.9]
    assert build_demos.settings_sha256(loaded) == build_demos.settings_sha256(record)


def test_the_seeds_summary_records_the_k_each_recipe_trained_at() -> None:
    """What `eval --stored` marks, read from an exported artifact (MoEConfig.exact_ks): the LMs' k
    schedule, the classifiers' k (SMEAR merges all N), none for a dense LM. (The graph demos' k changed
    when they were retrained at k = 2; their exports are checked in test_new_recipe_trains_exports_and_folds.)"""
    expected = {
        "shakespeare-smoe": [4, 5, 6, 7, 8],
        "shakespeare-hyperrouter": [4, 5, 6, 7, 8],
        "shakespeare-hypermoe": [1],
        "shakespeare-dense": None,
        "genre-moesart": [2],
        "genre-topk": [2],
        "genre-smear": [8],
        "genre-switch": [1],
    }
    assert {name: build_demos.trained_ks(resolve_model(name)) for name in expected} == expected
    per_seed = {0: rows({1: 2.5, 2: 2.4})}
    assert build_demos.seed_summary("similarity-lm", per_seed, 0, "causal_lm", "s", trained_k=[2])["trained_k"] == [2]


def test_controls_go_into_their_hosts_provenance_and_eval_stored_prints_them(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    from moe_serve.cli import main

    torch.manual_seed(0)
    model = MemTransformerLM(TXLConfig(method="hypermoe", **{**TINY, "top_k_min": 1, "top_k_max": 1}))
    train.save_checkpoint(tmp_path / "ckpt", model, {"method": "hypermoe", "model": model.cfg.to_dict(), "seed": 0})
    host = transformer_xl.export("hypermoe", tmp_path / "ckpt", tmp_path / "demo_models" / "shakespeare-hypermoe")
    per_seed = {0: rows({1: 2.40}), 1: rows({1: 2.44})}
    runs = {0: facts(600.0, 0.0, [2.0, 2.0, 1.9]), 1: facts(700.0, 0.0, [3.5, 3.3, 3.2])}
    build_demos.write_provenance(host, seeds=build_demos.seed_summary("hypermoe-lm", per_seed, 0, "causal_lm", "s"))
    record = {"recipe": "smoe-top1-lm", "method": "smoe", "precision": "fp32"}
    for seed in (0, 1):
        run = tmp_path / "runs" / "smoe-top1-lm" / f"seed-{seed}"
        run.mkdir(parents=True)
        (run / "checkpoint.safetensors").write_bytes(b"")
        (run / "training_config.json").write_text(json.dumps({**record, "seed": seed, **runs[seed]}))
        (run / "artifact").mkdir()  # what evaluate_run exports: a top-1 model, as the host
        shutil.copy(host / "config.json", run / "artifact" / "config.json")
    monkeypatch.setattr(build_demos, "BUNDLED_DIR", tmp_path / "demo_models")
    monkeypatch.setattr(build_demos, "evaluate_run", lambda run, *_: rows({1: 2.5 + 0.01 * int(run.name[-1])}))
    out = build_demos.bundle_control(
        "shakespeare-smoe-top1", "smoe-top1-lm", "smoe", "shakespeare-hypermoe", tmp_path / "runs", [0, 1], None
    )
    assert [(r.model, r.k, r.value) for r in out] == [("shakespeare-smoe-top1", 1, 2.5)]
    provenance = json.loads((host / "config.json").read_text())["provenance"]
    control = provenance["controls"]["shakespeare-smoe-top1"]
    assert control["seeds"] == [0, 1] and control["quality"][0]["mean"] == 2.505 and control["trained_k"] == [1]
    assert control["train_seconds"]["mean"] == 650.0 and provenance["seeds"]["recipe"] == "hypermoe-lm"
    # The runs gone: the recorded summary stays, and counts as the control's earlier seeds.
    for seed in (0, 1):
        (tmp_path / "runs" / "smoe-top1-lm" / f"seed-{seed}" / "checkpoint.safetensors").unlink()
    again = build_demos.bundle_control(
        "shakespeare-smoe-top1", "smoe-top1-lm", "smoe", "shakespeare-hypermoe", tmp_path / "runs", [0, 1], None
    )
    assert again == out

    assert main(["eval", "--stored", str(host)]) == 0
    text = capsys.readouterr().out
    assert "shakespeare-smoe-top1 (control)" in text and "2.5050 ± 0.0071" in text
    assert "training (wall time per seed" in text and "10.8 ± 1.2 min, fp32, CPU without bf16 units" in text
    assert "2 seeds, 15-min load average at the end 1.9-3.2 (2 of 2 seeds)" in text
    assert main(["eval", "--stored", str(host), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)["seeds"]["causal_lm"]
    assert set(printed) == {"shakespeare-hypermoe", "shakespeare-smoe-top1 (control)"}


@pytest.mark.slow
def test_an_lm_trained_with_bos_and_eos_exports_them(tmp_path: Path, monkeypatch) -> None:
    """The training stream ends every play with <|endoftext|> and starts every window with it; the
    export says so (bos, eos, add_bos_token), so prompts start as training windows did, generation ends
    at EOS, and the chat template writes BOS first. A record without them exports neither (the old demos)."""
    assert train.byte_stream(False, 256).eq(256).sum() == len(train.shakespeare.split(False))
    assert not train.byte_stream(False).eq(256).any()
    batch = diagnostics.lm_rows(DATA, [0, 100], 8, 256)
    assert batch[:, 0].tolist() == [256, 256] and batch[1, 1:].tolist() == DATA[100:108].tolist()
    assert diagnostics.lm_rows(DATA, [100], 8, None)[0].tolist() == DATA[100:109].tolist()

    torch.manual_seed(0)
    model = MemTransformerLM(TXLConfig(method="smoe", **{**TINY, "top_k_min": 1, "top_k_max": 2}))
    record = {"method": "smoe", "model": model.cfg.to_dict(), "seed": 0}
    train.save_checkpoint(tmp_path / "ckpt", model, record)
    artifact = transformer_xl.export("smoe", tmp_path / "ckpt", tmp_path / "artifact")
    play_chat.install(artifact)
    llm = LLM(artifact)
    config = llm.config
    assert (config.bos_token_id, config.eos_token_ids, config.add_bos_token) == (256, (256,), True)
    assert llm.engine.inputs.encode_text("ROMEO.", "prompt") == [256, *b"ROMEO."]
    assert config.chat_template == play_chat.BOS + play_chat.TEMPLATE
    from moe_serve.api import protocol as p
    from moe_serve.api.prepare import render_chat

    rendered = render_chat(llm.engine.inputs, [p.ChatMessage(role="user", content="Speak.")])
    assert llm.tokenizer.encode_rendered(rendered)[:2] == [256, ord("H")]  # BOS, then "HAMLET."
    with torch.no_grad():  # EOS made certain: generation stops at once
        llm.artifact.model.lm_head_bias[256] = 1e4
    out = llm.generate(["ROMEO."], SamplingParams(max_tokens=5))[0].outputs[0]
    assert (out.finish_reason, out.text) == ("stop", "")

    old = {**record, "model": {k: v for k, v in model.cfg.to_dict().items() if not k.endswith("_token_id")}}
    train.save_checkpoint(tmp_path / "old", model, old)
    old_config = LLM(transformer_xl.export("smoe", tmp_path / "old", tmp_path / "old-artifact")).config
    assert (old_config.bos_token_id, old_config.eos_token_ids, old_config.add_bos_token) == (None, (), False)


@pytest.mark.slow
def test_lm_eval_finds_the_prefix_token_of_a_bos_model(tmp_path: Path) -> None:
    """What lm-evaluation-harness's local-completions reads from the server for a model trained with BOS
    and EOS: /tokenizer_info names them; loglikelihood_rolling then runs without custom_prefix_token_id."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from moe_serve.config import EngineConfig
    from moe_serve.server.settings import ServerSettings
    from tests.server.conftest import start_server

    torch.manual_seed(0)
    model = MemTransformerLM(TXLConfig(method="smoe", **{**TINY, "top_k_min": 1, "top_k_max": 2}))
    train.save_checkpoint(tmp_path / "ckpt", model, {"method": "smoe", "model": model.cfg.to_dict(), "seed": 0})
    artifact = transformer_xl.export("smoe", tmp_path / "ckpt", tmp_path / "bos-lm")
    running = start_server(ServerSettings(models=(str(artifact),), engine=EngineConfig(max_num_seqs=4)))
    try:
        info = httpx.get(running.url + "/tokenizer_info").json()
        assert (info["bos_token_id"], info["eos_token_id"], info["add_bos_token"]) == (256, 256, True)
        assert info["bos_token"] == info["eos_token"] == "<|endoftext|>"
        lm = LocalCompletionsAPI(model="bos-lm", base_url=running.url + "/v1/completions", max_length=64)
        request = Instance("loglikelihood_rolling", {}, ("O Romeo, Romeo.",), 0)
        (logprob,) = lm.loglikelihood_rolling([request], disable_tqdm=True)
        assert math.isfinite(logprob) and logprob < 0
        prefix = lm.prefix_token_id
        completion = {"model": "bos-lm", "prompt": "a<|endoftext|>", "max_tokens": 1, "logprobs": 0, "echo": True}
        echoed = httpx.post(running.url + "/v1/completions", json=completion).json()["choices"][0]["logprobs"]
        assert "<" in echoed["tokens"]  # a completion's prompt text keeps special-token strings literal
    finally:
        running.stop()
    assert prefix == 256  # lm-eval reads it as /tokenize's first id of '<|endoftext|>', as from vLLM
