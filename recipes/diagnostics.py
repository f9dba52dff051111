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
The initial model is rebuilt from the run's seed: `recipes.train` seeds torch and then builds the model
before drawing anything else, so the same seed gives the same initial weights.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
from collections.abc import Iterator
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


@torch.no_grad()
def bits_per_byte(model: MemTransformerLM, data: torch.Tensor, seq_len: int) -> float:
    windows = data[: len(data) // (seq_len + 1) * (seq_len + 1)].view(-1, seq_len + 1)
    total, count = 0.0, 0
    for chunk in windows.split(32):
        logits = model(chunk[:, :-1])
        total -= F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum").item()
        count += chunk[:, 1:].numel()
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

    handles = [ff.register_forward_pre_hook(hook(i)) for i, ff in enumerate(layers)]
    try:
        windows = data[: len(data) // seq_len * seq_len].view(-1, seq_len)
        for chunk in windows.split(32):
            model(chunk)
    finally:
        for handle in handles:
            handle.remove()
    return [round(t / max(c, 1), 4) for t, c in zip(totals, counts, strict=True)]


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
    swap = {}
    for k in ks:
        model.set_top_k(k)
        trained = bits_per_byte(model, data, seq_len)
        with initial_routers(model, initial):
            reset = bits_per_byte(model, data, seq_len)
        swap[str(k)] = {
            "trained": round(trained, 4),
            "initial_router": round(reset, 4),
            "delta": round(reset - trained, 4),
        }
    model.set_top_k(ks[-1])
    return {
        "held_out_bytes": len(data),
        "movement": movement,
        "swap_to_init_bits_per_byte": swap,
        "routing_entropy_nats": routing_entropy(model, data, seq_len),
        "uniform_entropy_nats": round(math.log(model.cfg.num_experts), 4),
    }


def rebuild(run: Path, record: dict) -> tuple[MemTransformerLM, MemTransformerLM]:
    """-> (trained model, initial model) of a recipes.train run directory and its training record."""
    model_config = {k: tuple(v) if isinstance(v, list) else v for k, v in record["model"].items()}
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
    held_out = byte_stream(True)
    for run in args.runs:
        record = json.loads((run / TRAINING_CONFIG).read_text())
        if record.get("task") != "causal_lm" or record.get("method") == "dense":
            raise SystemExit(f"{run}: not an MoE language model run")
        model, initial = rebuild(run, record)
        found = router_diagnostics(model, initial, held_out, record["seq_len"], diagnostic_ks(model.cfg))
        record.setdefault("metrics", {})["diagnostics"] = found  # where train.py puts them (provenance: metrics)
        (run / TRAINING_CONFIG).write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps({"run": str(run), **found}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
