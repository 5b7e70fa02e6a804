"""`kestrel bench serve`: an HTTP load generator for OpenAI-compatible streaming completions (BENCHMARKS.md "serve").

Talks HTTP only (`POST /v1/completions` with `stream: true`), so it measures any OpenAI-compatible server.
Prompts are random token ids of exactly `--input-len` tokens. Requests arrive either at a fixed concurrency
(N in flight, each finished request immediately replaced) or as a Poisson process of rate R, optionally capped
by `--max-concurrency`. Both `--concurrency` and `--request-rate` take a comma list to sweep levels in turn.

Metric definitions (as in `vllm bench serve`), per successful request:
- TTFT: first streamed token chunk minus the moment the request was sent;
- E2E: end of the stream (`data: [DONE]`) minus the moment the request was sent;
- TPOT: (E2E - TTFT) / (output tokens - 1), only for requests with more than one output token;
- ITL: every gap between successive token chunks, pooled over all requests.
A token chunk is one that carries text, or an intermediate one with empty text (see `is_token_chunk`).
Output tokens come from the final `usage` chunk when the server sends one, else one per token chunk.
A request fails on a non-200 status, an error in the stream, an exception, no token chunk, or no [DONE].
Throughputs divide totals over successful requests by the wall time from the first send to the last finish.
Under `--max-concurrency`, a request's clock starts when it is sent, not when it was scheduled to arrive.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

DEFAULT_VOCAB_SIZE = 1000  # ids below 1000 are valid in every supported model, the tiny one included
PERCENTILES = (50.0, 90.0, 99.0)
ERROR_TEXT_LIMIT = 300
# Past these the client's own delay may show in the latencies it measures (about 50 us of CPU per chunk here).
CLIENT_CPU_WARN = 0.7
CLIENT_LAG_WARN_MS = 5.0
# How long an idle pooled connection is reused. It must end well before the server's own idle timeout: uvicorn's
# default (vLLM's too, and kestrel's before --keep-alive-timeout) is 5 s, as was httpx's expiry, so a request sent
# on a connection idle for ~5 s met the server closing it: the request is reset unread (httpx ReadError or
# RemoteProtocolError, counted lost by `bench soak`) though it never reached the application, and a POST is not
# retried. The server's clock starts when it writes the response, before the client reads it, and a loaded client
# sends a request up to ~0.5 s after it took the connection from the pool: hence the margin.
KEEPALIVE_EXPIRY_S = 2.0


# ------------------------------------------------------------------------------------------------ records


@dataclass
class RequestRecord:
    """What the client saw of one request; times are `time.perf_counter()` seconds."""

    index: int
    start: float
    prompt_tokens: int
    max_tokens: int
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk reporting tokens
    end: float | None = None  # arrival of `data: [DONE]`
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    status: int | None = None
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None and self.end is not None and bool(self.chunk_times)

    @property
    def output_tokens(self) -> int:
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return len(self.chunk_times)

    @property
    def input_tokens(self) -> int:
        return self.usage_prompt_tokens if self.usage_prompt_tokens is not None else self.prompt_tokens


# ------------------------------------------------------------------------------------------------ metrics (pure)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} outside [0, 100]")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize_ms(values_s: Sequence[float]) -> dict[str, float | int | None]:
    """mean / std / median / p90 / p99 in milliseconds of durations given in seconds; None when there are none."""
    keys = ("mean", "std", "median", "p90", "p99")
    if not values_s:
        return {"count": 0, **dict.fromkeys(keys)}
    ms = [v * 1e3 for v in values_s]
    stats: dict[str, float | int | None] = {"count": len(ms), "mean": statistics.fmean(ms),
                                            "std": statistics.pstdev(ms)}
    for name, q in zip(("median", "p90", "p99"), PERCENTILES):
        stats[name] = percentile(ms, q)
    return stats


def request_latencies(record: RequestRecord) -> tuple[float, float, float | None, list[float]]:
    """(TTFT, E2E, TPOT or None, ITL gaps) in seconds for one successful record."""
    if not record.success or record.end is None:
        raise ValueError(f"request {record.index} did not succeed")
    ttft = record.chunk_times[0] - record.start
    e2e = record.end - record.start
    out = record.output_tokens
    tpot = (e2e - ttft) / (out - 1) if out > 1 else None
    itl = [b - a for a, b in zip(record.chunk_times, record.chunk_times[1:])]
    return ttft, e2e, tpot, itl


def error_counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    counts = Counter(r.error or "no text chunk or no [DONE]" for r in records if not r.success)
    return dict(counts.most_common())


LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def latency_samples(ok: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Seconds of each LATENCY_METRICS name over successful records: TTFT, TPOT (requests with more than one
    output token), every ITL gap, E2E."""
    samples: dict[str, list[float]] = {name: [] for name in LATENCY_METRICS}
    for r in ok:
        ttft, e2e, tpot, gaps = request_latencies(r)
        samples["ttft"].append(ttft)
        samples["e2el"].append(e2e)
        if tpot is not None:
            samples["tpot"].append(tpot)
        samples["itl"].extend(gaps)
    return samples


def compute_metrics(records: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    """Aggregate metrics of one benchmark level; failed requests are counted, never measured."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    ok = [r for r in records if r.success]
    samples = latency_samples(ok)
    total_in = sum(r.input_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    return {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        # with ignore_eos every request should produce max_tokens; fewer means the server stopped early
        "short_outputs": sum(1 for r in ok if r.output_tokens < r.max_tokens),
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft_ms": summarize_ms(samples["ttft"]),
        "tpot_ms": summarize_ms(samples["tpot"]),
        "itl_ms": summarize_ms(samples["itl"]),
        "e2e_ms": summarize_ms(samples["e2el"]),
        "errors": error_counts(records),
    }


def _percentile_key(q: float) -> str:
    return f"p{int(q)}" if float(q).is_integer() else f"p{q:g}"


def flat_metrics(records: Sequence[RequestRecord], metrics: dict[str, Any],
                 percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl"),
                 metric_percentiles: Sequence[float] = (99.0,),
                 goodput: dict[str, float] | None = None) -> dict[str, Any]:
    """`vllm bench serve`'s flat result keys for one level, beside its `compute_metrics` block: totals and
    throughputs, `request_goodput` (requests within every `goodput` SLO, in ms, per second), and mean / median /
    std / pXX of the chosen latencies."""
    ok = [r for r in records if r.success]
    samples = latency_samples(ok)
    duration = metrics["duration_s"]
    good = 0
    for r in ok if goodput else ():
        ttft, e2e, tpot, _ = request_latencies(r)
        per_request = {"ttft": ttft, "tpot": tpot or 0.0, "e2el": e2e}
        good += all(per_request[k] * 1e3 <= limit for k, limit in goodput.items())
    out: dict[str, Any] = {
        "duration": duration,
        **{k: metrics[k] for k in ("completed", "failed", "total_input_tokens", "total_output_tokens",
                                   "request_throughput")},
        "request_goodput": good / duration if goodput else None,
        **{k: metrics[k] for k in ("output_throughput", "total_token_throughput")},
        "input_lens": [r.input_tokens for r in records], "output_lens": [r.output_tokens for r in records],
    }
    for name in percentile_metrics:
        ms = [v * 1e3 for v in samples[name]]
        out[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else 0.0
        out[f"median_{name}_ms"] = percentile(ms, 50.0) if ms else 0.0
        out[f"std_{name}_ms"] = statistics.pstdev(ms) if ms else 0.0
        for q in metric_percentiles:
            out[f"{_percentile_key(q)}_{name}_ms"] = percentile(ms, q) if ms else 0.0
    return out


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """`ttft:500 tpot:50` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds), as vLLM's --goodput takes them."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS and e2el:MS, got {item!r}")
        slos[name] = float(value)
        if slos[name] < 0:
            raise ValueError(f"--goodput {name} must be >= 0 ms")
    return slos


def load_sharegpt(path: Path, count_tokens: Callable[[str], int] | None, fixed_output_len: int | None,
                  max_prompt_tokens: int = 1024, max_total_tokens: int = 2048) -> list[tuple[str, int]]:
    """(first human turn, output budget) of every ShareGPT conversation with a reply, filtered as vLLM does (at
    least 4 prompt and output tokens, prompt <= 1024, prompt + output <= 2048); the budget is the reply's
    token count, or `fixed_output_len`."""
    data = json.loads(Path(path).read_text())
    out = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) < 2 or not isinstance(turns[0].get("value"), str) or not isinstance(turns[1].get("value"), str):
            continue
        prompt, reply = turns[0]["value"], turns[1]["value"]
        if count_tokens is None:
            if fixed_output_len is None:
                raise ValueError("ShareGPT output lengths need the server's /tokenize; pass --sharegpt-output-len")
            out.append((prompt, fixed_output_len))
            continue
        prompt_len = count_tokens(prompt)
        output_len = fixed_output_len if fixed_output_len is not None else count_tokens(reply)
        if prompt_len < 4 or output_len < 4 or prompt_len > max_prompt_tokens or \
                prompt_len + output_len > max_total_tokens:
            continue
        out.append((prompt, output_len))
    if not out:
        raise ValueError(f"{path} holds no usable ShareGPT conversation (a list of {{'conversations': [...]}})")
    return out


def record_to_json(record: RequestRecord, t0: float) -> dict[str, Any]:
    """Per-request record for the result file; times relative to the level's start (t0) or the request's start."""
    out: dict[str, Any] = {"index": record.index, "success": record.success, "status": record.status,
                           "error": record.error, "start_s": round(record.start - t0, 6),
                           "prompt_tokens": record.input_tokens, "output_tokens": record.output_tokens,
                           "chunk_times_s": [round(t - record.start, 6) for t in record.chunk_times]}
    out["e2e_s"] = round(record.end - record.start, 6) if record.end is not None else None
    return out


# ------------------------------------------------------------------------------------------------ workload (pure)


def make_prompts(count: int, input_len: int, token_range: tuple[int, int], seed: int | str) -> list[list[int]]:
    lo, hi = token_range
    if not 0 <= lo < hi:
        raise ValueError(f"token id range [{lo}, {hi}) is empty or negative")
    rng = random.Random(seed)
    ids = range(lo, hi)
    return [rng.choices(ids, k=input_len) for _ in range(count)]


def arrival_offsets(count: int, rate: float, seed: int | str, burstiness: float = 1.0) -> list[float]:
    """Send times (s after the start) of `rate` req/s, the first request at once. Gaps are gamma distributed with
    shape `burstiness` and mean 1/rate, as in vLLM: 1 is a Poisson process, below 1 burstier, above 1 steadier."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    offsets = []
    t = 0.0
    for _ in range(count):
        offsets.append(t)
        t += rng.expovariate(rate) if burstiness == 1.0 else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return offsets


def level_seed(kind: str, seed: int, level_index: int) -> str:
    """Seed of one random stream ("prompts", "arrivals") of one level; levels differ so a sweep never repeats."""
    return f"{kind}-{seed}-{level_index}"


def completion_payload(model: str, prompt: list[int] | str, max_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                               "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        payload["ignore_eos"] = True  # vLLM's extension field
    return payload


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line, None for other lines (comments, blank lines, event names)."""
    if not line.startswith("data:"):
        return None
    data = line[5:]
    return data[1:] if data.startswith(" ") else data


def is_token_chunk(chunk: dict[str, Any]) -> bool:
    """Whether a chunk reports generated tokens: it carries text, or it is an intermediate step with empty text.

    Empty intermediate chunks count because an incremental detokenizer may hold back the text of a token
    (an incomplete UTF-8 sequence) yet still stream the step; a closing chunk with empty text and a
    finish_reason only marks the end, and counting it would add a spurious near-zero gap to ITL.
    """
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0].get("text"), str):
        return False
    return bool(choices[0]["text"]) or choices[0].get("finish_reason") is None


def apply_chunk(record: RequestRecord, chunk: dict[str, Any], now: float) -> None:
    """Fold one decoded stream chunk into the record."""
    if chunk.get("error") is not None or chunk.get("object") == "error":
        detail = chunk.get("error", chunk)
        record.error = _clip(f"error in stream: {json.dumps(detail)}")
        return
    if is_token_chunk(chunk):
        record.chunk_times.append(now)
    usage = chunk.get("usage")
    if usage:
        if usage.get("completion_tokens") is not None:
            record.usage_completion_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            record.usage_prompt_tokens = int(usage["prompt_tokens"])


def _clip(text: str) -> str:
    return text if len(text) <= ERROR_TEXT_LIMIT else text[:ERROR_TEXT_LIMIT] + "..."


# ------------------------------------------------------------------------------------------------ HTTP


@dataclass
class Target:
    base_url: str  # scheme://host:port, without /v1
    model: str
    headers: dict[str, str]

    @property
    def completions_url(self) -> str:
        return f"{self.base_url}/v1/completions"


def normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def make_client(pool_size: int, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=pool_size, max_keepalive_connections=pool_size,
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)
    # trust_env=False: a proxy picked up from the environment would sit inside every measured latency
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)),
                             trust_env=False)


Prompt = list[int] | str  # token ids (random dataset) or text (ShareGPT)
MaxTokens = int | Sequence[int]  # one budget for all, or one per prompt


def _budget(max_tokens: MaxTokens, index: int) -> int:
    return max_tokens if isinstance(max_tokens, int) else max_tokens[index]


async def send_request(client: httpx.AsyncClient, target: Target, index: int, prompt: Prompt, max_tokens: int,
                       ignore_eos: bool) -> RequestRecord:
    payload = completion_payload(target.model, prompt, max_tokens, ignore_eos)
    record = RequestRecord(index=index, start=time.perf_counter(),
                           prompt_tokens=len(prompt) if isinstance(prompt, list) else 0, max_tokens=max_tokens)
    try:
        async with client.stream("POST", target.completions_url, json=payload, headers=target.headers) as response:
            record.status = response.status_code
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                record.error = _clip(f"HTTP {response.status_code}: {body}")
                return record
            # keep reading after [DONE] so the connection goes back to the pool instead of being dropped
            async for line in response.aiter_lines():
                now = time.perf_counter()
                data = sse_data(line)
                if data is None or record.end is not None or record.error is not None:
                    continue
                if data.strip() == "[DONE]":
                    record.end = now
                    continue
                apply_chunk(record, json.loads(data), now)
        if record.error is None and record.end is None:
            record.error = "stream ended without data: [DONE]"
        elif record.error is None and not record.chunk_times:
            record.error = "stream carried no token"
    except Exception as e:  # any failure of one request is data, not a reason to stop the benchmark
        record.error = _clip(f"{type(e).__name__}: {e}")
    return record


async def run_fixed_concurrency(client: httpx.AsyncClient, target: Target, prompts: Sequence[Prompt],
                                max_tokens: MaxTokens, ignore_eos: bool, concurrency: int) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    pending = iter(enumerate(prompts))

    async def worker() -> None:
        for index, prompt in pending:  # the shared iterator hands each prompt to exactly one worker
            records.append(await send_request(client, target, index, prompt, _budget(max_tokens, index),
                                              ignore_eos))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    return sorted(records, key=lambda r: r.index)


async def run_poisson(client: httpx.AsyncClient, target: Target, prompts: Sequence[Prompt], max_tokens: MaxTokens,
                      ignore_eos: bool, offsets: list[float], max_concurrency: int | None) -> list[RequestRecord]:
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(index: int, prompt: Prompt) -> RequestRecord:
        if gate is None:
            return await send_request(client, target, index, prompt, _budget(max_tokens, index), ignore_eos)
        async with gate:
            return await send_request(client, target, index, prompt, _budget(max_tokens, index), ignore_eos)

    t0 = time.perf_counter()
    tasks = []
    for index, (prompt, offset) in enumerate(zip(prompts, offsets)):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(index, prompt)))
    return list(await asyncio.gather(*tasks))


async def fetch_json(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> Any:
    response = await client.get(url, headers=headers)
    response.raise_for_status()
    return response.json()


async def resolve_model(base_url: str, headers: dict[str, str], timeout_s: float) -> str:
    async with make_client(1, timeout_s) as client:
        models = await fetch_json(client, f"{base_url}/v1/models", headers)
    data = models.get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


async def server_version(base_url: str, headers: dict[str, str]) -> Any:
    try:
        async with make_client(1, 5.0) as client:
            return await fetch_json(client, f"{base_url}/version", headers)
    except (httpx.HTTPError, ValueError):
        return None


# ------------------------------------------------------------------------------------------------ levels


@dataclass(frozen=True)
class Level:
    concurrency: int | None = None  # fixed concurrency mode
    request_rate: float | None = None  # Poisson mode
    max_concurrency: int | None = None

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        cap = f", max concurrency {self.max_concurrency}" if self.max_concurrency else ""
        return f"request rate {_rate_text(self.request_rate)}{cap}"

    def pool_size(self, num_prompts: int) -> int:
        cap = self.concurrency or self.max_concurrency or num_prompts
        return max(1, min(cap, num_prompts))

    def to_json(self) -> dict[str, Any]:
        mode = "concurrency" if self.concurrency is not None else "request_rate"
        rate = None if self.request_rate is None else _rate_text(self.request_rate)
        return {"mode": mode, "concurrency": self.concurrency, "request_rate": rate,
                "max_concurrency": self.max_concurrency}


def _rate_text(rate: float | None) -> str | float | None:
    # JSON has no infinity; keep "inf" as the CLI spells it
    return "inf" if rate is not None and math.isinf(rate) else rate


def parse_levels(concurrency: str | None, request_rate: str | None, max_concurrency: int | None) -> list[Level]:
    if (concurrency is None) == (request_rate is None):
        raise ValueError("give exactly one of --concurrency and --request-rate")
    if concurrency is not None:
        values = [int(v) for v in concurrency.split(",") if v.strip()]
        if not values or min(values) < 1:
            raise ValueError(f"--concurrency needs positive integers, got {concurrency!r}")
        return [Level(concurrency=v) for v in values]
    assert request_rate is not None
    rates = [float(v) for v in request_rate.split(",") if v.strip()]
    if not rates or min(rates) <= 0 or any(math.isnan(r) for r in rates):
        raise ValueError(f"--request-rate needs positive numbers or inf, got {request_rate!r}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError("--max-concurrency must be positive")
    return [Level(request_rate=r, max_concurrency=max_concurrency) for r in rates]


def parse_token_range(text: str | None, vocab_size: int) -> tuple[int, int]:
    if text is None:
        return 0, vocab_size
    try:
        lo, hi = (int(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"--token-ids must be START:END, got {text!r}") from None
    return lo, hi


@dataclass
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    token_range: tuple[int, int]
    seed: int
    ignore_eos: bool
    timeout_s: float
    burstiness: float = 1.0
    # ShareGPT: (first human turn, output budget) per conversation, drawn per level; None: random token ids
    conversations: list[tuple[str, int]] | None = None

    def level_prompts(self, kind: str, level_index: int, count: int) -> tuple[list[Prompt], MaxTokens]:
        if self.conversations is None:
            return (list(make_prompts(count, self.input_len, self.token_range,
                                      level_seed(kind, self.seed, level_index))), self.output_len)
        picked = random.Random(level_seed(kind, self.seed, level_index)).sample(
            self.conversations, min(count, len(self.conversations)))
        return [text for text, _ in picked], [budget for _, budget in picked]


@dataclass
class LevelRun:
    records: list[RequestRecord]
    duration: float
    t0: float  # perf_counter at the level's start
    client: dict[str, Any]  # the load generator's own health: CPU use and event-loop lag


class LoopLag:
    """Samples how late the event loop wakes a sleeper: a busy client delays every timestamp it takes."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.samples: list[float] = []

    async def watch(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.samples.append(max(0.0, time.perf_counter() - t - self.interval_s))


def client_warning(client: dict[str, Any]) -> str | None:
    lag_p99 = client["loop_lag_ms"]["p99"]
    if client["cpu_utilization"] > CLIENT_CPU_WARN or (lag_p99 is not None and lag_p99 > CLIENT_LAG_WARN_MS):
        return (f"warning: the load generator itself was busy (CPU {client['cpu_utilization']:.0%} of a core, "
                f"event-loop lag p99 {lag_p99 or 0:.1f} ms); latencies may include client delay")
    return None


async def run_level(target: Target, level: Level, work: Workload, level_index: int) -> LevelRun:
    # each level gets its own prompts so a prefix cache cannot reuse the previous level's work
    prompts, budgets = work.level_prompts("prompts", level_index, work.num_prompts)
    lag = LoopLag()
    async with make_client(level.pool_size(work.num_prompts), work.timeout_s) as client:
        watcher = asyncio.create_task(lag.watch())
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        if level.concurrency is not None:
            records = await run_fixed_concurrency(client, target, prompts, budgets, work.ignore_eos,
                                                  level.concurrency)
        else:
            assert level.request_rate is not None
            offsets = arrival_offsets(len(prompts), level.request_rate, level_seed("arrivals", work.seed, level_index),
                                      work.burstiness)
            records = await run_poisson(client, target, prompts, budgets, work.ignore_eos, offsets,
                                        level.max_concurrency)
        duration = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        watcher.cancel()
    health = {"cpu_utilization": cpu / duration, "loop_lag_ms": summarize_ms(lag.samples)}
    return LevelRun(records=records, duration=duration, t0=t0, client=health)


async def warm_up(target: Target, work: Workload, count: int) -> int:
    """Send `count` requests at once, outside any measurement; return how many failed."""
    prompts, budgets = work.level_prompts("warmup", 0, count)
    async with make_client(count, work.timeout_s) as client:
        records = await run_fixed_concurrency(client, target, prompts, budgets, work.ignore_eos, len(prompts))
    return sum(1 for r in records if not r.success)


# ------------------------------------------------------------------------------------------------ report


def format_level(label: str, m: dict[str, Any]) -> str:
    lines = [f"{'=' * 16} serve: {label} {'=' * 16}",
             f"{'Successful requests:':<36}{m['completed']}",
             f"{'Failed requests:':<36}{m['failed']}",
             f"{'Benchmark duration (s):':<36}{m['duration_s']:.2f}",
             f"{'Total input tokens:':<36}{m['total_input_tokens']}",
             f"{'Total output tokens:':<36}{m['total_output_tokens']}",
             f"{'Request throughput (req/s):':<36}{m['request_throughput']:.2f}",
             f"{'Output token throughput (tok/s):':<36}{m['output_throughput']:.2f}",
             f"{'Total token throughput (tok/s):':<36}{m['total_token_throughput']:.2f}",
             f"{'(ms)':<8}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = m[f"{name}_ms"]
        lines.append(f"{name.upper():<8}" + "".join(_cell(s[k]) for k in ("mean", "median", "p90", "p99")))
    if m["short_outputs"]:
        lines.append(f"note: {m['short_outputs']} requests returned fewer than max_tokens tokens")
    for error, count in list(m["errors"].items())[:5]:
        lines.append(f"error x{count}: {error}")
    return "\n".join(lines)


def format_sweep(results: list[dict[str, Any]]) -> str:
    head = (f"{'level':<28}{'ok':>6}{'fail':>6}{'req/s':>9}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
            f"{'TPOT p50':>10}{'TPOT p99':>10}{'ITL p99':>10}{'E2E p50':>10}")
    lines = [head]
    for res in results:
        m = res["metrics"]
        lines.append(f"{res['label']:<28}{m['completed']:>6}{m['failed']:>6}{m['request_throughput']:>9.2f}"
                     f"{m['output_throughput']:>11.1f}" + _cell(m["ttft_ms"]["median"]) + _cell(m["ttft_ms"]["p99"])
                     + _cell(m["tpot_ms"]["median"]) + _cell(m["tpot_ms"]["p99"]) + _cell(m["itl_ms"]["p99"])
                     + _cell(m["e2e_ms"]["median"]))
    lines.append("(latencies in ms)")
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return f"{value:>10.2f}" if value is not None else f"{'-':>10}"


def _git(*cmd: str) -> str | None:
    try:
        out = subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(git_sha: str | None, server: Any) -> dict[str, Any]:
    status = None if git_sha else _git("status", "--porcelain", "--untracked-files=no")
    return {"git_sha": git_sha or _git("rev-parse", "HEAD") or "unknown",
            "git_dirty": None if status is None else bool(status),
            "timestamp": datetime.now(UTC).isoformat(timespec="seconds"), "hostname": socket.gethostname(),
            "python": platform.python_version(), "platform": platform.platform(), "httpx": httpx.__version__,
            "server_version": server}


# ------------------------------------------------------------------------------------------------ CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (a /v1 suffix is ok; "
                   "default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1", help="with --port, the server when --base-url is not given")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--backend", default="openai", choices=["openai", "vllm"],
                   help="both send OpenAI streaming completions (vLLM's names)")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions"])
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", default=None, help="requests kept in flight; a comma list sweeps, e.g. 1,4,16")
    mode.add_argument("--request-rate", default=None, help="arrivals per second (inf: all at once, the default); "
                      "a comma list sweeps")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on in-flight requests with --request-rate")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 Poisson, below 1 burstier, above 1 steadier")
    p.add_argument("--num-prompts", type=int, default=1000, help="requests per level")
    p.add_argument("--dataset-name", default="random", choices=["random", "sharegpt"],
                   help="random token ids of --input-len, or ShareGPT conversations from --dataset-path")
    p.add_argument("--dataset-path", type=Path, default=None, help="the ShareGPT JSON file")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="max_tokens of every ShareGPT request (default: the length of the recorded reply)")
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=None,
                   help="prompt tokens per request (random dataset)")
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=None,
                   help="max_tokens per request (random dataset)")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true so every request runs to "
                   "max_tokens")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="prompt token ids drawn from "
                   "[0, VOCAB_SIZE)")
    p.add_argument("--token-ids", default=None, metavar="START:END", help="draw prompt token ids from [START, END) "
                   "instead")
    p.add_argument("--seed", type=int, default=0, help="seeds prompts and arrival times")
    p.add_argument("--warmup-requests", type=int, default=0, help="requests sent (all at once) before measuring")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may wait for its next byte")
    p.add_argument("--api-key", default=None, help="the server's key (default: the OPENAI_API_KEY environment "
                   "variable, as vllm bench serve reads it)")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="comma list of ttft, tpot, itl, e2el: the latencies given as flat mean/median/std/pXX keys")
    p.add_argument("--metric-percentiles", default="99", help="comma list of percentiles for those keys")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs (ttft:MS tpot:MS e2el:MS) for request_goodput")
    p.add_argument("--result-file", type=Path, default=None, help="write the JSON result here")
    p.add_argument("--save-result", action="store_true", help="write the JSON result into --result-dir")
    p.add_argument("--result-dir", type=Path, default=Path("."), help="with --save-result")
    p.add_argument("--result-filename", default=None, help="with --save-result (default: from the run's settings)")
    p.add_argument("--save-requests", action="store_true", help="include per-request records in the JSON")
    p.add_argument("--git-sha", default=None, help="recorded in the JSON (default: git rev-parse HEAD)")


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="HTTP load generator for a streaming OpenAI server (BENCHMARKS.md "
                                            "'serve')")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def validate(args: argparse.Namespace) -> tuple[list[Level], Workload]:
    if args.dataset_name == "random":
        for name in ("input_len", "output_len"):
            if getattr(args, name) is None:
                raise ValueError(f"the random dataset needs --{name.replace('_', '-')} (or vLLM's "
                                 f"--random-{name.replace('_', '-')})")
    elif args.dataset_path is None or not args.dataset_path.is_file():
        raise ValueError(f"--dataset-name sharegpt needs --dataset-path FILE (got {args.dataset_path})")
    for name in ("num_prompts", "input_len", "output_len", "sharegpt_output_len"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if args.warmup_requests < 0:
        raise ValueError("--warmup-requests must be >= 0")
    if args.timeout <= 0:
        raise ValueError("--timeout must be positive")
    if args.max_concurrency is not None and args.concurrency is not None:
        raise ValueError("--max-concurrency applies only with --request-rate")
    if not args.burstiness > 0:
        raise ValueError("--burstiness must be positive")
    metrics = [m for m in args.percentile_metrics.split(",") if m]
    if not set(metrics) <= set(LATENCY_METRICS):
        raise ValueError(f"--percentile-metrics takes {', '.join(LATENCY_METRICS)}, got {args.percentile_metrics!r}")
    quantiles = [float(q) for q in args.metric_percentiles.split(",") if q]
    if not quantiles or not all(0 < q < 100 for q in quantiles):
        raise ValueError(f"--metric-percentiles takes numbers in (0, 100), got {args.metric_percentiles!r}")
    args.goodput_slos = parse_goodput(args.goodput)
    rate = args.request_rate if args.concurrency is not None or args.request_rate is not None else "inf"
    levels = parse_levels(args.concurrency, rate, args.max_concurrency)
    token_range = parse_token_range(args.token_ids, args.vocab_size)
    if not 0 <= token_range[0] < token_range[1]:
        raise ValueError(f"token id range [{token_range[0]}, {token_range[1]}) is empty or negative")
    work = Workload(num_prompts=args.num_prompts, input_len=args.input_len or 0, output_len=args.output_len or 0,
                    token_range=token_range, seed=args.seed, ignore_eos=args.ignore_eos, timeout_s=args.timeout,
                    burstiness=args.burstiness)
    return levels, work


def count_tokens_with(target: Target, timeout_s: float) -> Callable[[str], int] | None:
    """A token counter through the server's /tokenize (kestrel's and vLLM's), or None when it has none."""
    client = httpx.Client(timeout=timeout_s, trust_env=False)

    def count(text: str) -> int:
        reply = client.post(f"{target.base_url}/tokenize", json={"model": target.model, "prompt": text,
                                                                 "add_special_tokens": False},
                            headers=target.headers)
        reply.raise_for_status()
        return int(reply.json()["count"])

    try:
        count("probe")
    except (httpx.HTTPError, KeyError, ValueError):
        return None
    return count


async def resolve_target(args: argparse.Namespace, timeout_s: float) -> tuple[Target, Any]:
    """The target (asking GET /v1/models for the model when not given) and the server's /version, if any."""
    base_url = normalize_base_url(args.base_url or f"http://{args.host}:{args.port}")
    headers = auth_headers(args.api_key)
    model = args.model or await resolve_model(base_url, headers, timeout_s)
    return Target(base_url=base_url, model=model, headers=headers), await server_version(base_url, headers)


async def bench(target: Target, levels: list[Level], work: Workload, warmup_requests: int, save_requests: bool,
                on_level: Callable[[list[dict[str, Any]], int], None],
                flat_settings: tuple = ()) -> tuple[list[dict[str, Any]], int]:
    """Warm up, then run every level, calling `on_level` after each; return the results and failed warm-ups."""
    results: list[dict[str, Any]] = []
    warmup_failed = 0
    if warmup_requests:
        warmup_failed = await warm_up(target, work, warmup_requests)
        print(f"warm-up: {warmup_requests} requests, {warmup_failed} failed", flush=True)
    for i, level in enumerate(levels):
        done = await run_level(target, level, work, i)
        metrics = compute_metrics(done.records, done.duration)
        entry: dict[str, Any] = {"label": level.label, **level.to_json(), "metrics": metrics, "client": done.client,
                                 **flat_metrics(done.records, metrics, *flat_settings)}
        if save_requests:
            entry["requests"] = [record_to_json(r, done.t0) for r in done.records]
        results.append(entry)
        print(format_level(level.label, metrics), flush=True)
        if (warning := client_warning(done.client)) is not None:
            print(warning, flush=True)
        on_level(results, warmup_failed)
    return results, warmup_failed


def plot(doc: dict[str, Any], path: Path) -> bool:
    """Latency percentiles (TTFT, TPOT, ITL: median and p99) and output throughput per level; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    results = doc["results"]
    labels = [r["label"].replace("concurrency ", "c=").replace("request rate ", "rate ") for r in results]
    x = range(len(results))
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms", "itl_ms"), ("TTFT", "TPOT", "ITL"), strict=False):
        values = {stat: [(r["metrics"][key] or {}).get(stat) or 0 for r in results] for stat in ("median", "p99")}
        for (stat, ys), style in zip(values.items(), ("o-", "s--"), strict=True):
            ax.plot(x, ys, style, label=stat)
        ax.set_title(f"{title} (ms)")
        if all(v > 0 for ys in values.values() for v in ys):
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    axes[3].bar(x, [r["metrics"]["output_throughput"] for r in results], color="tab:green")
    axes[3].set_title("output tok/s")
    for ax in axes:
        ax.set_xticks(list(x), labels, rotation=30, fontsize=8)
        ax.grid(alpha=0.3)
    cfg = doc["config"]
    fig.suptitle(f"kestrel bench serve: {cfg['input_len']} in / {cfg['output_len']} out, "
                 f"{cfg['num_prompts']} requests per level, failed: "
                 f"{sum(r['metrics']['failed'] for r in results)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> int:
    """Run every level; exit 0 when all requests succeeded, 1 when any failed, 2 on bad arguments or no server."""
    try:
        levels, work = validate(args)
    except ValueError as e:
        print(f"kestrel bench serve: error: {e}", file=sys.stderr)
        return 2
    try:
        target, server = asyncio.run(resolve_target(args, work.timeout_s))
    except (httpx.HTTPError, RuntimeError, KeyError, TypeError, ValueError) as e:
        print(f"kestrel bench serve: error: cannot query {args.base_url or f'{args.host}:{args.port}'}: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if args.dataset_name == "sharegpt":
        try:
            work.conversations = load_sharegpt(args.dataset_path, count_tokens_with(target, work.timeout_s),
                                               args.sharegpt_output_len)
        except (ValueError, OSError) as e:
            print(f"kestrel bench serve: error: {e}", file=sys.stderr)
            return 2
    config = {"base_url": target.base_url, "model": target.model, "endpoint": "/v1/completions",
              "dataset_name": args.dataset_name, "dataset_path": str(args.dataset_path) if args.dataset_path else None,
              "num_prompts": work.num_prompts, "input_len": work.input_len, "output_len": work.output_len,
              "burstiness": work.burstiness,
              "token_ids": list(work.token_range), "seed": work.seed, "ignore_eos": work.ignore_eos,
              "temperature": 0.0, "warmup_requests": args.warmup_requests, "timeout_s": work.timeout_s,
              "levels": [lv.to_json() for lv in levels]}
    env = environment(args.git_sha, server)

    if args.save_result and args.result_file is None:
        rate = levels[0].label.replace(" ", "-").replace(",", "")
        name = args.result_filename or f"kestrel-{rate}-{target.model.rsplit('/', 1)[-1]}-" \
            f"{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}.json"
        args.result_file = args.result_dir / name
    flat = ([m for m in args.percentile_metrics.split(",") if m],
            [float(q) for q in args.metric_percentiles.split(",") if q], args.goodput_slos or None)

    def save(results: list[dict[str, Any]], warmup_failed: int) -> None:
        # rewritten after every level, so a sweep that dies at a high level keeps the levels it finished
        if args.result_file is not None:
            doc = {"suite": "serve", "environment": env, "config": config, "warmup_failed": warmup_failed,
                   "results": results}
            if len(levels) == 1 and results:  # vLLM's flat keys at the top, as its scripts read them
                level = results[0]
                doc.update({k: v for k, v in level.items() if k not in ("label", "metrics", "client", "requests")},
                           date=datetime.now(UTC).strftime("%Y%m%d-%H%M%S"), backend=args.backend,
                           model_id=target.model, num_prompts=work.num_prompts)
            args.result_file.parent.mkdir(parents=True, exist_ok=True)
            args.result_file.write_text(json.dumps(doc, indent=1) + "\n")

    results, _ = asyncio.run(bench(target, levels, work, args.warmup_requests, args.save_requests, save, flat))
    if len(results) > 1:
        print(format_sweep(results))
    if args.result_file is not None:
        print(f"wrote {args.result_file}")
        if results and plot(json.loads(args.result_file.read_text()), args.result_file.with_suffix(".png")):
            print(f"wrote {args.result_file.with_suffix('.png')}")
    return 1 if any(r["metrics"]["failed"] for r in results) else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kestrel bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
