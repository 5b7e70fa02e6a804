"""Prometheus metrics of the server, named as vLLM's under a `kestrel:` prefix, in a per-app registry.

Engine gauges and counters are read from the engine thread's latest stats snapshot at scrape
time; latency histograms are observed by the server as each request's outputs arrive.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kestrel.entrypoints.async_engine import AsyncEngine
from kestrel.outputs import RequestOutput

PREFIX = "kestrel:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self._engine = engine
        self._labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        gauges = (
            ("num_requests_running", "Sequences in the running batch.", stats.num_running),
            ("num_requests_waiting", "Sequences waiting to be scheduled (preempted ones included).",
             stats.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", stats.kv_cache_usage),
            ("engine_healthy", "1 while the engine thread runs, 0 once it stopped.", int(self._engine.is_healthy)),
        )
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            gauge.add_metric(self._labels, value)
            yield gauge
        counters = (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
            ("num_preemptions", "Sequences preempted (to be recomputed).", stats.num_preemptions),
            ("prompt_tokens", "Prompt tokens received.", stats.num_prompt_tokens),
            ("generation_tokens", "Tokens generated.", stats.num_generation_tokens),
        )
        for name, doc, value in counters:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric(self._labels, value)
            yield counter


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine, model_name))
        labels = ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to the first generated token.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between successive outputs.",
                             labels, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to the last token.",
                             labels, buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._model_name = model_name

    def tracker(self, arrival: float | None = None) -> RequestTracker:
        return RequestTracker(self, arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def finished(self, reason: str) -> None:
        self._success.labels(self._model_name, reason).inc()


class RequestTracker:
    """Latency of one engine request as the server sees it, from `arrival` (time.monotonic())."""

    def __init__(self, metrics: ServerMetrics, arrival: float | None = None) -> None:
        self._metrics = metrics
        self._arrival = time.monotonic() if arrival is None else arrival
        self._last_token: float | None = None
        self._done = False

    def observe(self, output: RequestOutput) -> None:
        if self._done:
            return
        now = time.monotonic()
        if any(c.delta_token_ids for c in output.outputs):
            if self._last_token is None:
                self._metrics.ttft.observe(now - self._arrival)
            else:
                self._metrics.itl.observe(now - self._last_token)
            self._last_token = now
        if output.finished:
            self._done = True
            self._metrics.e2e.observe(now - self._arrival)
            for completion in output.outputs:
                self._metrics.finished(completion.finish_reason or "abort")

    def aborted(self) -> None:
        """The request ended without its final output (the client left, or it timed out): counted as an abort,
        its latency so far in the end-to-end histogram."""
        if self._done:
            return
        self._done = True
        self._metrics.e2e.observe(time.monotonic() - self._arrival)
        self._metrics.finished("abort")
