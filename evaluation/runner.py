"""Quality against k on a held-out dataset: bits per byte for language models, accuracy and macro-F1 for
classifiers, one QualityRow per (k, metric), and per (adaptive policy, metric) at its measured mean k."""

from __future__ import annotations

import logging

from tqdm.auto import tqdm

from moe_serve.errors import ValidationError
from moe_serve.evaluation.metrics import bits_per_byte, classification_metrics
from moe_serve.llm import LLM
from moe_serve.moe_policy import MoEPolicy
from moe_serve.outputs import ExpertCounts
from moe_serve.quality import QualityRow

logger = logging.getLogger(__name__)

DATASETS = ("shakespeare",)
LM_WINDOW = 512  # characters per scored window (the first token of each window has no context)
CLASSIFY_PASSAGE = 256  # characters per passage, as in the classifier recipes
BATCH = 64  # texts per engine call


def dataset_inputs(dataset: str, task: str, max_items: int | None, max_len: int) -> list[tuple[str, str | None]]:
    """(text, label) pairs of the held-out split: LM windows (label None) or labelled passages, cut to
    fit a context of max_len tokens (half of it, leaving room for multi-byte characters and BOS)."""
    if dataset not in DATASETS:
        raise ValidationError(f"unknown dataset {dataset!r}; available: {', '.join(DATASETS)}", parameter="dataset")
    from moe_serve.evaluation.datasets import shakespeare

    plays = shakespeare.split(held_out=True)
    if task == "causal_lm":
        window = min(LM_WINDOW, max_len // 2)
        items: list[tuple[str, str | None]] = [(text, None) for text, _ in shakespeare.passages(plays, window)]
    else:
        items = list(shakespeare.passages(plays, min(CLASSIFY_PASSAGE, max_len // 2)))
    if max_items and len(items) > max_items:  # an even sample across every held-out play, not the first ones
        step = len(items) / max_items
        items = [items[int(i * step)] for i in range(max_items)]
    return items


def evaluate(
    llm: LLM,
    ks: list[int],
    dataset: str = "shakespeare",
    max_items: int | None = None,
    progress: bool = True,
    policies: list[MoEPolicy] | None = None,
) -> list[QualityRow]:
    """Rows at each fixed k, then at each adaptive policy: those carry the policy's name and, as their k,
    the mean k its tokens took (so they sit on the quality-vs-k plot where they cost)."""
    task, name = llm.config.task, llm.artifact.name
    items = dataset_inputs(dataset, task, max_items, llm.inputs.max_model_len)
    texts = [text for text, _ in items]
    # (k of the row, k asked for, policy): a dense model is asked for no k; its rows keep the k given.
    runs: list[tuple[int | None, int | None, MoEPolicy | None]] = [(k, k if llm.config.moe else None, None) for k in ks]
    runs += [(None, None, p) for p in policies or []]
    for _, k, policy in runs:  # every run is checked before the first starts
        llm.inputs.resolve(k, policy)
    rows = []
    with tqdm(total=len(runs) * len(texts), desc=f"eval {name}", unit="text", disable=not progress) as bar:
        for fixed_k, k, policy in runs:
            results: list = []
            for start in range(0, len(texts), BATCH):
                chunk = texts[start : start + BATCH]
                run = llm.score if task == "causal_lm" else llm.classify
                results += run(chunk, experts_per_token=k, moe=policy)
                bar.update(len(chunk))
            if task == "causal_lm":
                logprob, num_bytes = sum(r.total_logprob for r in results), sum(r.num_bytes for r in results)
                metrics = {"bits_per_byte": bits_per_byte(logprob, num_bytes)}
            else:
                metrics = classification_metrics([label or "" for _, label in items], [r.label for r in results])
            # A policy's row sits on the plot where it costs: at the mean k its tokens took.
            row_k = fixed_k if policy is None else ExpertCounts.total(r.experts for r in results).mean
            assert row_k is not None, "a policy runs on an MoE model, which counts every scored token's experts"
            label = policy.name if policy is not None else None
            weights = llm.artifact.weights_label
            rows += [
                QualityRow(dataset, row_k, metric, value, name, label, weights) for metric, value in metrics.items()
            ]
    return rows


def weight_divergence(
    reference: LLM,
    packed: dict[str, LLM],
    ks: list[int],
    dataset: str = "shakespeare",
    max_items: int | None = None,
    metric: str = "kl_from_float",
) -> list[QualityRow]:
    """For a language model: each packed model's mean KL divergence (nats per token) of its next-token
    distributions from the reference's (the float weights, or for `kl_from_fp32_activations` its format's with
    fp32 activations) on the dataset's texts, at each k; and its routers' top-k set agreement with the
    reference's (`topk_agreement_with_float` or `_with_fp32_activations`: the mean over MoE layers; `..._worst_layer`:
    the lowest layer's)."""
    from moe_serve.evaluation.divergence import divergence_from_reference

    if reference.config.task != "causal_lm":
        return []
    items = dataset_inputs(dataset, "causal_lm", max_items, reference.inputs.max_model_len)
    token_ids = [reference.inputs.check_score_input(reference.inputs.encode_text(text, "input")) for text, _ in items]
    model = _torch_model(reference)
    agreement = metric.replace("kl_from_", "topk_agreement_with_")
    rows = []
    for k in ks:
        found = divergence_from_reference(model, {fmt: _torch_model(llm) for fmt, llm in packed.items()}, token_ids, k)
        for fmt, d in found.items():
            values = {metric: d.kl}
            if d.topk_agreement:
                values |= {agreement: sum(d.topk_agreement) / len(d.topk_agreement)}
                values |= {f"{agreement}_worst_layer": min(d.topk_agreement)}
                logger.info(
                    "%s %s k=%d: top-k agreement per MoE layer %s",
                    reference.artifact.name,
                    fmt,
                    k,
                    " ".join(f"{a:.4f}" for a in d.topk_agreement),
                )
            rows += [QualityRow(dataset, k, m, v, reference.artifact.name, None, fmt) for m, v in values.items()]
    return rows


def _torch_model(llm: LLM):
    from moe_serve.artifact import Artifact

    if not isinstance(llm.artifact, Artifact):
        raise ValidationError("comparing weight formats needs the torch backend", parameter="backend")
    return llm.artifact.model
