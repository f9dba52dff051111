"""Exported ONNX graphs (`moe-serve export-onnx`, docs/architecture.md §7): their interface, and a small onnxruntime
driver that checks each row's k against the model's range and runs the causal LM (prefill, then decode
with the KV cache) or the classifier. The seed of the onnxruntime runner; onnxruntime is the `onnx` extra
and is imported only here, when a graph is opened.

The interface (one owner: the exporter imports these names):
- causal LM: input_ids [B, T] int64, attention_mask [B, P + T] int64 (1 for real tokens, past included;
  rows may be left-padded), experts_per_token [B] int64, past_key_values.{i}.key/.value [B, G, P, Dh]
  fp32 -> logits [B, T, V], present.{i}.key/.value [B, G, P + T, Dh]. One graph for prefill (P = 0) and
  decode (T = 1).
- classifier: input_ids [B, T], attention_mask [B, T], experts_per_token [B] -> logits [B, C], probs [B, C].
- both, when the model has MoE layers, last: expert_counts [L_moe, N] int64, the real tokens routed to each
  expert in each MoE layer during the run (the expert-load metrics; padding and slots beyond k count none).
- metadata_props under `moe_serve.`: format, task, experts_per_token (default/min/max), labels, the model
  config, the tokenizer (tokenizer.json text), provenance, and the source's quality table (quality.json
  text) when it has one.

The graph cannot raise an error, so a k outside the range is refused here, before the graph runs: in the
graph, slots up to K = the model's max k exist and a larger k would silently mean K.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from moe_serve.errors import ArtifactError, ValidationError
from moe_serve.layers import routers  # noqa: F401  (registers the router kinds a config names, before parsing)
from moe_serve.model_config import ModelConfig
from moe_serve.quality import QualityTable
from moe_serve.tokenizer import Tokenizer
from moe_serve.validation import check_int

FORMAT = "moe-serve-onnx"
FORMAT_VERSION = "2"  # 2: expert_counts output
GRAPH_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"  # the weights, when they are stored beside the graph (large models)
META = "moe_serve."  # prefix of every metadata key
INPUTS = ("input_ids", "attention_mask", "experts_per_token")
CLASSIFIER_OUTPUTS = ("logits", "probs")
EXPERT_COUNTS = "expert_counts"


def past_names(num_layers: int) -> list[str]:
    return [f"past_key_values.{i}.{part}" for i in range(num_layers) for part in ("key", "value")]


def present_names(num_layers: int) -> list[str]:
    return [f"present.{i}.{part}" for i in range(num_layers) for part in ("key", "value")]


def is_export(path: Path) -> bool:
    """Whether `path` is an export directory (or graph file) rather than a moe-serve artifact."""
    return (path / GRAPH_FILE).is_file() or (path.suffix == ".onnx" and path.is_file())


def read_metadata(props: dict[str, str], where: str) -> tuple[ModelConfig, Tokenizer]:
    """The config and tokenizer an exported graph carries; an ArtifactError naming what is missing."""
    if props.get(META + "format") != FORMAT:
        raise ArtifactError(f"{where} is not a moe-serve ONNX export (no {META}format metadata)")
    if props.get(META + "format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{where}: unknown {META}format_version {props.get(META + 'format_version')!r}; this runtime reads "
            f"{FORMAT_VERSION}"
        )
    try:
        config = ModelConfig.from_dict(json.loads(props[META + "config"]))
        tokenizer = Tokenizer(HFTokenizer.from_str(props[META + "tokenizer"]))
    except KeyError as exc:
        raise ArtifactError(f"{where} has no {exc.args[0]} metadata") from None
    return config, tokenizer


class OnnxModel:
    """An exported graph opened with onnxruntime (CPU unless `providers` says otherwise)."""

    def __init__(self, path: str | Path, providers: list[str] | None = None) -> None:
        try:
            import onnxruntime
        except ImportError:
            raise ArtifactError("onnxruntime is not installed: pip install 'moe-serve[onnx]'") from None
        path = Path(path)
        graph = path / GRAPH_FILE if path.is_dir() else path
        if not graph.is_file():
            raise ArtifactError(f"{path} has no {GRAPH_FILE}")
        self.session = onnxruntime.InferenceSession(str(graph), providers=providers or ["CPUExecutionProvider"])
        props = self.session.get_modelmeta().custom_metadata_map
        self.config, self.tokenizer = read_metadata(props, str(graph))
        # The source artifact's quality table, when it had one (dashboards and /metrics show it).
        quality = props.get(META + "quality")
        self.quality = QualityTable.parse(quality, f"{graph} {META}quality") if quality else None

    # ---- inputs ---------------------------------------------------------------------------------

    def experts_per_token(self, ks: int | list[int | None] | None, batch: int) -> np.ndarray:
        """Each row's k ([B] int64): the default where None, each checked against the model's range."""
        values = ks if isinstance(ks, list) else [ks] * batch
        if len(values) != batch:
            raise ValidationError(f"experts_per_token has {len(values)} entries for {batch} rows")
        moe = self.config.moe
        out = []
        for k in values:
            if moe is None:
                if k is not None:
                    raise ValidationError("experts_per_token was given but this model has no MoE layers")
                out.append(1)  # the graph ignores it
                continue
            k = moe.default_k if k is None else k
            check_int("experts_per_token", k, moe.min_k, moe.max_k)
            out.append(k)
        return np.asarray(out, dtype=np.int64)

    def _check_length(self, tokens: int) -> None:
        limit = self.config.max_position_embeddings
        if tokens > limit:
            raise ValidationError(f"{tokens} tokens exceed the model's context of {limit} positions")

    def empty_past(self, batch: int) -> list[np.ndarray]:
        config = self.config
        assert config.num_kv_heads is not None and config.head_dim is not None  # completed by ModelConfig
        shape = (batch, config.num_kv_heads, 0, config.head_dim)
        return [np.zeros(shape, dtype=np.float32) for _ in range(2 * config.num_layers)]

    # ---- runs -----------------------------------------------------------------------------------

    def run(self, feeds: dict[str, Any]) -> list[np.ndarray]:
        # A graph drops an input it never reads (experts_per_token of a model without MoE layers).
        names = {i.name for i in self.session.get_inputs()}
        return self.session.run(None, {name: value for name, value in feeds.items() if name in names})

    def lm_step(
        self,
        input_ids: np.ndarray,  # [B, T]
        attention_mask: np.ndarray,  # [B, P + T]
        experts_per_token: np.ndarray,  # [B], from experts_per_token()
        past: list[np.ndarray] | None = None,
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """One causal-LM run -> logits [B, T, V] and the present keys/values (the next step's past)."""
        self._require_task("causal_lm")
        self._check_length(attention_mask.shape[1])
        past = past if past is not None else self.empty_past(input_ids.shape[0])
        feeds = dict(zip(INPUTS, (input_ids, attention_mask, experts_per_token), strict=True))
        feeds.update(zip(past_names(self.config.num_layers), past, strict=True))
        logits, *present = self.run(feeds)
        return logits, present[: 2 * self.config.num_layers]  # without expert_counts

    def generate_greedy(
        self, prompts: list[list[int]], max_tokens: int, experts_per_token: int | list[int | None] | None = None
    ) -> list[list[int]]:
        """Greedy continuation of each prompt, all rows in one batch (left-padded, each with its own k):
        one prefill, then one decode run per token, reading the KV cache."""
        ks = self.experts_per_token(experts_per_token, len(prompts))
        check_int("max_tokens", max_tokens, 1)
        width = max(len(p) for p in prompts)
        self._check_length(width + max_tokens - 1)
        ids = np.zeros((len(prompts), width), dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = prompt
            mask[row, width - len(prompt) :] = 1
        logits, past = self.lm_step(ids, mask, ks)
        out: list[list[int]] = [[] for _ in prompts]
        for step in range(max_tokens):
            next_ids = logits[:, -1].argmax(-1)  # first maximum, as torch.argmax
            for row, token in enumerate(next_ids.tolist()):
                out[row].append(token)
            if step + 1 == max_tokens:
                break
            mask = np.concatenate([mask, np.ones((len(prompts), 1), dtype=np.int64)], axis=1)
            logits, past = self.lm_step(next_ids[:, None].astype(np.int64), mask, ks, past)
        return out

    def classify(
        self, token_ids: list[list[int]], experts_per_token: int | list[int | None] | None = None
    ) -> np.ndarray:
        """Class probabilities [B, C] of each input (right-padded into one batch, each with its own k)."""
        self._require_task("sequence_classification")
        ks = self.experts_per_token(experts_per_token, len(token_ids))
        width = max(len(t) for t in token_ids)
        self._check_length(width)
        ids = np.zeros((len(token_ids), width), dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, tokens in enumerate(token_ids):
            ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        return self.run(dict(zip(INPUTS, (ids, mask, ks), strict=True)))[1]

    def _require_task(self, task: str) -> None:
        if self.config.task != task:
            raise ValidationError(f"this graph is a {self.config.task} model, not {task}")
