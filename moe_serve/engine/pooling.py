"""Whole-sequence forwards without a KV cache, batched in chunks of at most `batch_size` sequences (each
with its own k), turned into results: class probabilities -> ClassificationOutput, per-token
log-likelihoods -> ScoreOutput. The offline API and the serving loop both use these."""

from __future__ import annotations

import math

import torch

from moe_serve.engine.model_runner import ModelRunner
from moe_serve.model_config import ModelConfig
from moe_serve.outputs import ClassificationOutput, ScoreOutput
from moe_serve.tokenizer import Tokenizer


def _forward_chunks(runner: ModelRunner, token_ids: list[list[int]], ks: list[int], batch_size: int):
    """(sequences, hidden [B, L, D], token mask [B, L]) for each chunk of at most batch_size sequences."""
    for start in range(0, len(token_ids), batch_size):
        batch = token_ids[start : start + batch_size]
        yield batch, *runner.forward(batch, ks[start : start + batch_size])


@torch.inference_mode()
def class_probabilities(
    runner: ModelRunner, token_ids: list[list[int]], ks: list[int], batch_size: int
) -> list[list[float]]:
    return [
        row
        for _, hidden, mask in _forward_chunks(runner, token_ids, ks, batch_size)
        for row in torch.softmax(runner.model.class_logits(hidden, mask), dim=-1).tolist()
    ]


@torch.inference_mode()
def token_logprobs(
    runner: ModelRunner, token_ids: list[list[int]], ks: list[int], batch_size: int
) -> list[list[float]]:
    """For each sequence, log p(token_i | tokens_<i) for i >= 1 (len - 1 values)."""
    out: list[list[float]] = []
    for batch, hidden, _ in _forward_chunks(runner, token_ids, ks, batch_size):
        logprobs = torch.log_softmax(runner.model.lm_logits(hidden[:, :-1]), dim=-1)  # [B, L-1, V]
        targets = torch.zeros(logprobs.shape[:2], dtype=torch.long, device=logprobs.device)
        for row, ids in enumerate(batch):
            targets[row, : len(ids) - 1] = torch.tensor(ids[1:])
        values = logprobs.gather(-1, targets[..., None])[..., 0].tolist()
        out += [row[: len(ids) - 1] for row, ids in zip(values, batch, strict=True)]
    return out


def classify(
    runner: ModelRunner, token_ids: list[list[int]], ks: list[int], batch_size: int
) -> list[ClassificationOutput]:
    config: ModelConfig = runner.config
    assert config.classifier is not None
    labels = config.classifier.labels
    results = []
    for k, row in zip(ks, class_probabilities(runner, token_ids, ks, batch_size), strict=True):
        best = max(range(len(labels)), key=row.__getitem__)
        results.append(
            ClassificationOutput(
                labels[best], dict(zip(labels, row, strict=True)), config.reported_k(k), config.is_approximate(k)
            )
        )
    return results


def score(
    runner: ModelRunner,
    tokenizer: Tokenizer,
    token_ids: list[list[int]],
    ks: list[int],
    batch_size: int,
    keep_token_logprobs: bool,
) -> list[ScoreOutput]:
    per_token = token_logprobs(runner, token_ids, ks, batch_size)
    return [
        score_output(tokenizer, ids, values, runner.config.reported_k(k), keep_token_logprobs)
        for ids, values, k in zip(token_ids, per_token, ks, strict=True)
    ]


def score_output(
    tokenizer: Tokenizer, ids: list[int], per_token: list[float], k: int | None, keep_tokens: bool
) -> ScoreOutput:
    """Totals for one scored sequence; bytes are those of the scored tokens (special tokens count 0)."""
    num_bytes = len(tokenizer.decode(ids[1:]).encode("utf-8"))
    total = float(sum(per_token))
    return ScoreOutput(
        total_logprob=total,
        num_tokens=len(ids) - 1,
        num_bytes=num_bytes,
        bits_per_byte=-total / math.log(2) / max(num_bytes, 1),
        experts_per_token=k,
        token_logprobs=per_token if keep_tokens else None,
    )
