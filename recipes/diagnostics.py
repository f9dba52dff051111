"""Does a trained LM's router matter? Router diagnostics for every MoE LM recipe.

    python -m recipes.diagnostics RUN_DIR [RUN_DIR ...]   # (re)compute them for trained runs

- movement: per MoE layer, how far the effective router (W_r | b_r: H(e) for HyperRouter, the gate's
  weight and bias otherwise) moved from its initial value: ||W - W0|| / ||W0|| and cos(W, W0); HyperRouter
  also for its trainable embedding e.
- swap_to_init: held-out bits per byte at each k with every MoE layer's router put back to its initial
  value, minus the trained model's. A router that learned nothing costs ~0 here.
- entropy: per MoE layer, the mean entropy (nats; uniform = ln N) of the distribution experts are chosen
  from on held-out text: the full router softmax (HyperRouter Table 4's measure), for graph-of-tokens
  routers the mixed distribution.
- load: per MoE layer, the fraction of held-out tokens each expert gets at the trained k (what a
  load-balancing loss evens out).
- plain_routing (graph-of-tokens routers only): held-out bits per byte at each k with the same weights
  routed by plain top-k of each token's own gate probabilities (the graph mixing switched off), minus
  the trained model's; and the fraction of (token, MoE layer) whose chosen set the mixing changes. A
  mixing matrix close to the identity costs ~0 here.
- fixed_hyper_expert (HyperMoE only): held-out bits per byte at each k with every token of a MoE layer
  given the same HyperExpert, the one generated for the layer's most-used set (its k most loaded experts
  at the trained k) whatever the token selected, minus the trained model's. A HyperExpert that does not
  depend on the selection costs ~0 here.
The initial model is rebuilt from the run's seed: `recipes.train` seeds torch and then builds the model
before drawing anything else, so the same seed gives the same initial weights.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.nn import functional as F

from moe_serve.evaluation import metrics
from moe_serve.exporters.base import TRAINING_CHECKPOINT, TRAINING_CONFIG
from recipes.transformer_xl import (
    GraphRoutingFF,
    HyperMoEPositionwiseFF,
    HyperRouterGate,
    MemTransformerLM,
    MoEPositionwiseFF,
    TXLConfig,
)

MOE_FFS = (MoEPositionwiseFF, HyperMoEPositionwiseFF, GraphRoutingFF)
EVAL_BYTES = 65536  # the slice of the held-out plays that train.py's quick figures use


def moe_layers(model: MemTransformerLM) -> list[torch.nn.Module]:
    return [layer.pos_ff for layer in model.layers if isinstance(layer.pos_ff, MOE_FFS)]


def effective_router(ff: torch.nn.Module) -> torch.Tensor:
    """[N, d + 1] (W | b; b = 0 for a gate without bias), as the exporters fold it."""
    gate = ff.gate
    if isinstance(gate, HyperRouterGate):
        weight, bias = gate.router()
    else:
        weight = gate.gate.weight
        bias = gate.gate.bias if gate.gate.bias is not None else torch.zeros(weight.shape[0])
    return torch.cat([weight, bias[:, None]], dim=1).detach().float()


def _movement(now: torch.Tensor, start: torch.Tensor) -> dict[str, float]:
    return {
        "relative_change": round(((now - start).norm() / start.norm()).item(), 4),
        "cosine_to_init": round(F.cosine_similarity(now.flatten(), start.flatten(), dim=0).item(), 4),
    }


def lm_rows(data: torch.Tensor, starts: Iterable[int], seq_len: int, bos_token_id: int | None) -> torch.Tensor:
    """Training or evaluation rows [B, seq_len + 1] (inputs row[:-1], targets row[1:]) from `data` at each
    start. With a BOS: BOS, then seq_len tokens of data, every one a target (the first predicted from BOS
    alone, as a served prompt starts); without: seq_len + 1 tokens of data, the first never a target."""
    starts = list(starts)
    if bos_token_id is None:
        return torch.stack([data[s : s + seq_len + 1] for s in starts])
    body = torch.stack([data[s : s + seq_len] for s in starts])
    return torch.cat([body.new_full((len(starts), 1), bos_token_id), body], dim=1)


def eval_rows(data: torch.Tensor, seq_len: int, bos_token_id: int | None) -> torch.Tensor:
    """Consecutive rows that make every token of `data` a target once (with a BOS; without, all but the
    first of each row)."""
    stride = seq_len if bos_token_id is not None else seq_len + 1
    return lm_rows(data, range(0, len(data) - stride + 1, stride), seq_len, bos_token_id)


@torch.no_grad()
def bits_per_byte(model: MemTransformerLM, data: torch.Tensor, seq_len: int) -> float:
    """Held-out bits per byte over `data`; EOS targets (the end of a play) are not bytes and not counted."""
    rows = eval_rows(data, seq_len, model.cfg.bos_token_id)
    eos = model.cfg.eos_token_id
    total, count = 0.0, 0
    for chunk in rows.split(32):
        logits = model(chunk[:, :-1])
        targets = chunk[:, 1:].reshape(-1)
        ignore = -100 if eos is None else eos
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, reduction="sum", ignore_index=ignore)
        total -= loss.item()
        count += int((targets != ignore).sum())
    return metrics.bits_per_byte(total, count)  # byte-level: one token per byte


@torch.no_grad()
def routing_entropy(model: MemTransformerLM, data: torch.Tensor, seq_len: int) -> list[float]:
    """Mean entropy (nats) per MoE layer of routing_distribution on windows of `data`."""
    layers = moe_layers(model)
    totals, counts = [0.0] * len(layers), [0] * len(layers)

    def hook(index: int):
        def record(module, args) -> None:
            p = module.routing_distribution(args[0]).clamp_min(1e-30)
            totals[index] += -(p * p.log()).sum(-1).sum().item()
            counts[index] += p.shape[0]

        return record

    _run_hooked(model, data, seq_len, [ff.register_forward_pre_hook(hook(i)) for i, ff in enumerate(layers)])
    return [round(t / max(c, 1), 4) for t, c in zip(totals, counts, strict=True)]


def _run_hooked(model: MemTransformerLM, data: torch.Tensor, seq_len: int, handles: list) -> None:
    """The model over evaluation rows of `data` (inputs only) with forward hooks that record; removed after."""
    try:
        for chunk in eval_rows(data, seq_len, model.cfg.bos_token_id)[:, :-1].split(32):
            model(chunk)
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def expert_load(model: MemTransformerLM, data: torch.Tensor, seq_len: int) -> list[list[float]]:
    """Per MoE layer, the fraction of `data`'s tokens each expert is chosen for at the model's current k
    (the top-k of routing_distribution: what every MoE layer here picks from)."""
    layers = moe_layers(model)
    counts = [torch.zeros(model.cfg.num_experts) for _ in layers]

    def hook(index: int):
        def record(module, args) -> None:
            chosen = module.routing_distribution(args[0]).topk(module.top_k, dim=-1).indices
            counts[index] += torch.bincount(chosen.flatten(), minlength=len(counts[index])).float()

        return record

    _run_hooked(model, data, seq_len, [ff.register_forward_pre_hook(hook(i)) for i, ff in enumerate(layers)])
    return [[round(c, 4) for c in (layer / layer.sum().clamp_min(1)).tolist()] for layer in counts]


def graph_layers(model: MemTransformerLM) -> list[GraphRoutingFF]:
    return [ff for ff in moe_layers(model) if isinstance(ff, GraphRoutingFF)]


@contextlib.contextmanager
def plain_routing(model: MemTransformerLM) -> Iterator[MemTransformerLM]:
    """The same weights with every graph-of-tokens router's mixing switched off (plain top-k of each
    token's own gate probabilities); restored on exit."""
    layers = graph_layers(model)
    try:
        for ff in layers:
            ff.use_graph = False
        yield model
    finally:
        for ff in layers:
            ff.use_graph = True


@torch.no_grad()
def choices_changed(model: MemTransformerLM, data: torch.Tensor, seq_len: int, ks: list[int]) -> dict[str, float]:
    """At each k, the fraction of (token, graph MoE layer) whose chosen set differs between the mixed
    distribution and the token's own gate probabilities (the same layer input)."""
    changed, total = dict.fromkeys(ks, 0), 0

    def record(module, args) -> None:
        nonlocal total
        mixed = module.routing_distribution(args[0])
        module.use_graph = False
        try:
            plain = module.routing_distribution(args[0])
        finally:
            module.use_graph = True
        for k in ks:
            a = mixed.topk(k, dim=-1).indices.sort(dim=-1).values
            b = plain.topk(k, dim=-1).indices.sort(dim=-1).values
            changed[k] += int((a != b).any(dim=-1).sum())
        total += mixed.shape[0]

    _run_hooked(model, data, seq_len, [ff.register_forward_pre_hook(record) for ff in graph_layers(model)])
    return {str(k): round(changed[k] / max(total, 1), 4) for k in ks}


def hypermoe_layers(model: MemTransformerLM) -> list[HyperMoEPositionwiseFF]:
    return [ff for ff in moe_layers(model) if isinstance(ff, HyperMoEPositionwiseFF)]


@contextlib.contextmanager
def fixed_hyper_expert(model: MemTransformerLM, load: list[list[float]]) -> Iterator[MemTransformerLM]:
    """The same weights with every token of each HyperMoE layer given the HyperExpert of that layer's
    most-used set at the current k (the k experts with the largest share of `load`, expert_load at the
    trained k), whatever set the token selected; the experts it selected still run. Restored on exit."""
    layers = hypermoe_layers(model)
    try:
        for ff, shares in zip(layers, load, strict=True):
            fixed = torch.tensor(shares).topk(ff.top_k).indices.sort().values

            def generate(x: torch.Tensor, indices: torch.Tensor, ff=ff, fixed=fixed) -> torch.Tensor:
                return type(ff).hyper_expert(ff, x, fixed.expand(x.shape[0], -1))

            ff.hyper_expert = generate  # an instance attribute over the class's method
        yield model
    finally:
        for ff in layers:
            ff.__dict__.pop("hyper_expert", None)


@contextlib.contextmanager
def initial_routers(model: MemTransformerLM, initial: MemTransformerLM) -> Iterator[MemTransformerLM]:
    """The trained model with every router (the gate: e for HyperRouter, whose frozen hypernetwork never
    moved; W, b otherwise) at its initial value, experts and backbone trained; restored on exit."""
    trained = [copy.deepcopy(ff.gate.state_dict()) for ff in moe_layers(model)]
    try:
        for ff, start in zip(moe_layers(model), moe_layers(initial), strict=True):
            ff.gate.load_state_dict(start.gate.state_dict())
        yield model
    finally:
        for ff, state in zip(moe_layers(model), trained, strict=True):
            ff.gate.load_state_dict(state)


def _delta(trained: float, name: str, served: float) -> dict[str, float]:
    """One k of a same-weights test: the trained model's bits per byte, the other serving's (`name`), and
    their difference."""
    return {"trained": round(trained, 4), name: round(served, 4), "delta": round(served - trained, 4)}


@torch.no_grad()
def router_diagnostics(
    model: MemTransformerLM, initial: MemTransformerLM, held_out: torch.Tensor, seq_len: int, ks: list[int]
) -> dict:
    """Everything in the module docstring for a trained model (eval mode) and its initial weights."""
    model.eval()
    data = held_out[:EVAL_BYTES]
    movement = []
    for ff, start in zip(moe_layers(model), moe_layers(initial), strict=True):
        layer = _movement(effective_router(ff), effective_router(start))
        if isinstance(ff.gate, HyperRouterGate):
            layer["embedding"] = _movement(ff.gate.embedding.detach(), start.gate.embedding.detach())
        movement.append(layer)
    model.set_top_k(model.cfg.top_k_max)
    load = expert_load(model, data, seq_len)  # at the trained k
    graph, hyper = bool(graph_layers(model)), bool(hypermoe_layers(model))
    swap, plain, fixed = {}, {}, {}
    for k in ks:
        model.set_top_k(k)
        trained = bits_per_byte(model, data, seq_len)
        with initial_routers(model, initial):
            swap[str(k)] = _delta(trained, "initial_router", bits_per_byte(model, data, seq_len))
        if graph:
            with plain_routing(model):
                plain[str(k)] = _delta(trained, "plain", bits_per_byte(model, data, seq_len))
        if hyper:
            with fixed_hyper_expert(model, load):
                fixed[str(k)] = _delta(trained, "fixed", bits_per_byte(model, data, seq_len))
    model.set_top_k(model.cfg.top_k_max)  # the trained k (the end of the schedule)
    found = {
        "held_out_bytes": len(data),
        "trained_k": model.cfg.top_k_max,
        "movement": movement,
        "swap_to_init_bits_per_byte": swap,
        "routing_entropy_nats": routing_entropy(model, data, seq_len),
        "uniform_entropy_nats": round(math.log(model.cfg.num_experts), 4),
        "expert_load": load,
    }
    if plain:
        found["plain_routing_bits_per_byte"] = plain
        found["plain_routing_choices_changed"] = choices_changed(model, data, seq_len, ks)
    if fixed:
        found["fixed_hyper_expert_bits_per_byte"] = fixed
    return found


def rebuild(run: Path, record: dict) -> tuple[MemTransformerLM, MemTransformerLM]:
    """-> (trained model, initial model) of a recipes.train run directory and its training record."""
    model_config = {k: tuple(v) if isinstance(v, list) else v for k, v in record["model"].items()}
    for special in ("bos_token_id", "eos_token_id"):  # a run from before the LMs trained with BOS and EOS
        model_config.setdefault(special, None)
    torch.manual_seed(record["seed"])
    initial = MemTransformerLM(TXLConfig(**model_config))
    model = copy.deepcopy(initial)
    model.load_state_dict(load_file(str(run / TRAINING_CHECKPOINT)))
    return model, initial


def main(argv: list[str] | None = None) -> int:
    from recipes.train import byte_stream, diagnostic_ks

    parser = argparse.ArgumentParser(prog="python -m recipes.diagnostics", description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="recipes.train output directories (MoE LMs)")
    args = parser.parse_args(argv)
    for run in args.runs:
        record = json.loads((run / TRAINING_CONFIG).read_text())
        if record.get("task") != "causal_lm" or record.get("method") == "dense":
            raise SystemExit(f"{run}: not an MoE language model run")
        model, initial = rebuild(run, record)
        held_out = byte_stream(True, model.cfg.eos_token_id)
        found = router_diagnostics(model, initial, held_out, record["seq_len"], diagnostic_ks(model.cfg))
        record.setdefault("metrics", {})["diagnostics"] = found  # where train.py puts them (provenance: metrics)
        (run / TRAINING_CONFIG).write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps({"run": str(run), **found}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
