"""Prometheus collectors (prefix moe_serve_, base units, `model` label; latency histograms by `k`, which is
"top_p" for requests with a `moe` policy and "auto" for experts_per_token "auto"; the mean k of each
request by policy; the k "auto" runs with now) and the functions that record into them. Queue, cache,
expert-load, auto-k and quality figures are read from the served engines when Prometheus scrapes, so they
are never stale. One registry per app, so tests can run several."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from moe_serve.engine.async_engine import AsyncEngine
from moe_serve.engine.expert_load import max_share, normalised_entropy
from moe_serve.moe_policy import KSpec
from moe_serve.outputs import ExpertCounts, RequestMetrics
from moe_serve.quality import QualityTable
from moe_serve.server.settings import ExpertMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
EXPERT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0)


class Metrics:
    def __init__(self, expert_metrics: ExpertMetrics = "full") -> None:
        self.registry = r = CollectorRegistry()

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

    def record_generation(
        self, name: str, endpoint: str, k: int | str | None, prompt_tokens: int, metrics: RequestMetrics | None
    ) -> None:
        """Latency and token metrics of one finished prompt (all its completions)."""
        if metrics is None:
            return
        label = str(k)
        self.prompt_tokens.labels(name, label).inc(prompt_tokens)
        finish = max((t.token_times[-1] for t in metrics.sequences if t.token_times), default=None)
        if finish is not None:
            self.e2e.labels(name, label, endpoint).observe(finish - metrics.arrival_time)
        for timing in metrics.sequences:
            self.generation_tokens.labels(name, label).inc(len(timing.token_times))
            if timing.first_scheduled_time is not None:
                self.queue.labels(name, label).observe(timing.first_scheduled_time - metrics.arrival_time)
            if timing.token_times:
                self.ttft.labels(name, label).observe(timing.token_times[0] - metrics.arrival_time)
            for before, after in zip(timing.token_times, timing.token_times[1:], strict=False):
                self.itl.labels(name, label).observe(after - before)

    def record_pooling(self, name: str, endpoint: str, k: int | str | None, seconds: float, prompt_tokens: int) -> None:
        self.e2e.labels(name, str(k), endpoint).observe(seconds)
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
            "moe_serve_quality", "Quality against k (quality.json)", labels=["model", "k", "metric", "dataset"]
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
                    quality.add_metric([name, str(row.k), row.metric, row.dataset], row.value)
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
