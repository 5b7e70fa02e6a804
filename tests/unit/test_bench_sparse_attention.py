"""`kestrel bench sparse-attention` on tiny settings: the quality mode really decodes through Quest (every layer,
every step past the budget) and writes its JSON + PNG; the speed mode's code runs on the CPU references."""

from __future__ import annotations

import json
import math

from kestrel.bench import sparse_attention


def test_quality_mode_exercises_quest_on_every_scored_step(tmp_path) -> None:
    out = tmp_path / "quality.json"
    assert sparse_attention.main(["--device", "cpu", "--context", "96", "--prefill", "60", "--windows", "2",
                                  "--batch", "2", "--budgets", "64", "--dense-layers", "0,2", "--page-sizes", "16,8",
                                  "--max-files", "8", "--result-file", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["scored_tokens"] == 2 * 35 and len(result["rows"]) == 4
    assert [(r["dense_layers"], r["page_size"]) for r in result["rows"]] == [(0, None), (0, 8), (2, None), (2, 8)]
    assert result["tail_first_context"] == 72
    for row in result["rows"]:
        layers = 7 - row["dense_layers"]
        assert row["sparse_layer_calls"] == row["expected_sparse_layer_calls"] == layers * 1 * (95 - 64)
        assert len(row["attention_rel_error_mean_per_layer"]) == layers
        assert math.isfinite(row["ppl_delta"]) and math.isfinite(row["ppl_delta_tail"])
        assert row["attention_rel_error_mean"] > 0
    assert [t["pass"] for t in result["targets"]] == [False] * 4  # no 24-token budget (25% of 96) was run
    assert (tmp_path / "quality.png").exists()


def test_speed_mode_runs_on_the_cpu_references(tmp_path) -> None:
    out = tmp_path / "speed.json"
    assert sparse_attention.main(["--mode", "speed", "--device", "cpu", "--dtype", "float32", "--contexts", "200",
                                  "--batches", "1,3", "--budgets", "64", "--heads", "4", "--kv-heads", "2",
                                  "--head-size", "32", "--page-sizes", "16,8", "--result-file", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["batch"], r["context"], r["page_size"]) for r in result["rows"]] == [
        (1, 200, 16), (3, 200, 16), (1, 200, 8), (3, 200, 8)]
    assert all(r["output_finite"] and r["quest_us"] > 0 for r in result["rows"])
    assert result["note"] and result["targets"] == []
