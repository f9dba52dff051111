"""Quality against k on a held-out dataset: bits per byte for language models, accuracy and macro-F1 for
classifiers, one QualityRow per (k, metric)."""

from __future__ import annotations

from tqdm.auto import tqdm

from moe_serve.errors import ValidationError
from moe_serve.evaluation.metrics import bits_per_byte, classification_metrics
from moe_serve.llm import LLM
from moe_serve.quality import QualityRow

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
    llm: LLM, ks: list[int], dataset: str = "shakespeare", max_items: int | None = None, progress: bool = True
) -> list[QualityRow]:
    task, name = llm.config.task, llm.artifact.name
    items = dataset_inputs(dataset, task, max_items, llm.inputs.max_model_len)
    texts = [text for text, _ in items]
    rows = []
    with tqdm(total=len(ks) * len(texts), desc=f"eval {name}", unit="text", disable=not progress) as bar:
        for k in ks:
            request_k = k if llm.config.moe else None
            llm.inputs.resolve_k(request_k)
            if task == "causal_lm":
                logprob, num_bytes = 0.0, 0
                for start in range(0, len(texts), BATCH):
                    for score in llm.score(texts[start : start + BATCH], experts_per_token=request_k):
                        logprob += score.total_logprob
                        num_bytes += score.num_bytes
                    bar.update(min(BATCH, len(texts) - start))
                metrics = {"bits_per_byte": bits_per_byte(logprob, num_bytes)}
            else:
                predictions = []
                for start in range(0, len(texts), BATCH):
                    predictions += [
                        c.label for c in llm.classify(texts[start : start + BATCH], experts_per_token=request_k)
                    ]
                    bar.update(min(BATCH, len(texts) - start))
                metrics = classification_metrics([label or "" for _, label in items], predictions)
            rows += [QualityRow(dataset, k, metric, value, name) for metric, value in metrics.items()]
    return rows
