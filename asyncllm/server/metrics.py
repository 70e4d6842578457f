"""Prometheus metrics with vLLM's names under an asyncllm: prefix, one registry per app."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from asyncllm.engine.async_llm import AsyncLLM
from asyncllm.outputs import RequestOutput

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_TOKEN_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class EngineStatsCollector(Collector):
    """Reads the engine's scheduler and KV cache figures at scrape time: no bookkeeping on the
    hot path."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        yield self._gauge(
            "num_requests_running", "Requests in the running batch.", stats.num_running
        )
        yield self._gauge(
            "num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting
        )
        yield self._gauge(
            "kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (0..1).",
            stats.kv_cache_usage,
        )
        yield self._counter("num_preemptions", "Preemptions since start.", stats.num_preemptions)
        yield self._counter(
            "prefix_cache_queries",
            "Tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        )
        yield self._counter("prefix_cache_hits", "Tokens found in the prefix cache.", stats.prefix_cache_hits)  # fmt: skip

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        metric = GaugeMetricFamily(f"asyncllm:{name}", doc, labels=["model_name"])
        metric.add_metric(self.labels, value)
        return metric

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        metric = CounterMetricFamily(f"asyncllm:{name}", doc, labels=["model_name"])
        metric.add_metric(self.labels, value)
        return metric


class ServerMetrics:
    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(engine, model_name))
        # what prometheus_client's default registry adds, as vLLM's /metrics has it: the
        # process's CPU time and memory, the Python GC's collections, the Python version
        for collector in (ProcessCollector, GCCollector, PlatformCollector):
            collector(registry=self.registry)
        labels = {"labelnames": ["model_name"], "registry": self.registry}

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"asyncllm:{name}", doc, **labels).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"asyncllm:{name}", doc, buckets=buckets, **labels).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between tokens.", _TOKEN_LATENCY_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Times one engine request from its stream of outputs (delta or final-only)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.started = False
        self.last_token_time: float | None = None

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        arrival = output.metrics.get("arrival_time", now)
        if not self.started:
            self.started = True
            m.prompt_tokens.inc(len(output.prompt_token_ids))
            if "first_scheduled_time" in output.metrics:
                m.request_queue_time.observe(output.metrics["first_scheduled_time"] - arrival)
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        if num_tokens:
            m.generation_tokens.inc(num_tokens)
            self._observe_token_times(output, arrival, now, num_tokens)
        if output.finished:
            m.e2e_request_latency.observe(now - arrival)

    def _observe_token_times(
        self, output: RequestOutput, arrival: float, now: float, num_tokens: int
    ) -> None:
        first = output.metrics.get("first_token_time", now)
        if self.last_token_time is None:
            self.metrics.time_to_first_token.observe(first - arrival)
            self.last_token_time, num_tokens = first, num_tokens - 1
        if num_tokens > 0:  # several tokens merged into one delta share its gap
            gap = (now - self.last_token_time) / num_tokens
            for _ in range(num_tokens):
                self.metrics.inter_token_latency.observe(gap)
        self.last_token_time = now
