"""Prometheus metrics with vLLM's names under an asyncllm: prefix, one registry per app."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from asyncllm.engine.async_llm import AsyncLLM
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams
from asyncllm.spec_decode.metrics import SpecDecodingStats

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_TOKEN_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# vLLM's buckets for these
_TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_PHASE_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_N_BUCKETS = (1, 2, 5, 10, 20)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class EngineStatsCollector(Collector):
    """Reads the engine's scheduler, KV cache and step figures at scrape time: no bookkeeping
    on the hot path."""

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
        yield self._iteration_tokens()
        if stats.spec_decoding is not None:
            yield from self._spec_decoding(stats.spec_decoding)

    def _spec_decoding(self, spec: SpecDecodingStats) -> Iterator[Metric]:
        """vLLM's speculative decoding counters."""
        yield self._counter("spec_decode_num_drafts", "Verify steps of one request with drafts.", spec.num_drafts)  # fmt: skip
        yield self._counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens)  # fmt: skip
        yield self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens)  # fmt: skip
        per_pos = CounterMetricFamily(
            "asyncllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position.",
            labels=["model_name", "position"],
        )
        for position, n in enumerate(spec.num_accepted_tokens_per_pos):
            per_pos.add_metric([*self.labels, str(position)], n)
        yield per_pos

    def _iteration_tokens(self) -> Metric:
        """vLLM's histogram of the tokens each engine step computed, from the engine's count of
        steps by size."""
        steps = self.engine.steps_by_num_tokens
        buckets = [
            (floatToGoString(bound), sum(n for size, n in steps.items() if size <= bound))
            for bound in _ITERATION_TOKEN_BUCKETS
        ]
        buckets.append(("+Inf", steps.total()))
        metric = HistogramMetricFamily(
            "asyncllm:iteration_tokens_total", "Tokens per engine step.", labels=["model_name"]
        )
        total = sum(size * n for size, n in steps.items())
        metric.add_metric(self.labels, buckets, sum_value=total)
        return metric

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
        self.model_name = model_name
        self._add_token_metrics(engine.config.model.max_model_len)
        self._add_latency_metrics()
        self.request_success = Counter(
            "asyncllm:request_success",
            "Finished samples, by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._add_cache_config_info(engine)

    def _counter(self, name: str, doc: str) -> Counter:
        metric = Counter(f"asyncllm:{name}", doc, ["model_name"], registry=self.registry)
        return metric.labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        metric = Histogram(
            f"asyncllm:{name}", doc, ["model_name"], registry=self.registry, buckets=buckets
        )
        return metric.labels(self.model_name)

    def _add_token_metrics(self, max_model_len: int) -> None:
        counts = _one_two_five_buckets(max_model_len)
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated.")
        self.request_prompt_tokens = self._histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", counts
        )
        self.request_generation_tokens = self._histogram(
            "request_generation_tokens", "Tokens generated per finished request.", counts
        )
        self.request_max_num_generation_tokens = self._histogram(
            "request_max_num_generation_tokens",
            "The most tokens one sample of a finished request generated.",
            counts,
        )
        self.request_params_n = self._histogram(
            "request_params_n", "The n of finished requests.", _N_BUCKETS
        )

    def _add_latency_metrics(self) -> None:
        def latency(name: str, doc: str, buckets: Sequence[float] = _LATENCY_BUCKETS) -> Histogram:
            return self._histogram(name, doc, buckets)

        self.time_to_first_token = latency("time_to_first_token_seconds", "Arrival to first token.")
        self.inter_token_latency = latency(
            "inter_token_latency_seconds", "Time between tokens.", _TOKEN_LATENCY_BUCKETS
        )
        # vLLM keeps this name, observed like inter_token_latency, for its dashboards
        self.time_per_output_token = latency(
            "time_per_output_token_seconds", "Time between tokens.", _TPOT_BUCKETS
        )
        self.e2e_request_latency = latency("e2e_request_latency_seconds", "Arrival to finish.")
        self.request_queue_time = latency(
            "request_queue_time_seconds", "Arrival to first scheduled."
        )
        self.request_prefill_time = latency(
            "request_prefill_time_seconds", "First scheduled to first token.", _PHASE_BUCKETS
        )
        self.request_decode_time = latency(
            "request_decode_time_seconds", "First token to finish.", _PHASE_BUCKETS
        )
        self.request_inference_time = latency(
            "request_inference_time_seconds", "First scheduled to finish.", _PHASE_BUCKETS
        )

    def _add_cache_config_info(self, engine: AsyncLLM) -> None:
        args = engine.config.args
        info = {
            "block_size": args.block_size,
            "enable_prefix_caching": args.enable_prefix_caching,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "num_gpu_blocks": args.num_kv_blocks,  # None: sized from free memory
        }
        gauge = Gauge(
            "asyncllm:cache_config_info",
            "The KV cache's configuration, in the labels.",
            list(info),
            registry=self.registry,
        )
        gauge.labels(*map(str, info.values())).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self, params: SamplingParams) -> RequestTracker:
        return RequestTracker(self, params)


class RequestTracker:
    """Times one engine request from its stream of outputs (delta or final-only)."""

    def __init__(self, metrics: ServerMetrics, params: SamplingParams) -> None:
        self.metrics = metrics
        self.params = params
        self.started = False
        self.finished = False
        self.last_token_time: float | None = None
        self.generated: dict[int, int] = {}  # per sample
        self.finished_samples: set[int] = set()

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        arrival = output.metrics.get("arrival_time", now)
        if not self.started:
            self.started = True
            m.prompt_tokens.inc(len(output.prompt_token_ids))
            if "first_scheduled_time" in output.metrics:
                m.request_queue_time.observe(output.metrics["first_scheduled_time"] - arrival)
        num_tokens = self._count(output)
        if num_tokens:
            m.generation_tokens.inc(num_tokens)
            self._observe_token_times(output, arrival, now, num_tokens)
        if output.finished:
            self.finished = True
            m.e2e_request_latency.observe(now - arrival)
            self._observe_finished(output, now)

    def abort(self) -> None:
        """The request's stream ended early: its samples that had not finished were aborted."""
        aborted = self.params.n - len(self.finished_samples)
        if not self.finished and aborted > 0:
            self.metrics.request_success.labels(self.metrics.model_name, "abort").inc(aborted)

    def _count(self, output: RequestOutput) -> int:
        num_tokens = 0
        for completion in output.outputs:
            num_tokens += len(completion.token_ids)
            index = completion.index
            self.generated[index] = self.generated.get(index, 0) + len(completion.token_ids)
            if completion.finished and index not in self.finished_samples:
                self.finished_samples.add(index)
                reason = completion.finish_reason
                self.metrics.request_success.labels(self.metrics.model_name, reason).inc()
        return num_tokens

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
                self.metrics.time_per_output_token.observe(gap)
        self.last_token_time = now

    def _observe_finished(self, output: RequestOutput, now: float) -> None:
        m = self.metrics
        m.request_prompt_tokens.observe(len(output.prompt_token_ids))
        m.request_generation_tokens.observe(sum(self.generated.values()))
        m.request_max_num_generation_tokens.observe(max(self.generated.values(), default=0))
        m.request_params_n.observe(self.params.n)
        scheduled = output.metrics.get("first_scheduled_time")
        first_token = output.metrics.get("first_token_time")
        if scheduled is not None:
            m.request_inference_time.observe(now - scheduled)
        if scheduled is not None and first_token is not None:
            m.request_prefill_time.observe(first_token - scheduled)
            m.request_decode_time.observe(now - first_token)


def _one_two_five_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to limit: vLLM's buckets for token counts."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10
