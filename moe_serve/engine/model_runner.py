"""The torch backend's runner: the scheduler's decision for a step -> one token-packed forward through the
PyTorch model -> what the step produced (next-token logits, prompt log-likelihoods, class probabilities).
It implements engine.runner.Runner, the interface the engine drives.

Legend: T tokens of the step, S sequences, R rows that need logits, V vocabulary, D hidden.
"""

from __future__ import annotations

import time

import torch

from moe_serve.config import EngineConfig
from moe_serve.engine.decode_graphs import DecodeGraphs, decode_graphs_for
from moe_serve.engine.decode_stack import DecodeStack, decode_stack_for
from moe_serve.engine.kv_cache import CacheShape, KVCache
from moe_serve.engine.runner import StepResult, score_logprobs, score_targets
from moe_serve.engine.scheduler_output import SchedulerOutput
from moe_serve.engine.sequence import SequenceKind
from moe_serve.kernels.vocabulary import AttentionBatch
from moe_serve.layers.batch import AdaptiveK, ForwardBatch
from moe_serve.models import MoETransformer
from moe_serve.moe_policy import KSpec


class TorchRunner:
    def __init__(
        self,
        model: MoETransformer,
        device: torch.device,
        cache_shape: CacheShape,
        dtype: torch.dtype,
        engine_config: EngineConfig,
    ) -> None:
        self.model = model
        self.config = model.config
        self.device = device
        self.cache = KVCache(model.config, cache_shape, device, dtype) if model.config.is_causal else None
        self._layer_groups = cache_shape.layout.layer_groups  # each layer's KV group
        # Decode-only steps as CUDA graphs, where they apply (engine.decode_graphs); None: every step eager.
        self.decode_graphs: DecodeGraphs | None = decode_graphs_for(
            model, self.cache, engine_config.max_num_seqs, device, engine_config.cuda_graphs
        )
        # On the CPU, the layers of decode-only steps in one C++ call, where it applies (engine.decode_stack):
        # the runner owns it (it holds the runner's cache) and hands it to the model in each step's batch.
        self.decode_stack: DecodeStack | None = decode_stack_for(model, self.cache, engine_config.cpu_decode_stack)

    def execute(self, output: SchedulerOutput) -> StepResult:
        if self.decode_graphs is not None and self.decode_graphs.accepts(output):
            return self.decode_graphs.execute(output)
        input_ids, lens, batch = self._inputs(output)
        if self._stack_samples(output, batch):
            result = self._stacked_results(output, input_ids, batch)
        else:
            result = self._results(output, self._forward(input_ids, batch), lens)
        result.experts = self._experts(output, batch)
        return result

    def forward(self, output: SchedulerOutput) -> tuple[torch.Tensor, tuple[int, ...], ForwardBatch]:
        """The step's tokens through the model: hidden states [T, D], the tokens of each sequence, and the
        batch the layers read (under a top-p policy, with the experts they counted)."""
        input_ids, lens, batch = self._inputs(output)
        return self._forward(input_ids, batch), lens, batch

    @torch.inference_mode()
    def _forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, batch)

    def _stack_samples(self, output: SchedulerOutput, batch: ForwardBatch) -> bool:
        """Whether the decode stack runs the step through to the logits: it takes the step and every row
        samples a next token (a generation's decode, or the last token of its prompt)."""
        return (
            self.decode_stack is not None
            and self.decode_stack.accepts(batch)
            and all(item.seq.kind is SequenceKind.GENERATE and item.completes_prompt for item in output.scheduled)
        )

    @torch.inference_mode()
    def _stacked_results(self, output: SchedulerOutput, input_ids: torch.Tensor, batch: ForwardBatch) -> StepResult:
        """The decode stack's step: layers, final norm and LM head in one call, every row a sampled item's
        (one token each: the rows are the items). Its logits are bitwise _results' for the same step."""
        assert self.decode_stack is not None
        logits = self.decode_stack.logits(self.model.inputs(input_ids, batch), batch)
        return StepResult(sample_items=list(range(len(output.scheduled))), logits=logits)

    def _inputs(self, output: SchedulerOutput) -> tuple[torch.Tensor, tuple[int, ...], ForwardBatch]:
        """The step's token ids [T], the tokens of each sequence, and the batch the layers read."""
        items = output.scheduled
        uses_cache = items[0].seq.uses_kv_cache
        assert all(item.seq.uses_kv_cache == uses_cache for item in items), (
            "a step never mixes cached and encoder inputs"
        )
        token_ids: list[int] = []
        positions: list[int] = []
        seq_ids: list[int] = []
        num_groups = len(self.cache.shape.layout.groups) if self.cache is not None else 1
        slots: list[list[int]] = [[] for _ in range(num_groups)]  # per KV group
        block_size = self.cache.shape.block_size if self.cache is not None else 0
        for s, item in enumerate(items):
            seq = item.seq
            token_ids += seq.token_ids[item.start : item.end]
            positions += range(item.start, item.end)
            seq_ids += [s] * item.num_tokens
            if uses_cache:
                for group, table in zip(slots, seq.block_tables, strict=True):
                    group += [table[p // block_size] * block_size + p % block_size for p in range(item.start, item.end)]
        lens = tuple(item.num_tokens for item in items)
        num_keys = tuple(item.end if uses_cache else item.num_tokens for item in items)
        tables = [[item.seq.block_tables[g] for item in items] for g in range(num_groups)] if uses_cache else None
        batch = self._batch(positions, seq_ids, [item.k_spec for item in items], lens, num_keys, tables, slots)
        return torch.tensor(token_ids, device=self.device), lens, batch

    def _batch(
        self,
        positions: list[int],
        seq_ids: list[int],
        specs: list[KSpec],
        lens: tuple[int, ...],
        num_keys: tuple[int, ...],
        block_tables: list[list[list[int]]] | None,
        slots: list[list[int]],
    ) -> ForwardBatch:
        """specs: each sequence's k spec, applied to all of its tokens. block_tables and slots: per KV group,
        each sequence's table and each token's cache row."""
        device = self.device
        starts, offset = [], 0
        for n in lens:
            starts.append(offset)
            offset += n
        one_each = offset == len(lens)  # a decode step: one token per sequence
        seq_id_rows = torch.tensor(seq_ids, device=device)
        position_rows = torch.tensor(positions, device=device)
        key_counts = torch.tensor(num_keys, device=device)
        start_rows = seq_id_rows if one_each else torch.tensor(starts, device=device)  # one each: 0..S-1 both

        def attention_batch(tables: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> AttentionBatch:
            return AttentionBatch(seq_id_rows, position_rows, key_counts, start_rows, lens, num_keys, tables, rows)

        attention = attention_batch()
        groups: tuple[AttentionBatch, ...] = ()
        if block_tables is not None:
            width = max(len(t) for t in block_tables[0])  # every group's tables are as long as the first's
            groups = tuple(
                attention_batch(
                    torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
                    torch.tensor(rows, device=device),
                )
                for tables, rows in zip(block_tables, slots, strict=True)
            )
            attention = groups[0]
        caches = self.cache.layers if (self.cache is not None and block_tables is not None) else None
        latent = self.cache.latent if (self.cache is not None and block_tables is not None) else None
        states = self.cache.router_states if (caches is not None and self.cache is not None) else None
        block_size = self.cache.shape.block_size if self.cache is not None else 0

        def tokens(values: list, dtype: torch.dtype) -> torch.Tensor:
            """One value per sequence -> one per token."""
            per_sequence = torch.tensor(values, dtype=dtype, device=device)
            if one_each:
                return per_sequence
            # output_size: no device-to-host read to size the result
            return per_sequence.repeat_interleave(torch.tensor(lens, device=device), output_size=offset)

        adaptive = None
        if any(spec.adaptive for spec in specs):
            adaptive = AdaptiveK(
                cut=tokens([spec.cut for spec in specs], torch.float32),
                min_k=tokens([spec.lowest for spec in specs], torch.int64),
                experts_used=torch.zeros(self.config.num_layers, len(specs), dtype=torch.int64, device=device),
            )
        token_k = tokens([spec.k for spec in specs], torch.int64)
        max_k = max(spec.k for spec in specs)
        return ForwardBatch(
            attention,
            token_k,
            max_k,
            caches,
            states,
            block_size,
            adaptive,
            decode_stack=self.decode_stack,
            latent_caches=latent or None,
            group_attention=groups if len(groups) > 1 else (),
            layer_groups=self._layer_groups if len(groups) > 1 else (),
        )

    def _experts(self, output: SchedulerOutput, batch: ForwardBatch) -> dict[int, tuple[int, list[int] | None]]:
        """Tokens each scheduled sequence computed in this step and, when a top-p policy ran, the experts
        they took per MoE layer (counted on the device, one read per step); a fixed k's follow from its
        tokens, so a step without a policy counts nothing more."""
        layers = self.config.moe_layers
        if not layers:
            return {}
        if batch.adaptive_k is None:
            return {i: (it.num_tokens, None) for i, it in enumerate(output.scheduled)}
        used = batch.adaptive_k.experts_used[list(layers)].T.tolist()  # [S][L]
        return {i: (it.num_tokens, used[i]) for i, it in enumerate(output.scheduled)}

    @torch.inference_mode()
    def _results(self, output: SchedulerOutput, hidden: torch.Tensor, lens: tuple[int, ...]) -> StepResult:
        result = StepResult()
        rows, start = [], 0
        classify = [i for i, item in enumerate(output.scheduled) if item.seq.kind is SequenceKind.CLASSIFY]
        if classify:
            probs = torch.softmax(self.model.class_logits(hidden, lens), dim=-1).tolist()
            result.class_probs = dict(zip(classify, probs, strict=True))
            return result
        scored: list[int] = []  # SCORE items
        score_rows: list[int] = []  # the rows of their targets' positions, every item's, in one lm_logits
        for i, item in enumerate(output.scheduled):
            seq = item.seq
            if seq.kind is SequenceKind.SCORE:
                scored.append(i)
                score_rows += range(start, start + len(score_targets(item)))
            elif item.completes_prompt:
                result.sample_items.append(i)
                rows.append(start + item.num_tokens - 1)
            start += item.num_tokens
        if scored:
            logits = self.model.lm_logits(
                hidden[torch.tensor(score_rows, dtype=torch.long, device=hidden.device)]
            )  # [N, V]
            per_item = score_logprobs(logits, [output.scheduled[i] for i in scored])
            for i, (values, tops) in zip(scored, per_item, strict=True):
                result.prompt_logprobs[i], result.prompt_top_logprobs[i] = values, tops
        if rows:
            last = hidden[torch.tensor(rows, device=hidden.device)]  # [R, D]
            result.logits = self.model.lm_logits(last)  # [R, V] fp32
        return result

    def track_expert_load(self) -> None:
        self.model.track_expert_load()
        if self.decode_stack is not None:
            self.decode_stack.track_expert_load()  # it counts into the counters the layers just got
        if self.decode_graphs is not None and self.decode_graphs.capture:
            self.decode_graphs.capture_all()  # the graphs hold the counters they were captured with

    def read_expert_load(self) -> dict[int, list[int]]:
        return self.model.read_expert_load()

    def prompt_seconds(self, num_tokens: int, k: int) -> float:
        tokens = [[i % self.config.vocab_size for i in range(num_tokens)]]
        self.forward_sequences(tokens, [k])  # warm: first calls pay one-time costs
        self._synchronize()
        start = time.perf_counter()
        self.forward_sequences(tokens, [k])
        self._synchronize()  # CUDA runs asynchronously: time the work, not its launch
        return time.perf_counter() - start

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- whole sequences without a cache (tests, fold proofs, classify outside the engine) ---------

    @torch.inference_mode()
    def forward_sequences(
        self, token_ids: list[list[int]], ks: list[int] | list[KSpec]
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Each sequence whole, packed, no cache, at its k (or k spec) -> (hidden [T, D], lengths)."""
        lens = tuple(len(t) for t in token_ids)
        flat = [t for seq in token_ids for t in seq]
        positions = [p for n in lens for p in range(n)]
        seq_ids = [s for s, n in enumerate(lens) for _ in range(n)]
        batch = self._batch(positions, seq_ids, [KSpec.of(k) for k in ks], lens, lens, None, [])
        return self.model(torch.tensor(flat, device=self.device), batch), lens

    def forward_padded(self, token_ids: list[list[int]], ks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_sequences laid out as [B, L, D] with a token mask [B, L] (for comparisons in tests)."""
        hidden, lens = self.forward_sequences(token_ids, ks)
        padded = hidden.new_zeros(len(lens), max(lens), hidden.shape[-1])
        mask = torch.zeros(len(lens), max(lens), dtype=torch.bool, device=hidden.device)
        for b, part in enumerate(hidden.split(lens)):
            padded[b, : len(part)] = part
            mask[b, : len(part)] = True
        return padded, mask
