"""Decode-only steps through static buffers, replayed as CUDA graphs.

A decode step is many small kernels (about 30 per sequence per layer through the eager path) whose launch
cost, not their work, sets the batch-1 step time on a GPU. Here a step that only decodes copies its inputs
into fixed device buffers with one host-to-device copy (from one pinned staging buffer) and replays a CUDA
graph captured at start-up for its batch-size bucket; the graph holds the whole forward and the LM head.
Sampling stays outside (it reads the logits the graph wrote). Steps that prefill, score or classify run
eagerly (engine.model_runner).

What makes the forward capturable is that nothing in it reads the device from the host: every shape is
the bucket's, routing takes the artifact's max k with -1 slots beyond each row's k (per-row k is a device
tensor), attention reads sequence lengths on the device (moe_serve.kernels.cuda), and expert counts
accumulate on the device. Padding rows (bucket minus sequences) take k = 0 (no experts), write their keys
to the cache's scratch block and attend to them there, so they never touch a sequence's blocks, and a row's
result never depends on the others (docs/architecture.md, batch invariance).

The same static forward runs eagerly where graphs cannot (capture=False): on CPU that is how the tests
check its packing and padding against the eager path.

Legend: B bucket (padded batch), N sequences in the step, MB blocks per sequence at most, L layers, V vocabulary.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moe_serve.engine.kv_cache import KVCache, router_state_sizes
from moe_serve.engine.runner import StepResult
from moe_serve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from moe_serve.engine.sequence import SequenceKind
from moe_serve.kernels import cuda
from moe_serve.kernels.vocabulary import AttentionBatch
from moe_serve.layers.batch import AdaptiveK, ForwardBatch
from moe_serve.model_config import ModelConfig
from moe_serve.models import MoETransformer
from moe_serve.router_registry import router_class

_CAPTURE_LOCK = threading.Lock()


def bucket_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes a graph is captured for: 1, 2, 4, then every multiple of 8 (vLLM's choice: padding costs
    at most 7 rows once past 8), up to max_num_seqs (itself always a bucket)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return tuple(sizes + [max_num_seqs])


def unsupported_reason(config: ModelConfig) -> str | None:
    """Why this model's decode steps cannot be static (so they run eagerly), or None."""
    if not config.is_causal:
        return "an encoder has no decode steps"
    if config.position == "relative":
        return "Transformer-XL relative attention runs the torch attention, which reads lengths on the host"
    if config.attention_features:
        return f"{', '.join(config.attention_features)} run the torch attention, which reads lengths on the host"
    if router_state_sizes(config):
        return "its router keeps per-token state in the cache, read per sequence on the host"
    moe = config.moe
    if moe is not None and router_class(moe.router.kind).reads_attention:
        return "its router reads the layer's attention, computed per sequence on the host"
    if moe is not None and moe.hyper_expert is not None and moe.max_k > 1:
        return "HyperMoE's adapter index needs exactly the trained k slots per row"
    return None


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * torch.tensor([], dtype=self.dtype).element_size()


class Staging:
    """Named buffers carved from one byte buffer on the host (pinned on CUDA) and its twin on the device:
    the step writes the host side (through numpy views: no torch op per field) and `upload` moves it in one
    copy. The last field is the block tables, so a small bucket copies only the prefix it uses."""

    def __init__(self, fields: list[_Field], device: torch.device) -> None:
        offsets, size = {}, 0
        for f in fields:
            offsets[f.name] = size
            size += -(-f.nbytes // 8) * 8  # every field 8-byte aligned
        pin = device.type == "cuda"
        self.host = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        self.device = torch.empty(size, dtype=torch.uint8, device=device)
        self.offsets = offsets
        self._last = fields[-1].name
        self.device_views = {f.name: self._view(self.device, f) for f in fields}
        self.arrays = {f.name: self._view(self.host, f).numpy() for f in fields}  # the host side, written per step
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None

    def _view(self, buffer: torch.Tensor, f: _Field) -> torch.Tensor:
        start = self.offsets[f.name]
        return buffer[start : start + f.nbytes].view(f.dtype).view(f.shape)

    def upload(self, last_rows: int) -> None:
        """The step's one host-to-device copy, asynchronous from pinned memory: every field but the last
        whole, and the first last_rows rows of the last (the rest is stale and never read)."""
        nbytes = self.offsets[self._last] + self.device_views[self._last][:last_rows].nbytes
        self.device[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()

    def wait_uploaded(self) -> None:
        """Returns once the last upload has read the host buffer (at once in steady state: the step's logits
        were read since, which waited for everything before them)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()


class DecodeGraphs:
    """The static decode path of one model and its cache (see the module docstring)."""

    def __init__(
        self, model: MoETransformer, cache: KVCache, max_num_seqs: int, device: torch.device, capture: bool
    ) -> None:
        config = model.config
        self.model = model
        self.cache = cache
        self.device = device
        self.capture = capture
        self.buckets = bucket_sizes(max_num_seqs)
        self.block_size = cache.shape.block_size
        self.max_blocks = -(-config.max_position_embeddings // self.block_size)
        self.max_k = config.moe.max_k if config.moe is not None else 1
        self.moe_layers = list(config.moe_layers)
        self.adaptive_defined = config.moe is not None and router_class(config.moe.router.kind).top_p_defined
        size = self.buckets[-1]
        self.staging = Staging(
            [
                _Field("tokens", torch.int64, (size,)),
                _Field("positions", torch.int64, (size,)),
                _Field("slot_mapping", torch.int64, (size,)),
                _Field("num_keys", torch.int64, (size,)),
                _Field("token_k", torch.int64, (size,)),
                _Field("min_k", torch.int64, (size,)),
                _Field("cut", torch.float32, (size,)),
                _Field("block_tables", torch.int32, (size, self.max_blocks)),
            ],
            device,
        )
        self.rows = torch.arange(size, device=device)  # each row is its own sequence: seq_ids and seq_starts
        self.experts_used = torch.zeros(config.num_layers, size, dtype=torch.int64, device=device)
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None  # one memory pool for every graph (never two replay at once)

    # ---- which steps --------------------------------------------------------------------------------

    def accepts(self, output: SchedulerOutput) -> bool:
        """A step of decodes only (one new token per sequence, each then sampled) that fits the buffers."""
        items = output.scheduled
        if not items or len(items) > self.buckets[-1]:
            return False
        return all(
            item.seq.kind is SequenceKind.GENERATE
            and item.num_tokens == 1
            and item.completes_prompt
            and len(item.seq.block_table) <= self.max_blocks
            for item in items
        )

    def capture_all(self) -> None:
        """Every bucket's graph (and, for a router kind with top-p policies, its adaptive twin), largest first
        so that the smaller ones reuse the pool's memory: at start-up, on one thread, never mid-serving;
        again when the graphs' tensors are replaced (track_expert_load's counters).
        Captured on padding rows alone, so the warm-up forwards count no experts and write no keys but the
        scratch block's."""
        self._graphs.clear()
        for bucket in reversed(self.buckets):
            for adaptive in (False, True) if self.adaptive_defined else (False,):
                self._stage([], bucket)
                self._graphs[(bucket, adaptive)] = self._capture(bucket, adaptive)
        torch.cuda.synchronize(self.device)

    # ---- one step -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> StepResult:
        items = output.scheduled
        n = len(items)
        bucket = next(b for b in self.buckets if b >= n)
        adaptive = self.adaptive_defined and any(item.seq.k_spec.adaptive for item in items)
        self._stage(output.scheduled, bucket)
        logits = self._run((bucket, adaptive))
        result = StepResult(sample_items=list(range(n)), logits=logits[:n].clone())
        if not self.moe_layers:
            return result
        if adaptive:
            used = self.experts_used[self.moe_layers, :n].T.tolist()  # [N][L]
            result.experts = {i: (1, used[i]) for i in range(n)}
        else:
            result.experts = {i: (1, None) for i in range(n)}
        return result

    def _stage(self, items: list[ScheduledSequence], bucket: int) -> None:
        """The items' inputs into the staging buffer, rows len(items)..bucket-1 padding, and the one copy to
        the device (of the prefix the bucket reads)."""
        self.staging.wait_uploaded()  # the last copy must have left the host buffer before it is rewritten
        a = self.staging.arrays
        n = len(items)
        bs = self.block_size
        scratch = self.cache.scratch_block
        for i, item in enumerate(items):
            seq, position = item.seq, item.start
            table = seq.block_table
            a["tokens"][i] = seq.token_ids[position]
            a["positions"][i] = position
            a["slot_mapping"][i] = table[position // bs] * bs + position % bs
            a["num_keys"][i] = item.end
            spec = item.k_spec
            a["token_k"][i] = spec.k
            a["min_k"][i] = spec.lowest if spec.adaptive else spec.k
            a["cut"][i] = spec.cut if spec.adaptive else np.inf
            a["block_tables"][i, : len(table)] = table
        # Padding: k = 0 (no experts), one key at position 0 of the scratch block, written and read there.
        pad = slice(n, bucket)
        a["tokens"][pad] = 0
        a["positions"][pad] = 0
        a["slot_mapping"][pad] = scratch * bs
        a["num_keys"][pad] = 1
        a["token_k"][pad] = 0
        a["min_k"][pad] = 0
        a["cut"][pad] = np.inf
        a["block_tables"][pad, 0] = scratch
        self.staging.upload(bucket)

    def _run(self, key: tuple[int, bool]) -> torch.Tensor:
        """[bucket, V] fp32 logits: the captured graph replayed, or the static forward run eagerly."""
        if not self.capture:
            return self._forward(self._batch(*key, host_lengths=True))
        graph, logits = self._graphs[key]
        graph.replay()
        return logits

    def _capture(self, bucket: int, adaptive: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (Triton compiles its kernels at their first launch, which a capture must
        not see), then capture."""
        batch = self._batch(bucket, adaptive, host_lengths=False)
        with _CAPTURE_LOCK:  # one capture at a time in the process (a server loads several models)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(batch)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another model's engine thread may sync (an eager step) while this one captures.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self._forward(batch)
            self._pool = graph.pool()
        return graph, logits

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        bucket = batch.token_k.shape[0]
        if batch.adaptive_k is not None:
            self.experts_used.zero_()
        hidden = self.model(self.staging.device_views["tokens"][:bucket], batch)
        return self.model.lm_logits(hidden)

    def _batch(self, bucket: int, adaptive: bool, host_lengths: bool) -> ForwardBatch:
        """The bucket's ForwardBatch: views of the device buffers (the same tensors at every replay).
        host_lengths: fill the host copy of the lengths, which only the eager torch attention reads (a graph
        runs the Triton attention, which reads them on the device)."""
        v = self.staging.device_views
        rows = self.rows[:bucket]
        num_keys_host: tuple[int, ...] = ()
        if host_lengths:
            num_keys_host = tuple(int(n) for n in self.staging.arrays["num_keys"][:bucket])
        attention = AttentionBatch(
            seq_ids=rows,
            positions=v["positions"][:bucket],
            num_keys=v["num_keys"][:bucket],
            seq_starts=rows,
            seq_lens=(1,) * bucket,
            num_keys_host=num_keys_host,
            block_tables=v["block_tables"][:bucket],
            slot_mapping=v["slot_mapping"][:bucket],
        )
        adaptive_k = None
        if adaptive:
            adaptive_k = AdaptiveK(v["cut"][:bucket], v["min_k"][:bucket], self.experts_used[:, :bucket])
        return ForwardBatch(
            attention, v["token_k"][:bucket], self.max_k, self.cache.layers, None, self.block_size, adaptive_k
        )


def decode_graphs_for(
    model: MoETransformer, cache: KVCache | None, max_num_seqs: int, device: torch.device, enabled: bool
) -> DecodeGraphs | None:
    """The static decode path where it applies: CUDA graphs enabled, on CUDA, with the Triton kernels (the
    torch fallbacks read lengths on the host), and a model whose decode can be static."""
    if not enabled or cache is None or device.type != "cuda" or cuda.kernels() is None:
        return None
    if unsupported_reason(model.config) is not None:
        return None
    assert len(cache.shape.layout.groups) == 1  # several come only from windows or chunks, refused above
    graphs = DecodeGraphs(model, cache, max_num_seqs, device, capture=True)
    graphs.capture_all()
    return graphs
