"""Each seed-method exporter's fold, proven: the training-time module in eval mode and the exported artifact
give the same logits (fp32, 1e-5) at every k the artifact allows; wrong inputs fail naming the key."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_serve import LLM
from moe_serve.artifact import is_router_tensor, load_artifact
from moe_serve.exporters import genre_encoder, transformer_xl
from moe_serve.exporters.base import ExportError, ExportOptions
from recipes.encoder import EncoderConfig, GenreClassifier
from recipes.train import save_checkpoint
from recipes.transformer_xl import MemTransformerLM, TXLConfig

# fmt: off
TXL = dict(d_model=32, n_head=2, d_head=16, n_layer=3, num_experts=4, d_expert=24, d_inner=40, moe_index=(0, 2),
           hyper_size=48, top_k_min=2, top_k_max=4)
# fmt: on
ENC = dict(d_model=32, n_head=2, n_layer=2, max_len=64, num_experts=4, d_expert=16, k=2)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Away from the training init (zero biases, tiny gates) so every term of the fold matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator) * 0.2
            p.copy_(
                1.0 + noise
                if name.endswith("norm.weight") or "layer_norm" in name and name.endswith("weight")
                else noise
            )


# HyperMoE trains top-1, as every run of the paper (Switch routing).
METHOD_TXL = {
    "hypermoe": dict(top_k_min=1, top_k_max=1, experts_embedding_dim=12, hypernetwork_bottleneck=20, adapter_dim=6)
}


def make_lm(tmp_path: Path, method: str, seed: int = 0, **overrides) -> tuple[MemTransformerLM, Path]:
    torch.manual_seed(seed)
    model = MemTransformerLM(TXLConfig(method=method, **{**TXL, **METHOD_TXL.get(method, {}), **overrides}))
    randomize(model, seed)
    model.crit.out_layers[0].weight = model.word_emb.emb_layers[0].weight  # randomize() keeps the tie; be explicit
    if method == "attention":  # policy A: h* fixed per MoE layer (calibrated; here set apart from head 0)
        for layer, head in zip([model.layers[i] for i in TXL["moe_index"]], (1, 0), strict=True):
            layer.pos_ff.head.fill_(head)
    model.eval()
    out = tmp_path / f"{method}-ckpt"
    save_checkpoint(out, model, {"method": method, "model": model.cfg.to_dict(), "recipe": "test", "seed": seed})
    return model, out


def make_classifier(tmp_path: Path, method: str, seed: int = 0) -> tuple[GenreClassifier, Path]:
    torch.manual_seed(seed)
    model = GenreClassifier(EncoderConfig(method=method, **ENC))
    randomize(model, seed)
    model.eval()
    out = tmp_path / f"{method}-ckpt"
    save_checkpoint(out, model, {"method": method, "model": model.cfg.to_dict(), "recipe": "test", "seed": seed})
    return model, out


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(transformer_xl.METHODS))
def test_transformer_xl_fold_matches_training_module_at_every_k(tmp_path: Path, fmt: str) -> None:
    model, ckpt = make_lm(tmp_path, transformer_xl.METHODS[fmt])
    llm = LLM(transformer_xl.export(fmt, ckpt, tmp_path / "artifact"))
    tokens = torch.randint(0, 257, (3, 40), generator=torch.Generator().manual_seed(1))
    moe = llm.config.moe
    ks = [None] if moe is None else range(moe.min_k, moe.max_k + 1)  # every k the artifact allows
    for k in ks:
        if k is not None:
            model.set_top_k(k)
        with torch.no_grad():
            expected = model(tokens)
        with torch.inference_mode():
            hidden, _ = llm.engine.runner.forward_padded(tokens.tolist(), [k or 1] * 3)
            actual = llm.artifact.model.lm_logits(hidden)
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5, msg=f"k={k}")


@pytest.mark.slow
def test_hyperrouter_router_is_the_hypernetwork_output(tmp_path: Path) -> None:
    model, ckpt = make_lm(tmp_path, "hyperrouter")
    artifact = LLM(transformer_xl.export("hyperrouter", ckpt, tmp_path / "artifact")).artifact
    weight, bias = model.layers[2].pos_ff.gate.router()
    moe = artifact.model.layers[2].moe  # one fp32 evaluation of H(e): equal up to GEMM rounding
    torch.testing.assert_close(moe.router.weight, weight.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(moe.router.bias, bias.detach(), atol=1e-6, rtol=0)
    names = set(load_file(tmp_path / "artifact" / "model.safetensors"))
    assert not any("hypernet" in n or "embedding" == n.split(".")[-1] for n in names)
    provenance = json.loads((tmp_path / "artifact" / "config.json").read_text())["provenance"]
    assert "hypernetwork H dropped" in provenance["folded"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(genre_encoder.FOLDED))
def test_encoder_fold_matches_training_module_at_every_k(tmp_path: Path, fmt: str) -> None:
    model, ckpt = make_classifier(tmp_path, fmt)
    llm = LLM(genre_encoder.export(fmt, ckpt, tmp_path / "artifact"))
    generator = torch.Generator().manual_seed(2)
    lengths = [50, 31, 12]
    tokens = torch.randint(0, 256, (3, 50), generator=generator)
    mask = torch.arange(50)[None, :] < torch.tensor(lengths)[:, None]
    for k in range(1, ENC["num_experts"] + 1):
        model.set_k(k)
        with torch.no_grad():
            expected = model(tokens, mask)
        with torch.inference_mode():
            hidden, lens = llm.engine.runner.forward_sequences(
                [tokens[b, :n].tolist() for b, n in enumerate(lengths)], [k] * 3
            )
            actual = llm.artifact.model.class_logits(hidden, lens)
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5, msg=f"k={k}")


@pytest.mark.slow
def test_moesart_drops_temperature(tmp_path: Path) -> None:
    """Selection is top-k of the logits and weights are 1/k, whatever tau was in training."""
    model, ckpt = make_classifier(tmp_path, "moesart")
    for layer in model.layers:
        layer.moe.gate.tau = 3.0
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(tokens, dtype=torch.bool)
    llm = LLM(genre_encoder.export("moesart", ckpt, tmp_path / "artifact"))
    with torch.no_grad():
        expected = model(tokens, mask)
    with torch.inference_mode():
        hidden, lens = llm.engine.runner.forward_sequences(tokens.tolist(), [2, 2])
        torch.testing.assert_close(llm.artifact.model.class_logits(hidden, lens), expected, atol=1e-5, rtol=1e-5)


def test_wrong_method_missing_key_and_wrong_shape_fail_without_output(tmp_path: Path) -> None:
    _, ckpt = make_lm(tmp_path, "smoe")
    dst = tmp_path / "dst"
    with pytest.raises(
        ExportError, match="is a 'smoe' checkpoint \\(training_config.json method\\), not 'hyperrouter'"
    ):
        transformer_xl.export("hyperrouter", ckpt, dst)
    record = json.loads((ckpt / "training_config.json").read_text())
    (ckpt / "training_config.json").write_text(json.dumps({**record, "method": "hyperrouter"}))
    with pytest.raises(ExportError, match="missing key 'layers.0.pos_ff.gate.embedding': a HyperRouter checkpoint"):
        transformer_xl.export("hyperrouter", ckpt, dst)
    (ckpt / "training_config.json").write_text(json.dumps(record))
    tensors = load_file(ckpt / "checkpoint.safetensors")
    tensors["layers.2.pos_ff.experts.h4toh.weight"] = torch.zeros(4, 32, 23)
    save_file(tensors, ckpt / "checkpoint.safetensors")
    with pytest.raises(
        ExportError,
        match=r"checkpoint tensor 'layers.2.pos_ff.experts.h4toh.weight' has shape \[4, 32, 23\], "
        r"expected \[4, 32, 24\]",
    ):
        transformer_xl.export("smoe", ckpt, dst)
    del tensors["layers.1.pos_ff.CoreNet.3.bias"]
    save_file(tensors, ckpt / "checkpoint.safetensors")
    with pytest.raises(ExportError, match="checkpoint tensor 'layers.1.pos_ff.CoreNet.3.bias' is missing"):
        transformer_xl.export("smoe", ckpt, dst)
    _, smear = make_classifier(tmp_path, "smear")
    with pytest.raises(ExportError, match="is a 'smear' checkpoint"):
        genre_encoder.export("moesart", smear, dst)
    assert not dst.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smear-ckpt", "smoe-ckpt"]


def test_cli_lists_every_format(tmp_path: Path, capsys) -> None:
    from moe_serve.cli import main

    with pytest.raises(SystemExit):
        main(["export", "--help"])
    usage = capsys.readouterr().out
    for fmt in ("hf", "hyperrouter", "smoe", "txl-dense", "moesart", "smear", "topk"):
        assert fmt in usage
    _, ckpt = make_classifier(tmp_path, "topk")
    assert main(["export", "topk", str(ckpt), str(tmp_path / "a"), "--dtype", "fp16"]) == 0, capsys.readouterr().err
    config = LLM(tmp_path / "a").config
    assert config.moe.router.kind == "topk_softmax" and config.classifier.labels == EncoderConfig(method="topk").labels


def test_moesart_training_weights_follow_eq3_closed_form() -> None:
    """With r = 1, Eq. (3) gives w_z = g_z / (1 + g_z) and w_i = 1 / ((k - 1)(1 + g_z)) for the others."""
    from recipes.encoder import MOESARTGate

    gate = MOESARTGate(EncoderConfig(method="moesart", **{**ENC, "k": 3})).train()
    x = torch.randn(64, ENC["d_model"], generator=torch.Generator().manual_seed(4))
    torch.manual_seed(5)
    indices, weights = gate(x)
    g = torch.softmax(gate.gate_weights(x), -1).gather(1, indices)  # [T, k]
    z_mask = torch.isclose(weights, g / (1 + g), atol=1e-6)
    assert bool(z_mask.any(dim=1).all())  # one slot per token is z
    g_z = (g * z_mask).sum(1, keepdim=True)
    others = ~z_mask
    torch.testing.assert_close(weights[others], (1 / (2 * (1 + g_z))).expand_as(weights)[others], atol=1e-6, rtol=1e-5)
    assert len({tuple(sorted(row)) for row in indices.tolist()}) > 1  # sampled, not a fixed top-k


def test_hyperrouter_k_schedule_is_linear_from_half_to_all() -> None:
    from recipes.transformer_xl import k_schedule

    ks = [k_schedule(step, 9, 4, 8) for step in range(9)]
    assert ks[0] == 4 and ks[-1] == 8 and ks == sorted(ks)


# ---- HyperMoE ------------------------------------------------------------------------------------------


def _hypermoe_logits(llm: LLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    k = llm.config.moe.default_k
    with torch.inference_mode():
        hidden, lens = llm.engine.runner.forward_sequences(sequences, [k] * len(sequences))
        return list(llm.artifact.model.lm_logits(hidden).split(lens))


@pytest.mark.parametrize("k", [1, 2])
def test_hypermoe_fold_matches_the_released_per_token_generation_on_a_padded_batch(tmp_path: Path, k: int) -> None:
    """k = 1 (every run of the paper: one adapter per expert) and k = 2 (one per selected pair, C(4, 2))."""
    model, ckpt = make_lm(tmp_path, "hypermoe", top_k_min=k, top_k_max=k)
    llm = LLM(transformer_xl.export("hypermoe", ckpt, tmp_path / "artifact"))
    assert llm.artifact.model.layers[0].moe.hyper.num_experts == math.comb(TXL["num_experts"], k)
    assert llm.config.moe.router.normalize is (k > 1)  # Switch code at k = 1, GPT-2 code above
    generator = torch.Generator().manual_seed(5)
    sequences = [torch.randint(0, 257, (n,), generator=generator).tolist() for n in (40, 17, 3)]
    for tokens, actual in zip(sequences, _hypermoe_logits(llm, sequences), strict=True):
        with torch.no_grad():
            expected = model(torch.tensor([tokens]))[0]  # each sequence alone; the runtime packs them
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    provenance = json.loads((tmp_path / "artifact" / "config.json").read_text())["provenance"]
    assert "dropless" in provenance["folded"] and "router jitter" in provenance["folded"]
    names = set(load_file(tmp_path / "artifact" / "model.safetensors"))
    assert not any("param_gen" in n or "n_experts_embedding" in n or "embedding_process" in n for n in names)


def test_each_table_entry_is_the_generators_output_for_its_set(tmp_path: Path) -> None:
    from moe_serve.layers.routers.hyper_expert import selected_sets

    model, ckpt = make_lm(tmp_path, "hypermoe", top_k_min=2, top_k_max=2)
    block = LLM(transformer_xl.export("hypermoe", ckpt, tmp_path / "artifact")).artifact.model.layers[2].moe
    x = torch.randn(5, TXL["d_model"], generator=torch.Generator().manual_seed(6))
    for pattern, chosen in enumerate(selected_sets(TXL["num_experts"], 2)):
        with torch.no_grad():
            want = model.layers[2].pos_ff.hyper_expert(x, torch.tensor([chosen] * len(x)))
        bank = block.hyper
        h = torch.relu(x @ bank.down.weight[pattern].T + bank.down.bias[pattern])
        torch.testing.assert_close(h @ bank.up.weight[pattern].T + bank.up.bias[pattern], want, atol=1e-6, rtol=1e-5)


def test_hypermoe_negative_controls_fail_the_fold(tmp_path: Path, monkeypatch) -> None:
    """The fold test can fail: tables built with the paper's mean instead of the code's sum, or from the
    selected instead of the unselected experts' embeddings, give other logits."""
    model, ckpt = make_lm(tmp_path, "hypermoe")
    sequences = [torch.randint(0, 257, (30,), generator=torch.Generator().manual_seed(7)).tolist()]
    with torch.no_grad():
        expected = model(torch.tensor(sequences))[0]
    released = transformer_xl.embedding_weights
    controls = {
        "mean": lambda sets, n: released(sets, n) / (n - len(sets[0])),
        "selected": lambda sets, n: 1.0 - released(sets, n),
    }
    for name, weights in controls.items():
        monkeypatch.setattr(transformer_xl, "embedding_weights", weights)
        llm = LLM(transformer_xl.export("hypermoe", ckpt, tmp_path / f"artifact-{name}"))
        (actual,) = _hypermoe_logits(llm, sequences)
        assert (actual - expected).abs().max() > 1e-3, name
    monkeypatch.setattr(transformer_xl, "embedding_weights", released)
    (actual,) = _hypermoe_logits(LLM(transformer_xl.export("hypermoe", ckpt, tmp_path / "artifact")), sequences)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_hypermoe_at_k2_without_the_released_renormalisation_fails_the_fold(tmp_path: Path, monkeypatch) -> None:
    """At k > 1 the released (GPT-2) code divides the chosen probabilities by their sum: an export that
    weights them by p alone, as the Switch code does at k = 1, gives other logits."""
    model, ckpt = make_lm(tmp_path, "hypermoe", top_k_min=2, top_k_max=2)
    sequences = [torch.randint(0, 257, (30,), generator=torch.Generator().manual_seed(8)).tolist()]
    with torch.no_grad():
        expected = model(torch.tensor(sequences))[0]
    released = transformer_xl.router_config
    switch = lambda kind, **kw: released(kind, **{**kw, "normalize": False})  # noqa: E731
    monkeypatch.setattr(transformer_xl, "router_config", switch)
    (actual,) = _hypermoe_logits(LLM(transformer_xl.export("hypermoe", ckpt, tmp_path / "switch")), sequences)
    assert (actual - expected).abs().max() > 1e-3


def test_hypermoe_serves_only_its_trained_k(tmp_path: Path) -> None:
    from moe_serve import SamplingParams
    from moe_serve.errors import ValidationError

    _, ckpt = make_lm(tmp_path, "hypermoe")
    llm = LLM(transformer_xl.export("hypermoe", ckpt, tmp_path / "artifact"))
    with pytest.raises(ValidationError, match="experts_per_token must be between 1 and 1, got 2"):
        llm.generate(["x"], SamplingParams(max_tokens=1, experts_per_token=2))
    assert llm.generate(["x"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_graph_routing_exports_record_the_router_and_calibrated_heads(tmp_path: Path) -> None:
    from recipes.transformer_xl import calibrate_heads

    _, ckpt = make_lm(tmp_path, "similarity", graph_tau=0.5)
    router = LLM(transformer_xl.export("similarity", ckpt, tmp_path / "sim")).config.moe.router
    assert (router.kind, router.tau, router.use_bias) == ("similarity", 0.5, True)
    _, ckpt = make_lm(tmp_path, "attention", graph_sigma=2.0)
    router = LLM(transformer_xl.export("attention", ckpt, tmp_path / "att")).config.moe.router
    assert (router.kind, router.sigma, router.heads) == ("attention", 2.0, (1, 0))
    # Policy A: calibration fixes each MoE layer's h* as the head of least mean attention entropy.
    model, _ = make_lm(tmp_path / "calibrated", "attention")
    heads = calibrate_heads(model, torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(9)))
    assert len(heads) == len(TXL["moe_index"]) and all(0 <= h < TXL["n_head"] for h in heads)
    assert heads == [int(model.layers[i].pos_ff.head) for i in TXL["moe_index"]]


@pytest.mark.parametrize(
    ("fmt", "kind", "exact"),
    [
        ("hyperrouter", "lm", {2, 3, 4}),  # the k schedule it trained at: top_k_min..top_k_max
        ("smoe", "lm", {2, 3, 4}),
        ("similarity", "lm", {4}),  # the router kind's own rule: only the trained K
        ("moesart", "clf", {2}),
        ("topk", "clf", {2}),
        ("switch", "clf", {1}),
        ("smear", "clf", {4}),  # k = N is exact SMEAR
    ],
)
def test_k_never_trained_at_is_flagged_approximate(tmp_path: Path, fmt: str, kind: str, exact: set[int]) -> None:
    if kind == "lm":
        _, ckpt = make_lm(tmp_path, transformer_xl.METHODS[fmt])
        config = LLM(transformer_xl.export(fmt, ckpt, tmp_path / "artifact")).config
    else:
        _, ckpt = make_classifier(tmp_path, fmt)
        config = LLM(genre_encoder.export(fmt, ckpt, tmp_path / "artifact")).config
    assert config.moe is not None
    flagged = {k for k in range(1, config.moe.num_experts + 1) if config.is_approximate(k)}
    assert flagged == set(range(1, config.moe.num_experts + 1)) - exact


def test_switch_classifier_results_say_approximate_beyond_k1(tmp_path: Path) -> None:
    _, ckpt = make_classifier(tmp_path, "switch")
    llm = LLM(genre_encoder.export("switch", ckpt, tmp_path / "artifact"))
    exact, approximate = llm.classify(["O Romeo, Romeo"], experts_per_token=1), llm.classify(["x"], experts_per_token=2)
    assert not exact[0].approximate and approximate[0].approximate


@pytest.mark.parametrize("fmt", ["hyperrouter", "smear"])
def test_router_tensors_stay_fp32_in_a_bf16_artifact_and_when_loaded_in_bf16(tmp_path: Path, fmt: str) -> None:
    """docs/architecture.md §3: bf16 rounding flips top-k sets, so router weights keep fp32 whatever the rest is."""
    if fmt == "hyperrouter":
        _, ckpt = make_lm(tmp_path, fmt)
        artifact = transformer_xl.export(fmt, ckpt, tmp_path / "artifact", ExportOptions(dtype=torch.bfloat16))
    else:
        _, ckpt = make_classifier(tmp_path, fmt)
        artifact = genre_encoder.export(fmt, ckpt, tmp_path / "artifact", ExportOptions(dtype=torch.bfloat16))
    stored = load_file(artifact / "model.safetensors")
    routers = {name for name in stored if is_router_tensor(name)}
    assert routers and all(stored[name].dtype == torch.float32 for name in routers)
    assert all(t.dtype == torch.bfloat16 for name, t in stored.items() if name not in routers)
    model = load_artifact(artifact, dtype=torch.bfloat16).model
    loaded = dict(model.named_parameters())
    assert all(loaded[name].dtype == torch.float32 for name in routers)
    assert loaded["layers.0.attn.q_proj.weight"].dtype == torch.bfloat16
