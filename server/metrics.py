"""Prometheus collectors (prefix moe_serve_, base units, `model` label; latency histograms by `k`, which is
"top_p" for requests with a `moe` policy and "auto" for experts_per_token "auto"; the mean k of each
request by policy; the k "auto" runs with now) and the functions that record into them. Queue, cache,
expert-load, auto-k and quality figures are read from the served engines when Prometheus scrapes, so they
are never stale. Generated tokens are counted as the server reads them from the engine, step by step, not
when a request finishes. `Recent` keeps the last minutes of observations for the built-in dashboard's windows.
One registry per app, so tests can run several."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from moe_serve.engine.async_engine import AsyncEngine, GenerationStream
from moe_serve.engine.expert_load import max_share, normalised_entropy
from moe_serve.moe_policy import KSpec
from moe_serve.outputs import ExpertCounts, RequestMetrics
from moe_serve.quality import QualityTable
from moe_serve.server.settings import ExpertMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
EXPERT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0)
RECENT_SECONDS = 300  # how far back the built-in dashboard can look


class Recent:
    """The last RECENT_SECONDS of observations, for the built-in dashboard (which has no Prometheus to take a
    rate() for it): end-to-end latency by model, endpoint and k, time to first token by model and k, and
    generated tokens by model and second. Bounded in time and in count."""

    def __init__(self, clock: Callable[[], float], keep: float = RECENT_SECONDS, max_observations: int = 50_000):
        self.clock, self.keep = clock, keep
        self._latency: deque[tuple[float, str, str, str, float]] = deque(maxlen=max_observations)
        self._ttft: deque[tuple[float, str, str, str, float]] = deque(maxlen=max_observations)
        self._tokens: dict[str, deque[list[float]]] = {}  # model -> [second, tokens generated in it]
        self._lock = threading.Lock()

    def add_latency(self, model: str, endpoint: str, k: str, seconds: float) -> None:
        self._add(self._latency, model, endpoint, k, seconds)

    def add_ttft(self, model: str, k: str, seconds: float) -> None:
        self._add(self._ttft, model, "", k, seconds)

    def add_tokens(self, model: str, count: int) -> None:
        if count <= 0:
            return
        now = self.clock()
        second = float(int(now))
        with self._lock:
            per_second = self._tokens.setdefault(model, deque())
            if per_second and per_second[-1][0] == second:
                per_second[-1][1] += count
            else:
                per_second.append([second, float(count)])
            while per_second and per_second[0][0] < now - self.keep:
                per_second.popleft()

    def latency(self, window: float) -> list[dict[str, Any]]:
        """p50 / p95 / count per model, endpoint and k of the requests that finished in the last `window` s."""
        return self._quantiles(self._latency, window, with_endpoint=True)

    def ttft(self, window: float) -> list[dict[str, Any]]:
        return self._quantiles(self._ttft, window, with_endpoint=False)

    def throughput(self, window: float) -> dict[str, list[list[float]]]:
        """Generated tokens per second of each model that generated in the last `window` s: [unix ms, tokens/s]
        for every whole second of it (zeros included, so a chart shows the quiet seconds too)."""
        now = int(self.clock())
        first = now - int(min(window, self.keep))
        out = {}
        with self._lock:
            for model, per_second in self._tokens.items():
                counts = {int(second): count for second, count in per_second if first <= second < now}
                if counts:
                    out[model] = [[second * 1000.0, counts.get(second, 0.0)] for second in range(first, now)]
        return out

    def _add(self, into: deque, model: str, endpoint: str, k: str, seconds: float) -> None:
        now = self.clock()
        with self._lock:
            into.append((now, model, endpoint, k, seconds))
            while into and into[0][0] < now - self.keep:
                into.popleft()

    def _quantiles(self, source: deque, window: float, with_endpoint: bool) -> list[dict[str, Any]]:
        since = self.clock() - window
        groups: dict[tuple[str, str, str], list[float]] = {}
        with self._lock:
            for at, model, endpoint, k, seconds in source:
                if at >= since:
                    groups.setdefault((model, endpoint, k), []).append(seconds)
        rows = []
        for (model, endpoint, k), values in sorted(
            groups.items(), key=lambda item: (item[0][0], item[0][1], _k_order(item[0][2]))
        ):
            values.sort()
            row: dict[str, Any] = {"model": model, "k": k}
            if with_endpoint:
                row["endpoint"] = endpoint
            row.update(p50=_quantile(values, 0.5), p95=_quantile(values, 0.95), count=len(values))
            rows.append(row)
        return rows


def _quantile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks of sorted values."""
    position = q * (len(values) - 1)
    low = int(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def _k_order(k: str) -> tuple[int, int, str]:
    """Numeric k in order, then "top_p", "auto" and anything else."""
    return (0, int(k), "") if k.isdigit() else (1, 0, k)


class Metrics:
    def __init__(self, expert_metrics: ExpertMetrics = "full", clock: Callable[[], float] = time.time) -> None:
        self.registry = r = CollectorRegistry()
        self.recent = Recent(clock)

        def histogram(
            name: str, doc: str, labels: list[str], buckets: tuple[float, ...] = LATENCY_BUCKETS
        ) -> Histogram:
            return Histogram(f"moe_serve_{name}", doc, ["model", *labels], buckets=buckets, registry=r)

        self.requests = Counter(
            "moe_serve_requests", "HTTP requests by endpoint and status", ["endpoint", "status", "model"], registry=r
        )
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency", ["k", "endpoint"])
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first generated token", ["k"])
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between consecutive generated tokens", ["k"], TOKEN_BUCKETS
        )
        self.queue = histogram("request_queue_time_seconds", "Time from arrival to the first scheduled step", ["k"])
        self.prompt_tokens = Counter("moe_serve_prompt_tokens", "Prompt tokens processed", ["model", "k"], registry=r)
        self.generation_tokens = Counter("moe_serve_generation_tokens", "Tokens generated", ["model", "k"], registry=r)
        self.batch_storage_errors = Counter(
            "moe_serve_batch_storage_errors",
            "Failures of the Batch API's data dir (a full disk, I/O errors, an unusable dir) by where they happened: "
            "a batch step (validating, in_progress, finalizing, cancelling: paused and tried again) or a request",
            ["stage"],
            registry=r,
        )
        self.experts_per_token = histogram(
            "experts_per_token",
            "Mean experts per token of each finished request (policy: fixed, top_p, or auto)",
            ["policy"],
            EXPERT_BUCKETS,
        )
        self.engines = _EngineCollector(expert_metrics)
        r.register(self.engines)

    def watch(self, name: str, engine: AsyncEngine, quality: QualityTable | None) -> None:
        """Export a served model's queue, cache and expert-load figures and its quality table."""
        self.engines.models[name] = (engine, quality)

    def count_tokens(self, name: str, k: int | str | None, streams: Iterable[GenerationStream]) -> None:
        """Count the generated tokens of these streams as the server reads them, step by step (a long
        request's tokens show in the rate while it runs, not all at once when it finishes)."""
        counter = self.generation_tokens.labels(name, str(k))

        def generated(count: int) -> None:
            if count:
                counter.inc(count)
                self.recent.add_tokens(name, count)

        for stream in streams:
            stream.on_tokens = generated

    def record_generation(
        self, name: str, endpoint: str, k: int | str | None, prompt_tokens: int, metrics: RequestMetrics | None
    ) -> None:
        """Latency and prompt-token metrics of one finished prompt (all its completions); its generated tokens
        were counted as they came (count_tokens)."""
        if metrics is None:
            return
        label = str(k)
        self.prompt_tokens.labels(name, label).inc(prompt_tokens)
        finish = max((t.token_times[-1] for t in metrics.sequences if t.token_times), default=None)
        if finish is not None:
            self.e2e.labels(name, label, endpoint).observe(finish - metrics.arrival_time)
            self.recent.add_latency(name, endpoint, label, finish - metrics.arrival_time)
        for timing in metrics.sequences:
            if timing.first_scheduled_time is not None:
                self.queue.labels(name, label).observe(timing.first_scheduled_time - metrics.arrival_time)
            if timing.token_times:
                self.ttft.labels(name, label).observe(timing.token_times[0] - metrics.arrival_time)
                self.recent.add_ttft(name, label, timing.token_times[0] - metrics.arrival_time)
            for before, after in zip(timing.token_times, timing.token_times[1:], strict=False):
                self.itl.labels(name, label).observe(after - before)

    def record_pooling(self, name: str, endpoint: str, k: int | str | None, seconds: float, prompt_tokens: int) -> None:
        self.e2e.labels(name, str(k), endpoint).observe(seconds)
        self.recent.add_latency(name, endpoint, str(k), seconds)
        self.prompt_tokens.labels(name, str(k)).inc(prompt_tokens)

    def record_experts(self, name: str, spec: KSpec, experts: ExpertCounts | None) -> None:
        """The mean k one finished request's tokens took (nothing for a dense model)."""
        mean = experts.mean if experts is not None else None
        if mean is not None:
            self.experts_per_token.labels(name, spec.policy).observe(mean)


class _EngineCollector(Collector):
    """Gauges and counters read from each served engine at scrape time."""

    def __init__(self, expert_metrics: ExpertMetrics) -> None:
        self.expert_metrics = expert_metrics
        self.models: dict[str, tuple[AsyncEngine, QualityTable | None]] = {}

    def collect(self) -> Iterator[Any]:
        gauge = GaugeMetricFamily
        running = gauge("moe_serve_num_requests_running", "Sequences in the running batch", labels=["model"])
        waiting = gauge("moe_serve_num_requests_waiting", "Sequences waiting for a slot or KV budget", labels=["model"])
        kv = gauge("moe_serve_kv_cache_usage_ratio", "Share of the KV-cache blocks held by sequences", labels=["model"])
        kv_bytes = gauge(
            "moe_serve_kv_cache_bytes",
            "KV-cache memory: allocated (once, from the budget) and in use",
            labels=["model", "state"],
        )
        prefix_queries = CounterMetricFamily(
            "moe_serve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels=["model"]
        )
        prefix_hits = CounterMetricFamily(
            "moe_serve_prefix_cache_hits", "Prompt tokens found in the prefix cache", labels=["model"]
        )
        quality = gauge(
            "moe_serve_quality",
            "Quality against k (quality.json); weights: the format measured (float, bf16, int8, int4)",
            labels=["model", "k", "metric", "dataset", "weights"],
        )
        tokens = CounterMetricFamily(
            "moe_serve_expert_tokens", "Tokens routed to each expert", labels=["model", "layer", "expert"]
        )
        entropy = gauge(
            "moe_serve_expert_load_entropy",
            "Normalised entropy of the expert load (1 = uniform)",
            labels=["model", "layer"],
        )
        share = gauge(
            "moe_serve_expert_load_max_share", "Largest expert's share of the load", labels=["model", "layer"]
        )
        auto_k = gauge(
            "moe_serve_auto_experts_per_token",
            'The k that experts_per_token "auto" requests run with now (with --target-itl-ms)',
            labels=["model"],
        )
        for name, (engine, table) in self.models.items():
            running.add_metric([name], engine.num_running)
            if engine.auto_k is not None:
                auto_k.add_metric([name], engine.auto_k)
            waiting.add_metric([name], engine.num_waiting)
            kv.add_metric([name], engine.kv_cache_usage)
            allocated, used = engine.kv_cache_bytes
            kv_bytes.add_metric([name, "allocated"], allocated)
            kv_bytes.add_metric([name, "used"], used)
            queried, hits = engine.prefix_cache
            prefix_queries.add_metric([name], queried)
            prefix_hits.add_metric([name], hits)
            for row in table.rows if table else ():
                if row.policy is None:  # gauges by fixed k; an adaptive run's k is a measurement, not a label
                    quality.add_metric([name, str(row.k), row.metric, row.dataset, row.weights or "float"], row.value)
            if self.expert_metrics == "off" or engine.expert_load is None:
                continue
            for layer, counts in engine.expert_load.totals().items():
                if not any(counts):
                    continue
                if self.expert_metrics == "full":
                    for expert, count in enumerate(counts):
                        tokens.add_metric([name, str(layer), str(expert)], count)
                entropy.add_metric([name, str(layer)], normalised_entropy(counts))
                share.add_metric([name, str(layer)], max_share(counts))
        yield from (running, waiting, kv, kv_bytes, prefix_queries, prefix_hits, quality, tokens, entropy, share)
        yield auto_k
