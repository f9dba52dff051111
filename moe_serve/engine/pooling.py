"""Results of scored and classified inputs (finished SCORE and CLASSIFY sequences), for the offline API and
the serving loop alike."""

from __future__ import annotations

import math

from moe_serve.engine.sequence import Sequence
from moe_serve.model_config import ModelConfig
from moe_serve.outputs import ClassificationOutput, ScoreOutput
from moe_serve.tokenizer import Tokenizer


def classification_output(config: ModelConfig, seq: Sequence) -> ClassificationOutput:
    assert config.classifier is not None and seq.class_probs is not None
    labels, probs = config.classifier.labels, seq.class_probs
    best = max(range(len(labels)), key=probs.__getitem__)
    return ClassificationOutput(
        labels[best],
        dict(zip(labels, probs, strict=True)),
        config.reported_k(seq.k_spec),
        config.is_approximate(seq.k_spec),
        seq.experts(config.moe_layers),
    )


def score_output(config: ModelConfig, tokenizer: Tokenizer, seq: Sequence, keep_tokens: bool) -> ScoreOutput:
    """Totals for one scored sequence; bytes are those of the scored tokens (special tokens count 0)."""
    ids, per_token = seq.token_ids, seq.prompt_logprobs
    num_bytes = len(tokenizer.decode(ids[1:]).encode("utf-8"))
    total = float(sum(per_token))
    return ScoreOutput(
        total_logprob=total,
        num_tokens=len(ids) - 1,
        num_bytes=num_bytes,
        bits_per_byte=-total / math.log(2) / max(num_bytes, 1),
        experts_per_token=config.reported_k(seq.k_spec),
        token_logprobs=list(per_token) if keep_tokens else None,
        top_logprobs=list(seq.prompt_top_logprobs) if keep_tokens and seq.params.logprobs else None,
        experts=seq.experts(config.moe_layers),
    )
