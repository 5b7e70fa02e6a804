"""`kestrel bench serve-plot FILE... --out PNG`: serving benchmark results of three tools on one chart.

Reads, each file in its own format (told apart by its keys):
- `kestrel bench serve` JSON (`--result-file` / `--save-result`): one row per level;
- guidellm's benchmark report JSON (guidellm 0.8, report schema version 2: `guidellm run ... --output
  kind=json,path=FILE`): one row per benchmark of its sweep (synchronous, concurrent@N, throughput,
  constant@R / poisson@R);
- `vllm bench serve --save-result` JSON: one row per result (`--append-result` writes one result per line).
Each becomes a `ServeRow` (run, level, load, p50 / p99 TTFT, ITL and TPOT, achieved request and output token
throughput); the rows are written as JSON and drawn as one PNG: latencies against the achieved request throughput,
the load axis all three tools measure the same way.

Differences that stay visible in the numbers: vLLM and kestrel compute TPOT without the first token,
guidellm's `time_per_output_token_ms` includes it (it sits between ITL and TTFT); guidellm's throughputs are the
mean of its per-second series over the measured window, the others divide totals by the run's duration.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kestrel.bench import register_suite, standalone_main

FORMATS = ("kestrel bench serve JSON", "guidellm's benchmark report JSON (guidellm 0.8, `--output kind=json`)",
           "vllm bench serve --save-result JSON (a result per line with --append-result)")
GUIDELLM_REPORT_VERSION = 2


class ResultFileError(ValueError):
    """A file that is not a result of a known format, or lacks a value the plot needs; its message names the file."""


@dataclass(frozen=True)
class ServeRow:
    run: str  # the file's run label (its name without the suffix)
    tool: str  # kestrel | guidellm | vllm
    level: str  # the load as the tool names it: "concurrency 4", "poisson@2.00", "rate inf, max concurrency 8"
    concurrency: float | None  # requests kept in flight, or the cap on them; None: unbounded
    request_rate: float | None  # offered arrivals per second; None: all at once or a concurrency mode
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    request_throughput: float  # successful requests per second, achieved
    output_throughput: float  # output tokens per second, achieved
    completed: int
    failed: int


def read_rows(path: Path, run: str | None = None) -> list[ServeRow]:
    """The rows of one result file, whichever of the three formats it is."""
    run = run or path.stem
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise _error(path, f"cannot be read ({type(e).__name__}: {e})") from None
    docs = _json_documents(text)
    if docs is None:
        raise _error(path, "is neither JSON nor JSON lines")
    if len(docs) == 1 and isinstance(docs[0], dict):
        doc = docs[0]
        if doc.get("suite") == "serve" and isinstance(doc.get("results"), list):
            return _kestrel_rows(path, doc, run)
        if isinstance(doc.get("benchmarks"), list) and "guidellm_version" in (doc.get("metadata") or {}):
            return _guidellm_rows(path, doc, run)
    if docs and all(isinstance(d, dict) and "request_throughput" in d and "median_ttft_ms" in d for d in docs):
        return [_vllm_row(path, d, run) for d in docs]
    raise _error(path, "is not a result of a known format")


def _json_documents(text: str) -> list[Any] | None:
    try:
        return [json.loads(text)]
    except json.JSONDecodeError:
        pass
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError:
        return None


def _error(path: Path, what: str) -> ResultFileError:
    return ResultFileError(f"{path} {what}; serve-plot reads: {'; '.join(FORMATS)}")


def _number(path: Path, where: dict[str, Any], key: str, context: str = "") -> float:
    value = where.get(key) if isinstance(where, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ResultFileError(f"{path}: {context}{key} is {value!r}, expected a number")
    return float(value)


def _optional(where: dict[str, Any], key: str) -> float | None:
    value = where.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _rate(value: Any) -> float | None:
    """A request rate as the tools write it ("inf" or a number); None for unbounded or absent."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


# ------------------------------------------------------------------------------------------------ the formats


def _kestrel_rows(path: Path, doc: dict[str, Any], run: str) -> list[ServeRow]:
    rows = []
    for i, level in enumerate(doc["results"]):
        context = f"results[{i}].metrics."
        m = level.get("metrics") if isinstance(level, dict) else None
        if not isinstance(m, dict):
            raise ResultFileError(f"{path}: results[{i}] has no metrics block")
        latency = {key: m.get(f"{key}_ms") or {} for key in ("ttft", "itl", "tpot")}
        concurrency = level.get("concurrency") or level.get("max_concurrency")
        rows.append(ServeRow(
            run=run, tool="kestrel", level=str(level.get("label")),
            concurrency=float(concurrency) if concurrency else None, request_rate=_rate(level.get("request_rate")),
            ttft_p50_ms=_optional(latency["ttft"], "median"), ttft_p99_ms=_optional(latency["ttft"], "p99"),
            itl_p50_ms=_optional(latency["itl"], "median"), itl_p99_ms=_optional(latency["itl"], "p99"),
            tpot_p50_ms=_optional(latency["tpot"], "median"), tpot_p99_ms=_optional(latency["tpot"], "p99"),
            request_throughput=_number(path, m, "request_throughput", context),
            output_throughput=_number(path, m, "output_throughput", context),
            completed=int(_number(path, m, "completed", context)), failed=int(_number(path, m, "failed", context))))
    return rows


def _guidellm_rows(path: Path, doc: dict[str, Any], run: str) -> list[ServeRow]:
    version = (doc.get("metadata") or {}).get("version")
    if version != GUIDELLM_REPORT_VERSION:
        raise ResultFileError(f"{path}: a guidellm report of schema version {version!r}; serve-plot reads version "
                              f"{GUIDELLM_REPORT_VERSION} (guidellm 0.8)")
    rows = []
    for i, bench in enumerate(doc["benchmarks"]):
        try:
            strategy = bench["config"]["strategy"]
            metrics = bench["metrics"]
            totals = metrics["request_totals"]
        except (KeyError, TypeError):
            raise ResultFileError(f"{path}: benchmarks[{i}] lacks config.strategy, metrics or "
                                  "metrics.request_totals") from None
        kind = strategy.get("type_")
        rate = _rate(strategy.get("rate"))
        concurrency = {"synchronous": 1, "concurrent": strategy.get("streams")}.get(kind,
                                                                                  strategy.get("max_concurrency"))
        level = {"synchronous": "synchronous", "throughput": "throughput",
                 "concurrent": f"concurrent@{strategy.get('streams')}"}.get(kind, f"{kind}@{rate or 0:.2f}")

        def percentiles(name: str, metrics: dict[str, Any] = metrics, i: int = i) -> tuple[float | None, ...]:
            summary = (metrics.get(name) or {}).get("successful")
            if not isinstance(summary, dict):
                raise ResultFileError(f"{path}: benchmarks[{i}].metrics.{name}.successful is missing")
            if not summary.get("count"):
                return None, None
            points = summary.get("percentiles") or {}
            return _optional(points, "p50"), _optional(points, "p99")

        def mean(name: str, metrics: dict[str, Any] = metrics, i: int = i) -> float:
            return _number(path, (metrics.get(name) or {}).get("successful"), "mean",
                           f"benchmarks[{i}].metrics.{name}.successful.")

        ttft, itl, tpot = (percentiles(n) for n in ("time_to_first_token_ms", "inter_token_latency_ms",
                                                      "time_per_output_token_ms"))
        rows.append(ServeRow(
            run=run, tool="guidellm", level=level, concurrency=float(concurrency) if concurrency else None,
            request_rate=rate, ttft_p50_ms=ttft[0], ttft_p99_ms=ttft[1], itl_p50_ms=itl[0], itl_p99_ms=itl[1],
            tpot_p50_ms=tpot[0], tpot_p99_ms=tpot[1], request_throughput=mean("requests_per_second"),
            output_throughput=mean("output_tokens_per_second"), completed=int(totals.get("successful") or 0),
            failed=int(totals.get("errored") or 0)))
    return rows


def _vllm_row(path: Path, doc: dict[str, Any], run: str) -> ServeRow:
    rate = _rate(doc.get("request_rate"))
    cap = doc.get("max_concurrency")
    level = f"rate {doc.get('request_rate', 'inf')}" + (f", max concurrency {cap}" if cap else "")
    return ServeRow(
        run=str(doc.get("label") or run), tool="vllm", level=level, concurrency=float(cap) if cap else None,
        request_rate=rate, ttft_p50_ms=_optional(doc, "median_ttft_ms"), ttft_p99_ms=_optional(doc, "p99_ttft_ms"),
        itl_p50_ms=_optional(doc, "median_itl_ms"), itl_p99_ms=_optional(doc, "p99_itl_ms"),
        tpot_p50_ms=_optional(doc, "median_tpot_ms"), tpot_p99_ms=_optional(doc, "p99_tpot_ms"),
        request_throughput=_number(path, doc, "request_throughput"),
        output_throughput=_number(path, doc, "output_throughput"), completed=int(_number(path, doc, "completed")),
        failed=int(_optional(doc, "failed") or 0))


# ------------------------------------------------------------------------------------------------ the chart


def plot_rows(rows: Sequence[ServeRow], path: Path) -> bool:
    """TTFT, ITL and TPOT (p50 solid, p99 dashed) and output tok/s against achieved req/s, a colour per run;
    False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FormatStrFormatter
    except ImportError:
        return False
    runs = list(dict.fromkeys(r.run for r in rows))
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    for n, run in enumerate(runs):
        mine = sorted((r for r in rows if r.run == run), key=lambda r: r.request_throughput)
        colour = f"C{n % 10}"
        x = [r.request_throughput for r in mine]
        for ax, key in zip(axes, ("ttft", "itl", "tpot"), strict=False):
            for stat, style in (("p50", "o-"), ("p99", "s--")):
                points = [(xi, getattr(r, f"{key}_{stat}_ms")) for xi, r in zip(x, mine, strict=True)]
                points = [(xi, y) for xi, y in points if y is not None]
                if points:
                    ax.plot(*zip(*points, strict=True), style, color=colour,
                            label=f"{run} ({mine[0].tool}) {stat}")
        axes[3].plot(x, [r.output_throughput for r in mine], "o-", color=colour, label=f"{run} ({mine[0].tool})")
    for ax, title in zip(axes, ("TTFT (ms)", "ITL (ms)", "TPOT (ms)", "output tok/s"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("achieved requests/s")
        ax.grid(alpha=0.3)
        if ax.lines and all(v > 0 for line in ax.lines for v in line.get_ydata()):
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    axes[0].legend(fontsize=7)
    axes[3].legend(fontsize=7)
    fig.suptitle(f"serving benchmarks: {', '.join(runs)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------------ the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", type=Path, metavar="FILE",
                   help="result files: kestrel bench serve, guidellm report or vllm bench serve JSON")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    p.add_argument("--json", type=Path, default=None, help="the normalised rows (default: --out with .json)")


def run(args: argparse.Namespace) -> int:
    """Exit 0 with both files written, 1 when matplotlib is missing (the JSON is written), 2 on a bad file."""
    rows: list[ServeRow] = []
    sources = []
    seen: dict[str, int] = {}
    try:
        for path in args.files:
            seen[path.stem] = seen.get(path.stem, 0) + 1
            label = path.stem if seen[path.stem] == 1 else f"{path.stem} ({seen[path.stem]})"
            found = read_rows(path, label)
            if not found:
                raise ResultFileError(f"{path}: holds no results")
            rows += found
            sources.append({"file": str(path), "tool": found[0].tool, "rows": len(found)})
    except ResultFileError as e:
        print(f"kestrel bench serve-plot: error: {e}", file=sys.stderr)
        return 2
    out_json = args.json or args.out.with_suffix(".json")
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps({"sources": sources, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    print(f"wrote {out_json}")
    if not plot_rows(rows, args.out):
        print("kestrel bench serve-plot: matplotlib is not installed: no PNG", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


def register(subparsers: Any) -> argparse.ArgumentParser:
    return register_suite(subparsers, "serve-plot", "one PNG from kestrel / guidellm / vllm bench serve results",
                          add_arguments, run)


def main(argv: Sequence[str] | None = None) -> int:
    return standalone_main("serve_plot", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
