"""Prometheus metrics of the server with vLLM's names and labels (`model_name`, `engine`), in a per-app registry,
exposed twice: under `kestrel:` and under `vllm:`, so that vLLM's dashboards and alerts work unchanged. One
registry holds each series once; the `vllm:` copy is written from it at scrape time (the same samples renamed),
so the two can never disagree.

Engine gauges and counters are read from the engine thread's latest stats snapshot at scrape
time; latency histograms are observed by the server as each request's outputs arrive, the per-phase ones
(queue, prefill, decode, inference) from the engine's timestamps in the request's final output.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kestrel.entrypoints.async_engine import ITERATION_TOKEN_BUCKETS, AsyncEngine
from kestrel.outputs import RequestOutput

PREFIX = "kestrel:"
VLLM_PREFIX = "vllm:"
ENGINE_INDEX = "0"  # vLLM labels every series with its engine's index; one engine per kestrel server
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
N_BUCKETS = (1, 2, 5, 10, 20)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               10.0, 20.0, 40.0, 80.0)
PREEMPTION_BUCKETS = (0, 1, 2, 3, 4, 5, 10, 20)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self._engine = engine
        self._labels = [model_name, ENGINE_INDEX]

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
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
            gauge.add_metric(self._labels, value)
            yield gauge
        counters = (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
            ("num_preemptions", "Sequences preempted (to be recomputed).", stats.num_preemptions),
            ("prompt_tokens", "Prompt tokens received.", stats.num_prompt_tokens),
            ("generation_tokens", "Tokens generated.", stats.num_generation_tokens),
            ("spec_decode_num_drafts", "Speculative verify steps (one per request and step).",
             stats.spec_num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens verified.", stats.spec_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.spec_num_accepted_tokens),
        )
        for name, doc, value in counters:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
            counter.add_metric(self._labels, value)
            yield counter
        per_position = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted, by position in the draft.",
                                           labels=[*LABELS, "position"])
        for position, accepted in enumerate(stats.spec_accepted_per_position):
            per_position.add_metric([*self._labels, str(position)], accepted)
        yield per_position
        iterations = HistogramMetricFamily(PREFIX + "iteration_tokens_total", "Tokens run through the model per "
                                           "engine step.", labels=LABELS)
        buckets = [(str(float(b)), c) for b, c in zip(ITERATION_TOKEN_BUCKETS, stats.iteration_buckets)]
        iterations.add_metric(self._labels, [*buckets, ("+Inf", stats.iteration_count)],
                              sum_value=stats.iteration_sum)
        yield iterations
        if self._engine.core.config.expert_load_metrics:
            yield self._expert_load(stats.expert_load)
        cache = self._engine.core.config.cache
        info = GaugeMetricFamily(PREFIX + "cache_config_info", "The KV cache's configuration (value 1).",
                                 labels=[*LABELS, "block_size", "cache_dtype", "num_gpu_blocks",
                                         "enable_prefix_caching", "gpu_memory_utilization"])
        info.add_metric([*self._labels, str(cache.block_size), cache.kv_cache_dtype,
                         str(self._engine.core.num_blocks), str(cache.enable_prefix_caching),
                         str(cache.gpu_memory_utilization)], 1)
        yield info

    def _expert_load(self, load: dict[int, list[int]]) -> Metric:
        """One sample per (MoE layer, expert): empty until the runner's first report."""
        family = CounterMetricFamily(PREFIX + "moe_expert_tokens", "Tokens routed to each expert of each "
                                     "mixture-of-experts layer (one per token and chosen expert; reported every "
                                     "expert_load_interval steps).", labels=[*LABELS, "layer", "expert"])
        for layer, counts in sorted(load.items()):
            for expert, count in enumerate(counts):
                family.add_metric([*self._labels, str(layer), str(expert)], count)
        return family


LABELS = ["model_name", "engine"]


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine, model_name))

        def histogram(name: str, doc: str, buckets: tuple) -> Any:
            return Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=self.registry).labels(
                model_name, ENGINE_INDEX)

        self.ttft = histogram("time_to_first_token_seconds", "Time to the first generated token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between successive outputs.", ITL_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Time per output token after the first (vLLM's "
                              "older name of the inter-token latency).", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token.", E2E_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to the first token.",
                                 REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to the last token.",
                                REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "First scheduled to the last token.",
                                   REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of finished requests.",
                                       TOKEN_COUNT_BUCKETS)
        self.generation_tokens = histogram("request_generation_tokens", "Generated tokens of finished requests.",
                                           TOKEN_COUNT_BUCKETS)
        self.max_generation_tokens = histogram("request_max_num_generation_tokens", "Per finished request, the "
                                               "generated tokens of its longest completion (of its n).",
                                               TOKEN_COUNT_BUCKETS)
        self.request_tpot = histogram("request_time_per_output_token_seconds", "Per finished request: its decode "
                                      "time over its output tokens after the first (of its longest completion).",
                                      ITL_BUCKETS)
        self.prefill_kv_computed = histogram("request_prefill_kv_computed_tokens", "Prompt tokens a finished "
                                             "request's prefill computed (the prefix cache served the rest).",
                                             TOKEN_COUNT_BUCKETS)
        self.request_preemptions = histogram("request_num_preemptions", "Preemptions a finished request went "
                                             "through (all its n sequences).", PREEMPTION_BUCKETS)
        self.prompt_tokens_cached = Counter(PREFIX + "prompt_tokens_cached", "Prompt tokens the prefix cache "
                                            "served, counted as each request's first output arrives.", LABELS,
                                            registry=self.registry).labels(model_name, ENGINE_INDEX)
        self.params_n = histogram("request_params_n", "The n of finished requests.", N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "The max_tokens of finished requests.",
                                           TOKEN_COUNT_BUCKETS)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason (one per request, "
                                "whatever its n; the count of e2e_request_latency_seconds).",
                                [*LABELS, "finished_reason"], registry=self.registry)
        for reason in _REASON_PRECEDENCE:  # each reason's series from the start, at 0 (as vLLM's), for dashboards
            self._success.labels(model_name, ENGINE_INDEX, reason)
        self.compression_saved_tokens = Counter(
            PREFIX + "prompt_compression_saved_tokens", "Prompt tokens prompt compression removed (the served "
            "model's tokens, before minus after).", LABELS, registry=self.registry).labels(model_name, ENGINE_INDEX)
        self.compression_seconds = histogram("prompt_compression_seconds", "Time the compressor took per request "
                                             "(scoring and selection, its queue not included).",
                                             REQUEST_LATENCY_BUCKETS)
        self._model_name = model_name

    def observe_compression(self, saved_tokens: int, seconds: float) -> None:
        self.compression_saved_tokens.inc(max(saved_tokens, 0))
        self.compression_seconds.observe(seconds)

    def tracker(self, arrival: float | None = None, params: Any = None) -> RequestTracker:
        return RequestTracker(self, arrival, params)

    def render(self) -> bytes:
        """Every series under `kestrel:`, then the same under `vllm:`."""
        text = generate_latest(self.registry)
        return text + _renamed(text, PREFIX.encode(), VLLM_PREFIX.encode())

    def finished(self, reason: str) -> None:
        self._success.labels(self._model_name, ENGINE_INDEX, reason).inc()

    def observe_final(self, output: RequestOutput, params: Any, generated: list[int]) -> None:
        """The per-phase latencies and the sizes of a finished engine request (its engine timestamps); `generated`:
        each sequence's number of tokens (the request's outputs counted them: a delta output holds only its
        step's)."""
        m = output.metrics
        if m is not None and m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                self.prefill.observe(m.first_token_time - m.first_scheduled_time)
            if m.finished_time is not None:
                self.inference.observe(m.finished_time - m.first_scheduled_time)
                if m.first_token_time is not None:
                    self.decode.observe(m.finished_time - m.first_token_time)
                    longest = max(generated, default=0)
                    if longest > 1:
                        self.request_tpot.observe((m.finished_time - m.first_token_time) / (longest - 1))
        if m is not None:
            self.request_preemptions.observe(m.num_preemptions)
        self.prefill_kv_computed.observe(len(output.prompt_token_ids) - output.num_cached_tokens)
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        self.generation_tokens.observe(sum(generated))
        self.max_generation_tokens.observe(max(generated, default=0))
        if params is not None:
            self.params_n.observe(params.n)
            if params.max_tokens is not None:
                self.params_max_tokens.observe(params.max_tokens)


def _renamed(text: bytes, old: bytes, new: bytes) -> bytes:
    """The exposition text with every metric name's prefix `old` replaced (names start a sample line or follow
    '# HELP ' / '# TYPE '; label values are left alone)."""
    out = []
    for line in text.splitlines(keepends=True):
        if line.startswith(old):
            line = new + line[len(old):]
        elif line.startswith((b"# HELP " + old, b"# TYPE " + old)):
            line = line[:7] + new + line[7 + len(old):]
        out.append(line)
    return b"".join(out)


_REASON_PRECEDENCE = ("abort", "length", "stop")


def request_finish_reason(finish_reasons: list[str | None]) -> str:
    """One finish reason for a request from those of its n completions: the first of abort, length, stop that one
    of them has (a completion without a reason counts as aborted; an unknown reason is kept)."""
    reasons = {reason or "abort" for reason in finish_reasons} or {"abort"}
    return next((r for r in _REASON_PRECEDENCE if r in reasons), min(reasons))


class RequestTracker:
    """Latency of one engine request as the server sees it, from `arrival` (time.monotonic()). It counts the
    request once in request_success whatever its n, as in e2e_request_latency_seconds, so the two agree (vLLM
    counts each of the n sequences, its engine requests, in both)."""

    def __init__(self, metrics: ServerMetrics, arrival: float | None = None, params: Any = None) -> None:
        self._metrics = metrics
        self._params = params
        self._arrival = time.monotonic() if arrival is None else arrival
        self._last_token: float | None = None
        self._done = False
        self._cache_counted = False
        # Per sequence index, from each output's delta (cumulative and delta outputs alike; a delta output holds
        # only the sequences its step changed): tokens so far, and how it ended.
        self._generated: dict[int, int] = {}
        self._finish_reasons: dict[int, str | None] = {}

    def observe(self, output: RequestOutput) -> None:
        if self._done:
            return
        now = time.monotonic()
        if not self._cache_counted:  # the first output comes once the prompt ran: its cache hit is known
            self._cache_counted = True
            self._metrics.prompt_tokens_cached.inc(output.num_cached_tokens)
        generated, new_tokens = self._generated, False
        for c in output.outputs:
            if c.delta_token_ids:
                generated[c.index] = generated.get(c.index, 0) + len(c.delta_token_ids)
                new_tokens = True
            if c.finish_reason is not None:
                self._finish_reasons[c.index] = c.finish_reason
        if new_tokens:
            if self._last_token is None:
                self._metrics.ttft.observe(now - self._arrival)
            else:
                self._metrics.itl.observe(now - self._last_token)
                self._metrics.tpot.observe(now - self._last_token)
            self._last_token = now
        if output.finished:
            self._done = True
            self._metrics.e2e.observe(now - self._arrival)
            self._metrics.observe_final(output, self._params, list(self._generated.values()))
            indices = (range(self._params.n) if self._params is not None
                       else sorted(self._generated.keys() | self._finish_reasons.keys()))
            self._metrics.finished(request_finish_reason([self._finish_reasons.get(i) for i in indices]))

    def aborted(self) -> None:
        """The request ended without its final output (the client left, or it timed out): counted as an abort,
        its latency so far in the end-to-end histogram."""
        if self._done:
            return
        self._done = True
        self._metrics.e2e.observe(time.monotonic() - self._arrival)
        self._metrics.finished("abort")
