"""The onnxruntime backend (`--backend onnxruntime`, docs/architecture.md §7): the engine's Runner over an
exported graph (moe_serve.onnx_model documents its interface). The scheduler, the block manager, sampling and
detokenizing are the engine's own; only the forward pass changes.

The graph carries keys and values between runs as padded [B, G, P, Dh] arrays, while the engine thinks in
blocks: this runner keeps a paged pool of its own (one row per cache slot, the block manager's slots), so
that prefix caching, preemption and the memory budget work exactly as with the torch runner. Each step it
gathers each sequence's past from its block table into a left-padded batch (rows with different past
lengths and different chunk lengths share a run: the attention mask marks the padding, the graph counts
positions over real tokens only), runs the graph with each row's k (decodes in one run, prompt chunks in
another), and scatters the new keys and values back into the pool. The gather copies every scheduled
sequence's past once per step: the cost of a graph whose cache is an input, which the torch runner
(attention reads the blocks in place) does not pay.

Legend: B rows (sequences in one run), T their longest chunk, P the longest past, G key/value heads.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from moe_serve.engine.kv_cache import CacheShape
from moe_serve.engine.runner import StepResult, score_logprobs, score_targets
from moe_serve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from moe_serve.engine.sequence import SequenceKind
from moe_serve.onnx_model import INPUTS, OnnxModel, past_names


class OnnxRunner:
    def __init__(self, graph: OnnxModel, cache_shape: CacheShape) -> None:
        self.graph = graph
        self.config = graph.config
        self.shape = cache_shape
        self.pool: list[torch.Tensor] = []  # per layer, keys then values: [slots, G, Dh] fp32
        if self.config.is_causal:
            slots = cache_shape.num_tokens
            assert self.config.num_kv_heads is not None and self.config.head_dim is not None  # completed by ModelConfig
            dims = (slots, self.config.num_kv_heads, self.config.head_dim)
            # torch.empty: pages are committed as slots are first written; nothing reads a slot before that.
            self.pool = [torch.empty(dims, dtype=torch.float32) for _ in range(2 * self.config.num_layers)]
        self.expert_load: np.ndarray | None = None  # [L_moe, N] tokens per expert since the last read, if tracked

    def execute(self, output: SchedulerOutput) -> StepResult:
        items = output.scheduled
        if items[0].seq.kind is SequenceKind.CLASSIFY:
            return self._classify(items)
        result, last = StepResult(), {}
        # Single-token rows (decodes) run apart from prompt chunks: in one run every row is padded to the
        # longest chunk, and a decode padded to a 512-token chunk would compute 511 tokens for nothing.
        decodes = [i for i, it in enumerate(items) if it.num_tokens == 1]
        chunks = [i for i, it in enumerate(items) if it.num_tokens > 1]
        for group in (decodes, chunks):
            if not group:
                continue
            logits = self._lm_step([items[i] for i in group])  # [B, T, V]
            width = logits.shape[1]
            for row, i in enumerate(group):
                item = items[i]
                if item.seq.kind is SequenceKind.SCORE:
                    targets = score_targets(item)
                    first = width - item.num_tokens  # rows are left-padded: the chunk ends at the last column
                    chunk = logits[row, first : first + len(targets)]
                    result.prompt_logprobs[i], result.prompt_top_logprobs[i] = score_logprobs(chunk, [item])[0]
                elif item.completes_prompt:
                    last[i] = logits[row, -1]
        if last:
            result.sample_items = sorted(last)
            result.logits = torch.stack([last[i] for i in result.sample_items])  # [R, V]
        if self.config.moe_layers:
            result.experts = {i: (item.num_tokens, None) for i, item in enumerate(items)}
        return result

    # ---- the causal LM: one run per group of rows ---------------------------------------------------

    def _lm_step(self, items: list[ScheduledSequence]) -> torch.Tensor:
        rows, width, past = len(items), max(it.num_tokens for it in items), max(it.start for it in items)
        block_size = self.shape.block_size
        ids = np.zeros((rows, width), dtype=np.int64)
        mask = np.zeros((rows, past + width), dtype=np.int64)
        past_slots = np.zeros((rows, past), dtype=np.int64)  # padding reads slot 0: masked, never used
        new_slots, new_index = [], []  # where each real new token's keys go, and its place in [B * T]
        for r, item in enumerate(items):
            seq, n = item.seq, item.num_tokens
            ids[r, width - n :] = seq.token_ids[item.start : item.end]
            mask[r, past - item.start : past] = 1
            mask[r, past + width - n :] = 1
            table = np.asarray(seq.block_table, dtype=np.int64)
            positions = np.arange(item.end)
            slots = table[positions // block_size] * block_size + positions % block_size
            past_slots[r, past - item.start :] = slots[: item.start]
            new_slots.append(slots[item.start :])
            new_index.append(r * width + np.arange(width - n, width))
        feeds = dict(zip(INPUTS, (ids, mask, self._ks(items)), strict=True))
        flat_past = torch.from_numpy(past_slots.reshape(-1))
        for name, pool in zip(past_names(self.config.num_layers), self.pool, strict=True):
            # [B * P, G, Dh] -> [B, G, P, Dh]
            gathered = pool.index_select(0, flat_past).view(rows, past, *pool.shape[1:]).transpose(1, 2)
            feeds[name] = gathered.contiguous().numpy()
        logits, *present = self._run(feeds)
        slots_t = torch.from_numpy(np.concatenate(new_slots))
        index_t = torch.from_numpy(np.concatenate(new_index))
        for pool, values in zip(self.pool, present, strict=True):
            new = torch.from_numpy(values[:, :, past:])  # [B, G, T, Dh]
            pool.index_copy_(
                0, slots_t, new.transpose(1, 2).reshape(rows * width, *pool.shape[1:]).index_select(0, index_t)
            )
        return torch.from_numpy(logits)

    def _run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The graph's outputs without expert_counts, which go to the expert load when it is tracked."""
        outputs = self.graph.run(feeds)
        if not self.config.moe_layers:
            return outputs
        if self.expert_load is not None:
            self.expert_load += outputs[-1]
        return outputs[:-1]

    def track_expert_load(self) -> None:
        num_experts = self.config.moe.num_experts if self.config.moe is not None else 0
        self.expert_load = np.zeros((len(self.config.moe_layers), num_experts), dtype=np.int64)

    def read_expert_load(self) -> dict[int, list[int]]:
        if self.expert_load is None:
            return {}
        loads = dict(zip(self.config.moe_layers, self.expert_load.tolist(), strict=True))
        self.expert_load[:] = 0
        return loads

    def _ks(self, items: list[ScheduledSequence]) -> np.ndarray:
        """Each row's k. Inputs were validated on the way in (the engine's InputProcessor refuses a policy
        the graph cannot run), so this only checks the range once more, as the graph cannot raise."""
        return self.graph.experts_per_token([it.k_spec.k if self.config.moe else None for it in items], len(items))

    # ---- the classifier -------------------------------------------------------------------------------

    def _classify(self, items: list[ScheduledSequence]) -> StepResult:
        width = max(it.num_tokens for it in items)
        ids = np.zeros((len(items), width), dtype=np.int64)
        mask = np.zeros_like(ids)
        for r, item in enumerate(items):  # right-padded: pooling reads the mask
            ids[r, : item.num_tokens] = item.seq.token_ids[: item.num_tokens]
            mask[r, : item.num_tokens] = 1
        _, probs = self._run(dict(zip(INPUTS, (ids, mask, self._ks(items)), strict=True)))
        result = StepResult(class_probs=dict(enumerate(probs.tolist())))
        if self.config.moe_layers:
            result.experts = {i: (item.num_tokens, None) for i, item in enumerate(items)}
        return result

    def prompt_seconds(self, num_tokens: int, k: int) -> float:
        ids = np.arange(num_tokens, dtype=np.int64)[None] % self.config.vocab_size
        feeds = dict(zip(INPUTS, (ids, np.ones_like(ids), np.asarray([k], dtype=np.int64)), strict=True))
        if self.config.is_causal:
            feeds.update(zip(past_names(self.config.num_layers), self.graph.empty_past(1), strict=True))
        self.graph.run(feeds)  # warm: first runs pay one-time costs
        start = time.perf_counter()
        self.graph.run(feeds)
        return time.perf_counter() - start
