"""Transformer-XL language models (recipes/transformer_xl.py, the HyperRouter code base) -> artifacts.

Formats:
- `hyperrouter`: per MoE layer, W_r and b_r = H(e) are computed once from the trainable embedding e and
  the frozen hypernetwork H (recomputed from e and H, never read from a cached gate attribute); e and H
  are dropped. Router: `topk_softmax`, normalize=true, with bias.
- `smoe`: the same backbone with a plain linear gate (`gate.gate.weight/bias`); trained with
  `switch_router` (HyperMoE's top-1 SMoE control), the gate has no bias and weights the chosen experts
  by their full-softmax probability: `topk_softmax`, normalize=false.
- `hypermoe`: HyperMoE (methods/hypermoe.md section 8): the Switch router (no bias) and experts kept, the
  hypernetwork replaced by the precomputed HyperExpert of every selected set. Router: `hyper_expert`.
- `similarity`, `attention`: graph-of-tokens routing (methods/graph_routing.md section 8) on the SMoE gate;
  nothing to fold, routers `similarity` (tau) and `attention` (sigma, the calibrated h* per MoE layer).
- `txl-dense`: the dense baseline (every layer a CoreNet FFN).
Backbone fold: qkv_net is split into q/k/v; r_net, r_w_bias, r_r_bias are kept (relative attention);
post-LN; the output layer is tied to the embedding and keeps its bias; embeddings scale by sqrt(d).
Special tokens: a model trained with BOS and EOS (model.bos_token_id / eos_token_id in its training
record: the byte tokenizer's <|endoftext|>) gets them in its config, with add_bos_token, so that every
text prompt starts as its training windows did and generation ends at EOS; a record without them (the
first bundled demos, trained without BOS and EOS) gets neither.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.nn import functional as F

from moe_serve.exporters.base import DEFAULT_OPTIONS, ExportError, ExportOptions, TrainingCheckpoint, write
from moe_serve.layers.routers import RouterConfig, router_config
from moe_serve.layers.routers.hyper_expert import selected_sets
from moe_serve.model_config import ExpertsPerToken, FFNConfig, ModelConfig, MoEConfig
from moe_serve.tokenizer import Tokenizer, byte_level_tokenizer

METHODS = {
    "hyperrouter": "hyperrouter",
    "smoe": "smoe",
    "hypermoe": "hypermoe",
    "similarity": "similarity",
    "attention": "attention",
    "txl-dense": "dense",
}
GRAPH_METHODS = ("similarity", "attention")  # graph-of-tokens routing: the SMoE gate, a router that mixes


def convert_config(ckpt: TrainingCheckpoint, method: str) -> ModelConfig:
    d = ckpt.hyper("d_model")
    moe = None
    if method == "hypermoe":
        k = ckpt.hyper("top_k_max")  # the trained k, the only one its adapters are defined for
        moe = MoEConfig(
            num_experts=ckpt.hyper("num_experts"),
            layers=tuple(ckpt.hyper("moe_index")),
            expert=FFNConfig("mlp", ckpt.hyper("d_expert"), "relu", use_bias=True),
            # Switch (k = 1): p_e, not renormalised; the GPT-2 code (k > 1) renormalises over the chosen
            router=router_config("hyper_expert", normalize=k > 1),
            experts_per_token=ExpertsPerToken(default=k, min=k, max=k),
            hyper_expert=FFNConfig("adapter", ckpt.hyper("adapter_dim"), "relu", use_bias=True),
        )
    elif method != "dense":
        n = ckpt.hyper("num_experts")
        switch = switch_router(ckpt, method)
        moe = MoEConfig(
            num_experts=n,
            layers=tuple(ckpt.hyper("moe_index")),
            expert=FFNConfig("mlp", ckpt.hyper("d_expert"), "relu", use_bias=True),
            router=graph_router(ckpt, method)
            or router_config("topk_softmax", normalize=not switch, use_bias=not switch),
            # The training schedule ends at top_k_max: that is the trained k. It ran every k from top_k_min
            # up; below it results are flagged approximate (graph routers: their kind's rule, K_train only).
            experts_per_token=ExpertsPerToken(
                default=ckpt.hyper("top_k_max"),
                min=1,
                max=n,
                validated=None
                if method in GRAPH_METHODS
                else tuple(range(ckpt.hyper("top_k_min"), ckpt.hyper("top_k_max") + 1)),
            ),
        )
    bos, eos = ckpt.model_config.get("bos_token_id"), ckpt.model_config.get("eos_token_id")
    return ModelConfig(
        task="causal_lm",
        vocab_size=ckpt.hyper("vocab_size"),
        hidden_size=d,
        num_layers=ckpt.hyper("n_layer"),
        num_heads=ckpt.hyper("n_head"),
        head_dim=ckpt.hyper("d_head"),
        ffn=FFNConfig("mlp", ckpt.hyper("d_inner"), "relu", use_bias=True),
        moe=moe,
        position="relative",
        max_position_embeddings=4096,
        norm="layernorm",
        norm_eps=1e-5,
        norm_position="post",
        final_norm=False,
        embedding_scale=d**0.5,
        tie_word_embeddings=True,
        lm_head_bias=True,
        bos_token_id=bos,
        eos_token_id=eos,
        add_bos_token=bos is not None,
    )


def switch_router(ckpt: TrainingCheckpoint, method: str) -> bool:
    """Whether an SMoE checkpoint's gate is HyperMoE's Switch router (no bias, p_e not renormalised)."""
    return method == "smoe" and bool(ckpt.model_config.get("switch_router", False))


def graph_router(ckpt: TrainingCheckpoint, method: str) -> RouterConfig | None:
    """Graph-of-tokens routing folds nothing (no new parameters; W_s = I): the kind and its settings are
    recorded, and for attention the h* each MoE layer calibrated after training (policy A)."""
    if method == "similarity":
        return router_config("similarity", use_bias=True, tau=float(ckpt.hyper("graph_tau")))
    if method == "attention":
        heads = tuple(int(ckpt.get(f"layers.{i}.pos_ff.head", ())) for i in ckpt.hyper("moe_index"))
        return router_config("attention", use_bias=True, sigma=float(ckpt.hyper("graph_sigma")), heads=heads)
    return None


def fold_hyperrouter_gate(ckpt: TrainingCheckpoint, prefix: str, n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W_r [N, d], b_r [N] = reshape(L2(ReLU(L1(e))), [N, d + 1]), in fp32 as the training gate computes it."""
    hyper = ckpt.hyper("hyper_size")
    e = ckpt.get(prefix + "embedding", (1, d)).float()
    w1, b1 = (
        ckpt.get(prefix + "hypernet.0.weight", (hyper, d)).float(),
        ckpt.get(prefix + "hypernet.0.bias", (hyper,)).float(),
    )
    w2 = ckpt.get(prefix + "hypernet.2.weight", (n * (d + 1), hyper)).float()
    b2 = ckpt.get(prefix + "hypernet.2.bias", (n * (d + 1),)).float()
    wb = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(e, w1, b1)), w2, b2).view(n, d + 1)
    return wb[:, :d].contiguous(), wb[:, d].contiguous()


def embedding_weights(sets: list[tuple[int, ...]], num_experts: int) -> torch.Tensor:
    """[P, N]: how much of each expert's embedding goes into the HyperExpert of each selected set: 1 for
    every expert not selected (the released code SUMS them; the paper's Eq. 6 says mean)."""
    weights = torch.ones(len(sets), num_experts)
    for row, chosen in enumerate(sets):
        weights[row, list(chosen)] = 0.0
    return weights


def hypermoe_adapters(
    ckpt: TrainingCheckpoint, prefix: str, layer: int, config: ModelConfig
) -> dict[str, torch.Tensor]:
    """The HyperExpert of every selected set of the trained k, precomputed in fp32 exactly as the released
    code generates it per token: u = SUM of the unselected experts' embeddings, z = embedding_process(u),
    q = ReLU(W1 [z ; LE[layer]] + b1), D = view(Wd q + bd, [d, a]), U = view(Wu q + bu, [a, d]) and the
    generated biases. -> the adapter table in the artifact's layout (down = D^T, up = U^T), one row per set
    in the runtime's order (routers.hyper_expert.selected_sets)."""
    moe = config.moe
    assert moe is not None and moe.hyper_expert is not None
    n, d, k = moe.num_experts, config.hidden_size, moe.default_k
    a, t = moe.hyper_expert.intermediate_size, ckpt.hyper("experts_embedding_dim")
    hidden, layer_dim = ckpt.hyper("hypernetwork_bottleneck"), ckpt.hyper("layer_emb_dim")

    def linear(name: str, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = ckpt.get(name + ".weight", (out_features, in_features)).float()
        return weight, ckpt.get(name + ".bias", (out_features,)).float()

    embedding = ckpt.get(prefix + "n_experts_embedding.weight", (n, t)).float()
    p1, p2 = linear(prefix + "embedding_process.0", t, t), linear(prefix + "embedding_process.2", t, t)
    layer_emb = ckpt.get("param_gen.layer_embed.weight", (config.num_layers, layer_dim)).float()[layer]
    gen = "param_gen.decoder."
    w1 = linear(gen + "linear1", hidden, t + layer_dim)
    w_down, w_up = linear(gen + "weight_down", d * a, hidden), linear(gen + "weight_up", a * d, hidden)
    b_down, b_up = linear(gen + "bias_down", a, hidden), linear(gen + "bias_up", d, hidden)

    sets = selected_sets(n, k)
    u = embedding_weights(sets, n) @ embedding  # [P, t]
    z = F.linear(F.relu(F.linear(u, *p1)), *p2)
    q = F.relu(F.linear(torch.cat([z, layer_emb.expand(len(sets), -1)], dim=1), *w1))  # [P, H]
    down = F.linear(q, *w_down).view(-1, d, a)  # D
    up = F.linear(q, *w_up).view(-1, a, d)  # U
    return {
        "down.weight": down.transpose(1, 2).contiguous(),  # [P, a, d]
        "down.bias": F.linear(q, *b_down),
        "up.weight": up.transpose(1, 2).contiguous(),  # [P, d, a]
        "up.bias": F.linear(q, *b_up),
    }


def convert_weights(ckpt: TrainingCheckpoint, config: ModelConfig, method: str) -> dict[str, torch.Tensor]:
    d, h, dh = config.hidden_size, config.num_heads, config.head_dim
    assert dh is not None
    embedding = ckpt.get("word_emb.emb_layers.0.weight", (config.vocab_size, d))
    output = ckpt.get("crit.out_layers.0.weight", (config.vocab_size, d))
    if not torch.equal(embedding, output):
        raise ExportError(
            "crit.out_layers.0.weight differs from word_emb.emb_layers.0.weight; only tied output layers are supported"
        )
    out = {"embed_tokens.weight": embedding, "lm_head_bias": ckpt.get("crit.out_layers.0.bias", (config.vocab_size,))}
    r_w_bias, r_r_bias = ckpt.get("r_w_bias", (h, dh)), ckpt.get("r_r_bias", (h, dh))
    for i in range(config.num_layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        q, k, v = ckpt.get(src + "dec_attn.qkv_net.weight", (3 * h * dh, d)).chunk(3, dim=0)
        out.update(
            {
                dst + "attn.q_proj.weight": q.contiguous(),
                dst + "attn.k_proj.weight": k.contiguous(),
                dst + "attn.v_proj.weight": v.contiguous(),
                dst + "attn.o_proj.weight": ckpt.get(src + "dec_attn.o_net.weight", (d, h * dh)),
                dst + "attn.r_proj.weight": ckpt.get(src + "dec_attn.r_net.weight", (h * dh, d)),
                dst + "attn.r_w_bias": r_w_bias.clone(),
                dst + "attn.r_r_bias": r_r_bias.clone(),
                dst + "attn_norm.weight": ckpt.get(src + "dec_attn.layer_norm.weight", (d,)),
                dst + "attn_norm.bias": ckpt.get(src + "dec_attn.layer_norm.bias", (d,)),
                dst + "ffn_norm.weight": ckpt.get(src + "pos_ff.layer_norm.weight", (d,)),
                dst + "ffn_norm.bias": ckpt.get(src + "pos_ff.layer_norm.bias", (d,)),
            }
        )
        if config.is_moe_layer(i):
            assert config.moe is not None
            n, f = config.moe.num_experts, config.moe.expert.intermediate_size
            gate = src + "pos_ff.gate."
            if method == "hyperrouter":
                if gate + "embedding" not in ckpt:
                    raise ExportError(
                        f"missing key '{gate}embedding': a HyperRouter checkpoint has a hypernetwork "
                        f"router in every MoE layer"
                    )
                weight, bias = fold_hyperrouter_gate(ckpt, gate, n, d)
            elif method == "hypermoe":
                if src + "pos_ff.n_experts_embedding.weight" not in ckpt:
                    raise ExportError(
                        f"missing key '{src}pos_ff.n_experts_embedding.weight': a HyperMoE checkpoint has expert "
                        "embeddings in every MoE layer"
                    )
                weight, bias = ckpt.get(gate + "gate.weight", (n, d)), None  # the Switch router has no bias
                for name, value in hypermoe_adapters(ckpt, src + "pos_ff.", i, config).items():
                    out[dst + "moe.hyper." + name] = value
            else:
                if gate + "gate.weight" not in ckpt:
                    raise ExportError(
                        f"missing key '{gate}gate.weight': a {method} checkpoint has a linear gate in every MoE layer"
                    )
                weight = ckpt.get(gate + "gate.weight", (n, d))
                bias = None if switch_router(ckpt, method) else ckpt.get(gate + "gate.bias", (n,))
            if bias is not None:
                out[dst + "moe.router.bias"] = bias
            out.update(
                {
                    dst + "moe.router.weight": weight,
                    dst + "moe.experts.fc1.weight": ckpt.get(src + "pos_ff.experts.htoh4.weight", (n, f, d)),
                    dst + "moe.experts.fc1.bias": ckpt.get(src + "pos_ff.experts.htoh4.bias", (n, f)),
                    dst + "moe.experts.fc2.weight": ckpt.get(src + "pos_ff.experts.h4toh.weight", (n, d, f)),
                    dst + "moe.experts.fc2.bias": ckpt.get(src + "pos_ff.experts.h4toh.bias", (n, d)),
                }
            )
        else:
            inner = config.ffn.intermediate_size
            out.update(
                {
                    dst + "ffn.fc1.weight": ckpt.get(src + "pos_ff.CoreNet.0.weight", (inner, d)),
                    dst + "ffn.fc1.bias": ckpt.get(src + "pos_ff.CoreNet.0.bias", (inner,)),
                    dst + "ffn.fc2.weight": ckpt.get(src + "pos_ff.CoreNet.3.weight", (d, inner)),
                    dst + "ffn.fc2.bias": ckpt.get(src + "pos_ff.CoreNet.3.bias", (d,)),
                }
            )
    return out


FOLDED = {
    "hyperrouter": "router W_r, b_r = H(e) computed once per MoE layer; embedding e and hypernetwork H dropped",
    "smoe": "linear gate kept as the router",
    "similarity": "linear gate kept as the router; graph-of-tokens similarity routing folds nothing (W_s = I), "
    "its temperature is recorded",
    "attention": "linear gate kept as the router; graph-of-tokens attention-aware routing folds nothing, its "
    "sigma and the head h* each MoE layer calibrated after training (policy A) are recorded",
    "hypermoe": "the HyperExpert of every selected set of the trained k precomputed from the hypernetwork (sum of "
    "the unselected experts' embeddings, as released); generator, expert embeddings and embedding MLP dropped; "
    "served dropless and without router jitter (the released Switch code applies both at evaluation)",
    "dense": "no router",
}


def export(fmt: str, src: str | Path, dst: str | Path, options: ExportOptions = DEFAULT_OPTIONS) -> Path:
    method = METHODS[fmt]
    ckpt = TrainingCheckpoint(Path(src), method)
    config = convert_config(ckpt, method)
    state = convert_weights(ckpt, config, method)
    folded = FOLDED[method] + (
        " (HyperMoE's Switch router: no bias, not renormalised)" if switch_router(ckpt, method) else ""
    )
    provenance = ckpt.provenance(f"exporters.transformer_xl ({fmt})", folded + "; qkv_net split into q/k/v")
    return write(src, dst, config, state, Tokenizer(byte_level_tokenizer()), provenance, options)
