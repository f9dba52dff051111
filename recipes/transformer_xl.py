"""Training-time Transformer-XL language model with HyperRouter, SMoE, HyperMoE, graph-of-tokens routing
(similarity, attention) or dense FFNs.

Faithful to giangdip2410/HyperRouter (methods/hyperrouter.md): MemTransformerLM with relative partial
attention (RelPartialLearnableMultiHeadAttn, post-LN), state-dict keys as in the official model
(`word_emb.emb_layers.0.weight`, `layers.{i}.dec_attn.qkv_net.weight`, `layers.{i}.pos_ff.gate.embedding`,
`layers.{i}.pos_ff.experts.htoh4.weight`, ...). Memory is not used (mem_len 0): a token's routing does
not depend on it, and the serving runtime attends over the full cached context instead.

This module is what the exporters convert; the serving runtime never imports it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class TXLConfig:
    method: str  # hyperrouter | smoe | hypermoe | similarity | attention | dense
    vocab_size: int = 257
    d_model: int = 128
    n_head: int = 4
    d_head: int = 32
    n_layer: int = 4
    num_experts: int = 8
    d_expert: int = 128  # hidden units per expert (the paper's "inner dimension")
    d_inner: int = 256  # dense FFN width (dense layers, and the dense baseline)
    moe_index: tuple[int, ...] = (0, 1, 2, 3)
    hyper_size: int = 256  # hypernetwork hidden size (always 256 in the official code)
    dropout: float = 0.1
    top_k_min: int = 4  # the k schedule of the official scripts: linear from N/2 to N
    top_k_max: int = 8
    # HyperMoE (method hypermoe; Bumble666/Hyper_MoE, methods/hypermoe.md section 8), at the widths of this
    # small backbone (the official runs use 128 / 128 / 10 / 64 at d = 768):
    experts_embedding_dim: int = 32  # t: each expert's embedding, per MoE layer (= process_dim = hypernet_input)
    hypernetwork_bottleneck: int = 32  # H: the generator's hidden layer
    layer_emb_dim: int = 10
    adapter_dim: int = 16  # a: the HyperExpert's bottleneck
    # Graph-of-tokens routing (methods similarity, attention; methods/graph_routing.md section 8):
    graph_tau: float = 1.0  # similarity: x_i . x_j / tau
    graph_sigma: float = 1.0  # attention: the likelihood's width
    # The SMoE gate as HyperMoE's Switch router (a top-1 SMoE control of HyperMoE's budget): no bias, and
    # the chosen experts weighted by their full-softmax probability, never renormalised. A renormalised
    # top-1 weight is the constant 1, so a plain SMoE router trained at k = 1 never gets a gradient.
    switch_router: bool = False
    # The byte tokenizer's <|endoftext|> (moe_serve.tokenizer): the training stream ends every play with
    # it (EOS) and every training window starts with it (BOS), as the served model sees a prompt when
    # its config says add_bos_token. None: trained without (the first bundled demos).
    bos_token_id: int | None = 256
    eos_token_id: int | None = 256

    def to_dict(self) -> dict:
        return asdict(self)


class PositionalEmbedding(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1 / (10000 ** (torch.arange(0.0, d_model, 2.0) / d_model)))

    def forward(self, pos_seq: torch.Tensor) -> torch.Tensor:
        sinusoid = torch.outer(pos_seq, self.inv_freq)
        return torch.cat([sinusoid.sin(), sinusoid.cos()], dim=-1)[:, None, :]  # [klen, 1, d]


class RelPartialLearnableMultiHeadAttn(nn.Module):
    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        self.n_head, self.d_head = cfg.n_head, cfg.d_head
        self.qkv_net = nn.Linear(cfg.d_model, 3 * cfg.n_head * cfg.d_head, bias=False)
        self.r_net = nn.Linear(cfg.d_model, cfg.n_head * cfg.d_head, bias=False)
        self.o_net = nn.Linear(cfg.n_head * cfg.d_head, cfg.d_model, bias=False)
        self.layer_norm = nn.LayerNorm(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.scale = 1 / (cfg.d_head**0.5)

    @staticmethod
    def _rel_shift(x: torch.Tensor) -> torch.Tensor:
        zero_pad = torch.zeros((x.size(0), 1, *x.size()[2:]), device=x.device, dtype=x.dtype)
        x_padded = torch.cat([zero_pad, x], dim=1).view(x.size(1) + 1, x.size(0), *x.size()[2:])
        return x_padded[1:].view_as(x)

    def forward(self, w, r, r_w_bias, r_r_bias, attn_mask):  # w [qlen, bsz, d], r [rlen, 1, d]
        qlen, rlen, bsz = w.size(0), r.size(0), w.size(1)
        w_heads = self.qkv_net(w)
        r_head_k = self.r_net(r).view(rlen, self.n_head, self.d_head)
        q, k, v = torch.chunk(w_heads, 3, dim=-1)
        q = q.view(qlen, bsz, self.n_head, self.d_head)
        k = k.view(qlen, bsz, self.n_head, self.d_head)
        v = v.view(qlen, bsz, self.n_head, self.d_head)
        ac = torch.einsum("ibnd,jbnd->ijbn", q + r_w_bias, k)
        bd = self._rel_shift(torch.einsum("ibnd,jnd->ijbn", q + r_r_bias, r_head_k))
        score = (ac + bd) * self.scale
        score = score.masked_fill(attn_mask[:, :, None, None], float("-inf"))
        self.last = (score, v)  # for an attention-aware router in the same layer (scores before dropout)
        prob = self.drop(F.softmax(score, dim=1))
        vec = torch.einsum("ijbn,jbnd->ibnd", prob, v).contiguous().view(qlen, bsz, -1)
        return self.layer_norm(w + self.drop(self.o_net(vec)))


def fp32_routing() -> torch.autocast:
    """Router math stays in fp32 when a recipe trains under bf16 autocast (docs/architecture.md §3: bf16 rounding
    flips top-k sets); a no-op outside autocast, so eval and the fold tests are unchanged."""
    return torch.autocast("cpu", enabled=False)


class HyperRouterGate(nn.Module):
    """Router weights generated by a frozen hypernetwork from a trainable embedding (recomputed each
    call, as in the official gate, so `gate.weight` never appears in the state dict)."""

    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        self.num_experts, self.d_model = cfg.num_experts, cfg.d_model
        self.embedding = nn.Parameter(torch.randn(1, cfg.d_model))
        self.hypernet = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.hyper_size),
            nn.ReLU(),
            nn.Linear(cfg.hyper_size, cfg.num_experts * (cfg.d_model + 1)),
        )
        for layer in (self.hypernet[0], self.hypernet[2]):
            nn.init.normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)
        self.hypernet.requires_grad_(False)  # frozen, as in the official training script

    def router(self, embedding: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> W_r [N, d], b_r [N] = H(e) (or H of the embedding given)."""
        wb = self.hypernet(self.embedding if embedding is None else embedding).view(self.num_experts, self.d_model + 1)
        return wb[:, : self.d_model], wb[:, self.d_model]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with fp32_routing():
            weight, bias = self.router()
            return F.linear(h.float(), weight, bias)


class NaiveGate(nn.Module):
    """The SMoE baseline: a plain linear router (`gate.gate.weight`, `gate.gate.bias`); HyperMoE's Switch
    router has no bias."""

    def __init__(self, cfg: TXLConfig, bias: bool = True) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.num_experts, bias=bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with fp32_routing():
            return self.gate(h.float())


class Experts(nn.Module):
    """fastmoe-style stacked expert linears: htoh4 [N, F, d] (+ bias), ReLU, h4toh [N, d, F] (+ bias)."""

    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        n, f, d = cfg.num_experts, cfg.d_expert, cfg.d_model
        self.htoh4 = nn.Module()
        self.htoh4.weight = nn.Parameter(torch.randn(n, f, d) * 0.02)
        self.htoh4.bias = nn.Parameter(torch.zeros(n, f))
        self.h4toh = nn.Module()
        self.h4toh.weight = nn.Parameter(torch.randn(n, d, f) * 0.02)
        self.h4toh.bias = nn.Parameter(torch.zeros(n, d))

    def all_experts(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] -> every expert's output [T, N, d]."""
        h = F.relu(torch.einsum("td,nfd->tnf", x, self.htoh4.weight) + self.htoh4.bias)
        return torch.einsum("tnf,ndf->tnd", h, self.h4toh.weight) + self.h4toh.bias

    def forward(self, x: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """x [T, d], the chosen experts [T, K] and their weights [T, K] -> sum_k weight * expert(x) [T, d].
        Unchosen experts get neither output nor gradient either way. At K >= N / 2 every expert runs on
        every token, weighted by a sparse [T, N] matrix (fast on a CPU there); below, each expert runs on
        its own tokens only (K = 1 or 2 of 8: 4-8x fewer expert FLOPs than running all of them)."""
        n, k = self.htoh4.weight.shape[0], indices.shape[1]
        if 2 * k >= n:
            weights = torch.zeros(x.shape[0], n, dtype=values.dtype, device=x.device).scatter(1, indices, values)
            return torch.einsum("tn,tnd->td", weights.to(x.dtype), self.all_experts(x))
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)  # [T * K]
        order = indices.flatten().argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(indices.flatten(), minlength=n).tolist()
        out = torch.zeros_like(x)
        for e, pairs in enumerate(order.split(counts)):
            if pairs.numel() == 0:
                continue
            rows = token[pairs]
            h = F.relu(F.linear(x[rows], self.htoh4.weight[e], self.htoh4.bias[e]))  # [R, F]
            y = F.linear(h, self.h4toh.weight[e], self.h4toh.bias[e])  # [R, d]
            out.index_add_(0, rows, (y * values.flatten()[pairs, None]).to(out.dtype))
        return out


class MoEPositionwiseFF(nn.Module):
    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        switch = cfg.method == "smoe" and cfg.switch_router
        self.gate = HyperRouterGate(cfg) if cfg.method == "hyperrouter" else NaiveGate(cfg, bias=not switch)
        self.experts = Experts(cfg)
        self.layer_norm = nn.LayerNorm(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.top_k = cfg.top_k_max
        self.switch = switch

    def routing_distribution(self, inp: torch.Tensor) -> torch.Tensor:
        """The distribution experts are chosen from, [T * B, N]: the full router softmax (diagnostics)."""
        return F.softmax(self.gate(inp.reshape(-1, inp.size(-1))).float(), dim=-1)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        x = inp.reshape(-1, inp.size(-1))
        logits = self.gate(x).float()
        values, indices = torch.topk(logits, self.top_k, dim=-1)  # top-k on logits (= on probabilities)
        if self.switch:  # the chosen experts' full-softmax probabilities (the Switch router's p_e)
            scores = F.softmax(logits, dim=-1).gather(1, indices)
        else:  # softmax over the chosen
            scores = F.softmax(values, dim=-1)
        out = self.experts(x, indices, scores)
        return self.layer_norm(inp + self.drop(out.view_as(inp)))


class HyperNetwork(nn.Module):
    """HyperMoE's generator (`param_gen.decoder.*`, the official attribute name): q = ReLU(W1 [z ; LE] + b1),
    D = view(Wd q + bd, [d, a]), U = view(Wu q + bu, [a, d]), and the generated biases b_D, b_U."""

    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        d, a, hidden = cfg.d_model, cfg.adapter_dim, cfg.hypernetwork_bottleneck
        self.d_model, self.adapter_dim = d, a
        self.linear1 = nn.Linear(cfg.experts_embedding_dim + cfg.layer_emb_dim, hidden)
        self.weight_up = nn.Linear(hidden, a * d)
        self.weight_down = nn.Linear(hidden, d * a)
        self.bias_up = nn.Linear(hidden, d)
        self.bias_down = nn.Linear(hidden, a)
        # "hyperfanin": uniform with bound 1e-3 * sqrt(3 / (hypernet_in * mainnet_in)), zero bias.
        for layer, mainnet_in in ((self.weight_up, a), (self.weight_down, d), (self.bias_up, 1), (self.bias_down, 1)):
            bound = 1e-3 * (3 / (hidden * mainnet_in)) ** 0.5
            nn.init.uniform_(layer.weight, -bound, bound)
            nn.init.zeros_(layer.bias)

    def forward(self, inp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """inp [T, t + layer_emb] -> D [T, d, a], b_D [T, a], U [T, a, d], b_U [T, d]."""
        q = F.relu(self.linear1(inp))
        d, a = self.d_model, self.adapter_dim
        return self.weight_down(q).view(-1, d, a), self.bias_down(q), self.weight_up(q).view(-1, a, d), self.bias_up(q)


class ParameterGenerator(nn.Module):
    """`param_gen`: one per model (the official GPT-2 layout), conditioned on the MoE layer's block index."""

    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        self.layer_embed = nn.Embedding(cfg.n_layer, cfg.layer_emb_dim)
        self.decoder = HyperNetwork(cfg)

    def forward(self, z: torch.Tensor, layer: int) -> tuple[torch.Tensor, ...]:
        layer_emb = self.layer_embed.weight[layer].expand(z.shape[0], -1)
        return self.decoder(torch.cat([z, layer_emb], dim=-1))  # the official order: [z ; layer embedding]


class HyperMoEPositionwiseFF(nn.Module):
    """HyperMoE's MoE layer, as released: Switch routing (p = softmax(W_g x) in fp32, no bias, the top-k by
    probability weighted by p: at k = 1 not renormalised, as the Switch code; at k > 1 renormalised over
    the chosen, as the GPT-2 code's `noisy_top_k_gating_mixing`: top_k / sum(top_k)), and per token one
    HyperExpert generated from the SUM of the unselected experts' embeddings: u -> z = embedding_process(u)
    -> (D, b_D, U, b_U) -> ReLU(x D + b_D) U + b_U, added ungated. Training-only parts of the release
    (router jitter, expert capacity) are left out: the served model is dropless and deterministic
    (recorded as deviations in the artifact)."""

    def __init__(self, cfg: TXLConfig, index: int, generator: ParameterGenerator) -> None:
        super().__init__()
        t = cfg.experts_embedding_dim
        self.gate = NaiveGate(cfg, bias=False)
        self.experts = Experts(cfg)
        self.n_experts_embedding = nn.Embedding(cfg.num_experts, t)
        self.embedding_process = nn.Sequential(nn.Linear(t, t), nn.ReLU(), nn.Linear(t, t))
        self.layer_norm = nn.LayerNorm(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.top_k = cfg.top_k_max
        self.index = index
        self._generator = (generator,)  # shared by every layer; owned (and saved) by the model
        # The last training forward's router logits [T, B, N] and choices [T * B, k]: the Switch losses'.
        self.routed: tuple[torch.Tensor, torch.Tensor] | None = None

    def hyper_expert(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """x [T, d], indices [T, k] selected -> the HyperExpert output [T, d]."""
        unselected = torch.ones(x.shape[0], self.experts.htoh4.weight.shape[0], device=x.device)
        unselected = unselected.scatter(1, indices, 0.0)  # [T, N]
        u = unselected @ self.n_experts_embedding.weight  # the SUM of the unselected embeddings (code, not paper)
        down, b_down, up, b_up = self._generator[0](self.embedding_process(u), self.index)
        h = F.relu(torch.bmm(x[:, None], down)[:, 0] + b_down)  # [T, a]
        return torch.bmm(h[:, None], up)[:, 0] + b_up

    routing_distribution = MoEPositionwiseFF.routing_distribution  # the Switch router's p = softmax(W_g x)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        x = inp.reshape(-1, inp.size(-1))
        logits = self.gate(x).float()  # [T * B, N]
        values, indices = torch.topk(F.softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.top_k > 1:
            values = values / values.sum(dim=-1, keepdim=True)
        self.routed = (logits.view(*inp.shape[:2], -1), indices) if self.training else None
        out = self.experts(x, indices, values) + self.hyper_expert(x, indices)
        return self.layer_norm(inp + self.drop(out.view_as(inp)))


def switch_router_losses(model: MemTransformerLM) -> tuple[torch.Tensor, torch.Tensor]:
    """The released Switch code's router losses over the HyperMoE layers of the last training forward
    -> (load-balancing loss, router z-loss). Bumble666/Hyper_MoE @ 3159fc08,
    switch_transformer/transformers/models/switch_transformers/modeling_switch_transformers.py:
    `load_balancing_loss_func` (L93-129): N^2 * the mean over (sequence, expert) of f * P, f the fraction
    of the sequence's tokens whose top-1 is the expert and P their mean router probability, tokens of
    every MoE layer of the stack pooled (`_unpack_router_logits`, L1820-1828, concatenates the layers
    along the sequence); `router_z_loss_func` (L73-90): the mean over tokens and layers of
    logsumexp(logits)^2; added as router_aux_loss_coef * aux + router_z_loss_coef * z (L1782-1785), both
    0.001 (configuration_switch_transformers.py L122-123), whenever the model returns router logits,
    which it does by default (L1656). The released GPT-2 (LM) code has another loss, 1e-2 * (cv^2 of
    importance + cv^2 of load) per layer (gpt-2-moe/transformers/models/layers.py L93-103), but both
    terms have a gradient only through its noisy gating (importance sums renormalised top-k gates,
    constant at k = 1; load is the noise's smoothed top-k probability): with the Switch router this
    recipe trains, noise-free, it would not move the router, so the Switch code's loss is the one."""
    routed = [layer.pos_ff.routed for layer in model.layers if isinstance(layer.pos_ff, HyperMoEPositionwiseFF)]
    if any(r is None for r in routed):
        raise RuntimeError("the Switch router losses need a training forward of every HyperMoE layer first")
    logits = torch.cat([r[0] for r in routed if r is not None], dim=0)  # [L * T, B, N]
    chosen = torch.cat([r[1].view(*r[0].shape[:2], -1) for r in routed if r is not None], dim=0)  # [L * T, B, k]
    n = logits.shape[-1]
    mask = F.one_hot(chosen, n).amax(dim=-2).float()  # [L * T, B, N]: the token went to the expert
    probs = F.softmax(logits, dim=-1)
    aux = (mask.mean(dim=0) * probs.mean(dim=0)).mean() * n**2
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    return aux, z


class GraphRoutingFF(nn.Module):
    """Graph-of-tokens routing (methods/graph_routing.md section 8, binding: causal, per sequence, full
    probabilities mixed), with every [T, T] matrix written out: the reference module the runtime's
    routers are proven against. The gate is the SMoE baseline's (`gate.gate.weight/bias`).

    similarity: S = causal row-softmax(x x^T / tau), Q = S P.
    attention: A^ = causal row-softmax(s^h + (x W_O^h) . v^h / sigma^2 - ||W_O^h v^h_j||^2 / (2 sigma^2)) with
    the same layer's scores s^h of head h = h*, Q = A^ P. h*: in training, the paper's rule at every
    forward (the head whose attention rows have the least mean entropy); in eval mode the buffer `head`,
    calibrated once after training (`calibrate_head`), so that routing is causal and fixed (policy A)."""

    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        self.kind = cfg.method
        self.gate = NaiveGate(cfg)
        self.experts = Experts(cfg)
        self.layer_norm = nn.LayerNorm(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.top_k = cfg.top_k_max
        self.tau, self.sigma, self.d_head = cfg.graph_tau, cfg.graph_sigma, cfg.d_head
        if self.kind == "attention":
            self.register_buffer("head", torch.zeros((), dtype=torch.long))
        self.attention: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # scores, values, W_O
        # False: plain top-k of the gate's own probabilities, the mixing switched off (the diagnostic that
        # measures what the graph adds to the same weights); never saved.
        self.use_graph = True

    def mixing(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, B, d] -> the causal mixing matrix of each sequence [B, T, T] (rows sum to 1)."""
        t = x.shape[0]
        future = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        if self.kind == "similarity":
            scores = torch.einsum("ibd,jbd->bij", x.float(), x.float()) / self.tau
        else:
            score, v, w_o = self.attention  # type: ignore[misc]  # [T, T, B, H], [T, B, H, dh], [d, H * dh]
            h = int(self.head) if not self.training else head_of_least_entropy(score)
            w_oh = w_o[:, h * self.d_head : (h + 1) * self.d_head].float()  # W_O^h [d, dh]
            proj = torch.einsum("jbe,de->jbd", v[:, :, h].float(), w_oh)  # W_O^h v_j
            likelihood = torch.einsum("ibd,jbd->bij", x.float(), proj) - 0.5 * proj.pow(2).sum(-1).T[:, None, :]
            scores = score[:, :, :, h].permute(2, 0, 1).float() + likelihood / self.sigma**2
        return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)

    def routing_distribution(self, inp: torch.Tensor) -> torch.Tensor:
        """The gate probabilities mixed over the sequence's earlier tokens, [T * B, N]: what top-k picks from."""
        probs = F.softmax(self.gate(inp).float(), dim=-1)  # [T, B, N]
        if not self.use_graph:
            return probs.reshape(-1, probs.shape[-1])
        with fp32_routing():
            return torch.einsum("bij,jbn->ibn", self.mixing(inp), probs).reshape(-1, probs.shape[-1])

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        x = inp.reshape(-1, inp.size(-1))
        mixed = self.routing_distribution(inp)
        values, indices = torch.topk(mixed, self.top_k, dim=-1)
        out = self.experts(x, indices, values / values.sum(-1, keepdim=True))
        return self.layer_norm(inp + self.drop(out.view_as(inp)))

    @torch.no_grad()
    def calibrate_head(self, score: torch.Tensor) -> None:
        """Policy A: h* = the head of least mean attention entropy on calibration data, fixed from now on."""
        self.head.fill_(head_of_least_entropy(score))


def attention_entropy(score: torch.Tensor) -> torch.Tensor:
    """score [T, T, B, H] (masked with -inf) -> each head's mean row entropy [H]."""
    logp = torch.log_softmax(score.float(), dim=1)
    return -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(1).mean((0, 1))


def head_of_least_entropy(score: torch.Tensor) -> int:
    return int(attention_entropy(score).argmin())  # ties: the lowest head


class PositionwiseFF(nn.Module):
    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        self.CoreNet = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_inner),
            nn.ReLU(),
            nn.Dropout(cfg.dropout),
            nn.Linear(cfg.d_inner, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )
        self.layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(inp + self.CoreNet(inp))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TXLConfig, index: int, generator: ParameterGenerator | None = None) -> None:
        super().__init__()
        self.dec_attn = RelPartialLearnableMultiHeadAttn(cfg)
        self.pos_ff: nn.Module = PositionwiseFF(cfg)
        if cfg.method == "hypermoe" and index in cfg.moe_index:
            assert generator is not None
            self.pos_ff = HyperMoEPositionwiseFF(cfg, index, generator)
        elif cfg.method in ("similarity", "attention") and index in cfg.moe_index:
            self.pos_ff = GraphRoutingFF(cfg)
        elif cfg.method != "dense" and index in cfg.moe_index:
            self.pos_ff = MoEPositionwiseFF(cfg)

    def forward(self, h, r, r_w_bias, r_r_bias, mask):
        out = self.dec_attn(h, r, r_w_bias, r_r_bias, mask)
        if isinstance(self.pos_ff, GraphRoutingFF) and self.pos_ff.kind == "attention":
            self.pos_ff.attention = (*self.dec_attn.last, self.dec_attn.o_net.weight)
        return self.pos_ff(out)


class AdaptiveEmbedding(nn.Module):
    """div_val 1, no cutoffs: one embedding table scaled by sqrt(d_model)."""

    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        self.emb_layers = nn.ModuleList([nn.Embedding(cfg.vocab_size, cfg.d_model)])
        nn.init.normal_(self.emb_layers[0].weight, std=0.02)
        self.emb_scale = cfg.d_model**0.5

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.emb_layers[0](tokens) * self.emb_scale


class ProjectedAdaptiveLogSoftmax(nn.Module):
    """Full softmax with the output weight tied to the embedding and its own bias."""

    def __init__(self, cfg: TXLConfig, embedding: nn.Embedding) -> None:
        super().__init__()
        self.out_layers = nn.ModuleList([nn.Linear(cfg.d_model, cfg.vocab_size)])
        self.out_layers[0].weight = embedding.weight
        nn.init.zeros_(self.out_layers[0].bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out_layers[0](h)


class MemTransformerLM(nn.Module):
    def __init__(self, cfg: TXLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word_emb = AdaptiveEmbedding(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.param_gen = ParameterGenerator(cfg) if cfg.method == "hypermoe" else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.param_gen) for i in range(cfg.n_layer))
        self.pos_emb = PositionalEmbedding(cfg.d_model)
        self.r_w_bias = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))
        self.r_r_bias = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))
        self.crit = ProjectedAdaptiveLogSoftmax(cfg, self.word_emb.emb_layers[0])

    def set_top_k(self, k: int) -> None:
        for layer in self.layers:
            if isinstance(layer.pos_ff, MoEPositionwiseFF | HyperMoEPositionwiseFF | GraphRoutingFF):
                layer.pos_ff.top_k = k

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [bsz, qlen] -> logits [bsz, qlen, vocab]."""
        qlen = tokens.size(1)
        h = self.drop(self.word_emb(tokens.t()))  # [qlen, bsz, d]
        mask = torch.triu(torch.ones(qlen, qlen, dtype=torch.bool, device=tokens.device), diagonal=1)
        pos_seq = torch.arange(qlen - 1, -1, -1.0, device=tokens.device)
        r = self.drop(self.pos_emb(pos_seq))
        for layer in self.layers:
            h = layer(h, r, self.r_w_bias, self.r_r_bias, mask)
        return self.crit(self.drop(h)).transpose(0, 1)


@torch.no_grad()
def calibrate_heads(model: MemTransformerLM, tokens: torch.Tensor) -> list[int]:
    """Attention-aware routing, policy A: fix each MoE layer's h* from its attention on calibration tokens
    [B, T] (one forward in eval mode). -> h* per MoE layer, in layer order."""
    model.eval()
    model(tokens)  # every layer keeps its last attention scores (dec_attn.last)
    heads = []
    for layer in model.layers:
        if isinstance(layer.pos_ff, GraphRoutingFF) and layer.pos_ff.kind == "attention":
            layer.pos_ff.calibrate_head(layer.dec_attn.last[0])
            heads.append(int(layer.pos_ff.head))
    return heads


def k_schedule(step: int, total: int, k_min: int, k_max: int) -> int:
    """The official scripts' linear top-k schedule from k_min to k_max (Python rounding)."""
    return int(round(k_min + (k_max - k_min) * step / max(total - 1, 1)))


__all__ = ["MemTransformerLM", "TXLConfig", "calibrate_heads", "k_schedule", "switch_router_losses"]
