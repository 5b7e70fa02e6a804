"""`kestrel bench quant-checkpoint`: the ratios and targets it reports, and a --smoke run end to end."""

import json

from kestrel.bench import quant_checkpoint


def row(scheme: str, path: str, tok_s: float, ms: float, build_s: float) -> dict:
    return {"scheme": scheme, "path": path, "output_tok_per_s": tok_s, "decode_ms_per_token": ms, "ttft_ms": 30.0,
            "engine_build_s": build_s}


def test_ratios_are_the_checkpoint_over_quantization_at_load():
    rows = [row("fp8-static", "at load", 1000.0, 4.0, 10.0), row("fp8-static", "checkpoint", 950.0, 4.2, 6.0)]
    (c,) = quant_checkpoint.compare(rows, ["fp8-static"])
    assert c["throughput_ratio"] == 0.95 and abs(c["decode_latency_ratio"] - 1.05) < 1e-12
    assert c["engine_build_saved_s"] == 4.0 and c["engine_build_ratio"] == 0.6
    verdicts = {t["target"].split(": ")[1]: t["pass"] for t in quant_checkpoint.evaluate_targets([c], smoke=False)}
    assert verdicts == {"output tok/s >= 97% of quantization at load": False,
                        "batch-1 decode ms/token <= 103% of quantization at load": False,
                        "engine build faster than quantization at load": True}


def test_a_failed_measurement_fails_its_targets():
    rows = [row("w8a8-int8", "at load", 1000.0, 4.0, 10.0),
            {"scheme": "w8a8-int8", "path": "checkpoint", "throughput_error": "exit 1"}]
    comparison = quant_checkpoint.compare(rows, ["w8a8-int8"])
    assert "throughput_ratio" not in comparison[0]
    assert not any(t["pass"] for t in quant_checkpoint.evaluate_targets(comparison, smoke=False))


def test_smoke_run_measures_both_paths_of_a_scheme(tmp_path, capsys):
    result_file = tmp_path / "qc.json"
    assert quant_checkpoint.main(["--smoke", "--schemes", "w8a8-int8", "--result-file", str(result_file)]) == 0
    result = json.loads(result_file.read_text())
    assert [(r["path"], r["precision"]) for r in result["rows"]] == [("at load", "int8"), ("checkpoint", "int8")]
    assert all(r["output_tok_per_s"] > 0 and r["decode_ms_per_token"] > 0 for r in result["rows"])
    assert result["checkpoints"]["w8a8-int8"]["linear_layers"] > 0
    assert set(result["comparison"][0]) >= {"throughput_ratio", "decode_latency_ratio", "engine_build_ratio"}
