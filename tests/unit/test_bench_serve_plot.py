"""`kestrel bench serve-plot`: kestrel's, guidellm's and vLLM's serving results normalised into one row type and
drawn on one PNG. The guidellm report is a real `guidellm run` output (guidellm 0.8.1 against its mock server, a
sync and a poisson benchmark, per-request lists dropped), read back through guidellm's own models when guidellm is
installed; the vLLM files follow `vllm bench serve --save-result` / `--append-result`; kestrel's is written by
kestrel's own metric functions."""

import json
from pathlib import Path

import pytest

from kestrel.bench.serve import Level, RequestRecord, compute_metrics
from kestrel.bench.serve_plot import ResultFileError, main, read_rows
from kestrel.entrypoints.cli import build_parser

DATA = Path(__file__).parent / "serve_plot_data"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def guidellm_report(tmp_path: Path) -> Path:
    """The fixture as guidellm itself writes it, when guidellm is installed (so the fixture cannot drift from its
    schema); else the fixture as committed."""
    try:
        from guidellm.benchmark import GenerativeBenchmarksReport
    except ImportError:
        return DATA / "guidellm_sweep.json"
    report = GenerativeBenchmarksReport.model_validate(json.loads((DATA / "guidellm_sweep.json").read_text()))
    return report.save_file(tmp_path / "guidellm_sweep.json")


def kestrel_result(tmp_path: Path) -> Path:
    """Two levels of `kestrel bench serve`: 4 requests each, TTFT 40 ms then 60 ms, 5 tokens 10 ms apart."""
    results = []
    for level, ttft in ((Level(concurrency=1), 0.040), (Level(concurrency=4), 0.060)):
        records = []
        for i in range(4):
            record = RequestRecord(index=i, start=0.0, prompt_tokens=16, max_tokens=5)
            record.chunk_times = [ttft + 0.010 * k for k in range(5)]
            record.end = record.chunk_times[-1]
            records.append(record)
        results.append({"label": level.label, **level.to_json(), "metrics": compute_metrics(records, 2.0)})
    path = tmp_path / "kestrel_sweep.json"
    path.write_text(json.dumps({"suite": "serve", "config": {}, "results": results}))
    return path


def test_guidellm_report_rows(tmp_path):
    sync, poisson = read_rows(guidellm_report(tmp_path))
    assert (sync.tool, sync.level, sync.concurrency, sync.request_rate) == ("guidellm", "synchronous", 1.0, None)
    assert sync.ttft_p50_ms == pytest.approx(43.96462440490723) and sync.ttft_p99_ms == pytest.approx(46.5540885925)
    assert sync.itl_p50_ms == pytest.approx(8.426904678344727) and sync.itl_p99_ms == pytest.approx(8.6327620915)
    assert sync.tpot_p50_ms == pytest.approx(12.869119644165039)
    assert sync.request_throughput == pytest.approx(9.184443051930822)
    assert sync.output_throughput == pytest.approx(73.47554441544659)
    assert (sync.completed, sync.failed) == (6, 0)
    assert poisson.level == "poisson@28.00" and poisson.request_rate == pytest.approx(27.998371193927987)
    assert poisson.concurrency == 512.0  # the sweep's cap on in-flight requests
    assert poisson.ttft_p99_ms == pytest.approx(47.65820503234863)
    assert poisson.request_throughput == pytest.approx(21.17677590041477)


def test_vllm_results_one_per_line_and_single(tmp_path):
    c1, c4 = read_rows(DATA / "vllm_append.json")
    assert (c1.tool, c1.level, c1.concurrency, c1.request_rate) == ("vllm", "rate inf, max concurrency 1", 1.0, None)
    assert (c1.ttft_p50_ms, c1.ttft_p99_ms, c1.itl_p50_ms, c1.itl_p99_ms, c1.tpot_p50_ms, c1.tpot_p99_ms) == (
        45.0, 61.0, 8.7, 12.5, 8.9, 10.2)
    assert (c1.request_throughput, c1.output_throughput, c1.completed) == (10.0, 80.0, 8)
    assert c4.concurrency == 4.0 and c4.ttft_p99_ms == 80.0 and c4.request_throughput == 32.0
    (rate,) = read_rows(DATA / "vllm_rate2.json")
    assert (rate.level, rate.request_rate, rate.concurrency, rate.itl_p99_ms) == ("rate 2.0", 2.0, None, 11.0)
    # Percentiles other than p99 chosen (--metric-percentiles 90): the p99 is unknown, the median still there.
    doc = json.loads((DATA / "vllm_rate2.json").read_text())
    doc["p90_ttft_ms"] = doc.pop("p99_ttft_ms")
    (tmp_path / "p90.json").write_text(json.dumps(doc))
    (p90,) = read_rows(tmp_path / "p90.json")
    assert p90.ttft_p99_ms is None and p90.ttft_p50_ms == 44.0


def test_kestrel_result_rows(tmp_path):
    c1, c4 = read_rows(kestrel_result(tmp_path))
    assert (c1.tool, c1.level, c1.concurrency, c4.concurrency) == ("kestrel", "concurrency 1", 1.0, 4.0)
    assert c1.ttft_p50_ms == pytest.approx(40.0) and c4.ttft_p99_ms == pytest.approx(60.0)
    assert c1.itl_p50_ms == pytest.approx(10.0) and c1.tpot_p99_ms == pytest.approx(10.0)
    assert c1.request_throughput == pytest.approx(2.0) and c1.output_throughput == pytest.approx(10.0)
    assert (c1.completed, c1.failed) == (4, 0)


def test_one_png_and_the_normalised_json_from_all_three(tmp_path, capsys):
    files = [kestrel_result(tmp_path), guidellm_report(tmp_path), DATA / "vllm_append.json", DATA / "vllm_rate2.json"]
    out = tmp_path / "compare.png"
    assert main([*map(str, files), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 20_000
    doc = json.loads(out.with_suffix(".json").read_text())
    assert [s["tool"] for s in doc["sources"]] == ["kestrel", "guidellm", "vllm", "vllm"]
    assert [s["rows"] for s in doc["sources"]] == [2, 2, 2, 1]
    assert len(doc["rows"]) == 7 and {r["run"] for r in doc["rows"]} == {"kestrel_sweep", "guidellm_sweep",
                                                                         "vllm_append", "vllm_rate2"}
    assert "wrote" in capsys.readouterr().out


def test_the_cli_has_the_command(tmp_path):
    args = build_parser().parse_args(["bench", "serve-plot", str(DATA / "vllm_rate2.json"), "--out",
                                      str(tmp_path / "x.png"), "--json", str(tmp_path / "rows.json")])
    assert args.func(args) == 0
    assert json.loads((tmp_path / "rows.json").read_text())["rows"][0]["request_rate"] == 2.0


@pytest.mark.parametrize(("content", "why"), [
    ("not json at all", "neither JSON nor JSON lines"),
    ('{"some": "thing"}', "not a result of a known format"),
    ('[1, 2]', "not a result of a known format"),
])
def test_unknown_files_are_named_with_the_formats_read(tmp_path, capsys, content, why):
    bad = tmp_path / "mystery.json"
    bad.write_text(content)
    with pytest.raises(ResultFileError, match=why) as caught:
        read_rows(bad)
    message = str(caught.value)
    assert str(bad) in message and "guidellm" in message and "vllm bench serve" in message
    assert main([str(DATA / "vllm_rate2.json"), str(bad), "--out", str(tmp_path / "x.png")]) == 2
    assert str(bad) in capsys.readouterr().err and not (tmp_path / "x.png").exists()


def test_missing_files_and_values_are_named(tmp_path):
    with pytest.raises(ResultFileError, match="cannot be read"):
        read_rows(tmp_path / "absent.json")
    doc = json.loads((DATA / "vllm_rate2.json").read_text())
    doc["request_throughput"] = "fast"
    (tmp_path / "v.json").write_text(json.dumps(doc))
    with pytest.raises(ResultFileError, match="request_throughput"):
        read_rows(tmp_path / "v.json")
    report = json.loads((DATA / "guidellm_sweep.json").read_text())
    report["metadata"]["version"] = 1
    (tmp_path / "old.json").write_text(json.dumps(report))
    with pytest.raises(ResultFileError, match="schema version 1"):
        read_rows(tmp_path / "old.json")
