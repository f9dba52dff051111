"""Whole-sequence forwards without a KV cache: class probabilities and per-token log-likelihoods,
batched in chunks of at most `batch_size` sequences (each with its own k)."""

from __future__ import annotations

import torch

from moe_serve.engine.model_runner import ModelRunner


@torch.inference_mode()
def class_probabilities(runner: ModelRunner, token_ids: list[list[int]], ks: list[int], batch_size: int) -> list[list[float]]:
    out: list[list[float]] = []
    for start in range(0, len(token_ids), batch_size):
        hidden, mask = runner.forward(token_ids[start : start + batch_size], ks[start : start + batch_size])
        out += torch.softmax(runner.model.class_logits(hidden, mask), dim=-1).tolist()
    return out


@torch.inference_mode()
def token_logprobs(runner: ModelRunner, token_ids: list[list[int]], ks: list[int], batch_size: int) -> list[list[float]]:
    """For each sequence, log p(token_i | tokens_<i) for i >= 1 (len - 1 values)."""
    out: list[list[float]] = []
    for start in range(0, len(token_ids), batch_size):
        batch = token_ids[start : start + batch_size]
        hidden, _ = runner.forward(batch, ks[start : start + batch_size])
        logprobs = torch.log_softmax(runner.model.lm_logits(hidden[:, :-1]), dim=-1)  # [B, L-1, V]
        targets = torch.zeros(logprobs.shape[:2], dtype=torch.long, device=logprobs.device)
        for row, ids in enumerate(batch):
            targets[row, : len(ids) - 1] = torch.tensor(ids[1:])
        values = logprobs.gather(-1, targets[..., None])[..., 0].tolist()
        out += [row[: len(ids) - 1] for row, ids in zip(values, batch)]
    return out
