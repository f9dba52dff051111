"""Prometheus collectors (prefix moe_serve_, base units, `model` label; latency histograms by `k`) and
the functions that record into them. One registry per app, so tests can run several apps."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from moe_serve.artifact import Artifact
from moe_serve.engine.sequence import Sequence
from server.settings import ExpertMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self, expert_metrics: ExpertMetrics = "full") -> None:
        self.registry = CollectorRegistry()
        self.expert_metrics = expert_metrics
        r = self.registry
        self.requests = Counter("moe_serve_requests", "HTTP requests by endpoint and status", ["endpoint", "status", "model"], registry=r)
        self.e2e = Histogram("moe_serve_e2e_request_latency_seconds", "End-to-end request latency", ["model", "k", "endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("moe_serve_time_to_first_token_seconds", "Time from arrival to the first generated token", ["model", "k"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("moe_serve_inter_token_latency_seconds", "Time between consecutive generated tokens", ["model", "k"], buckets=TOKEN_BUCKETS, registry=r)
        self.queue = Histogram("moe_serve_request_queue_time_seconds", "Time from arrival to the first scheduled step", ["model", "k"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("moe_serve_prompt_tokens", "Prompt tokens processed", ["model", "k"], registry=r)
        self.generation_tokens = Counter("moe_serve_generation_tokens", "Tokens generated", ["model", "k"], registry=r)
        self.running = Gauge("moe_serve_num_requests_running", "Sequences in the running batch", ["model"], registry=r)
        self.waiting = Gauge("moe_serve_num_requests_waiting", "Sequences waiting for a slot or KV budget", ["model"], registry=r)
        self.kv_usage = Gauge("moe_serve_kv_cache_usage_ratio", "KV-cache tokens reserved by running sequences / budget", ["model"], registry=r)
        self.expert_tokens = Counter("moe_serve_expert_tokens", "Tokens routed to each expert", ["model", "layer", "expert"], registry=r)
        self.expert_entropy = Gauge("moe_serve_expert_load_entropy", "Normalised entropy of the cumulative expert load per layer (1 = uniform)", ["model", "layer"], registry=r)
        self.expert_max_share = Gauge("moe_serve_expert_load_max_share", "Largest expert's share of the cumulative load per layer", ["model", "layer"], registry=r)
        self.quality = Gauge("moe_serve_quality", "Quality against k from the artifact's quality.json", ["model", "k", "metric", "dataset"], registry=r)
        self._cumulative: dict[tuple[str, int], list[float]] = {}

    def register_model(self, name: str, artifact: Artifact) -> None:
        for row in (artifact.quality or {}).get("results", []):
            self.quality.labels(name, str(row["k"]), row["metric"], row["dataset"]).set(row["value"])
        self.running.labels(name).set(0)
        self.waiting.labels(name).set(0)

    def record_engine(self, name: str, running: int, waiting: int, kv_usage: float, expert_load: dict[int, list[int]]) -> None:
        self.running.labels(name).set(running)
        self.waiting.labels(name).set(waiting)
        self.kv_usage.labels(name).set(kv_usage)
        if self.expert_metrics == "off":
            return
        for layer, counts in expert_load.items():
            if not any(counts):
                continue
            if self.expert_metrics == "full":
                for expert, count in enumerate(counts):
                    if count:
                        self.expert_tokens.labels(name, str(layer), str(expert)).inc(count)
            total = self._cumulative.setdefault((name, layer), [0.0] * len(counts))
            for expert, count in enumerate(counts):
                total[expert] += count
            mass = sum(total)
            shares = [c / mass for c in total if c]
            entropy = -sum(p * math.log(p) for p in shares) / math.log(len(total)) if len(total) > 1 else 1.0
            self.expert_entropy.labels(name, str(layer)).set(entropy)
            self.expert_max_share.labels(name, str(layer)).set(max(shares))

    def record_generation(self, name: str, endpoint: str, seqs: list[Sequence]) -> None:
        """Latency and token metrics of a finished generation request (all its completions)."""
        if not seqs:
            return
        k = str(seqs[0].experts_per_token)
        arrival = seqs[0].arrival_time
        self.prompt_tokens.labels(name, k).inc(len(seqs[0].prompt_token_ids))
        finish = max((s.token_times[-1] for s in seqs if s.token_times), default=None)
        if finish is not None:
            self.e2e.labels(name, k, endpoint).observe(finish - arrival)
        for seq in seqs:
            self.generation_tokens.labels(name, k).inc(len(seq.output_token_ids))
            if seq.first_scheduled_time is not None:
                self.queue.labels(name, k).observe(seq.first_scheduled_time - arrival)
            if seq.token_times:
                self.ttft.labels(name, k).observe(seq.token_times[0] - arrival)
            for before, after in zip(seq.token_times, seq.token_times[1:]):
                self.itl.labels(name, k).observe(after - before)

    def record_pooling(self, name: str, endpoint: str, k: int | None, seconds: float, prompt_tokens: int) -> None:
        self.e2e.labels(name, str(k), endpoint).observe(seconds)
        self.prompt_tokens.labels(name, str(k)).inc(prompt_tokens)
