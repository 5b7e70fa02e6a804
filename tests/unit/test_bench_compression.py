"""`kestrel bench compression` end to end on the bundled kestrel-tiny (a few held-out samples): the uncompressed
row is the reference, each method keeps the rate asked for, and the JSON + PNG are written."""

import json
import math

from kestrel.bench import compression


def test_quality_run_scores_every_method_at_the_rate_asked(tmp_path):
    result = tmp_path / "compression.json"
    assert compression.main(["--files", "2", "--per-file", "2", "--context", "96", "--continuation", "16",
                             "--rates", "0.5", "--result-file", str(result)]) == 0
    doc = json.loads(result.read_text())
    rows = {(row["method"], row["rate"]): row for row in doc["rows"]}
    assert set(rows) == {("none", 1.0), ("compressor", 0.5), ("random", 0.5), ("truncate", 0.5)}
    reference = rows["none", 1.0]
    assert reference["achieved_rate"] == 1.0 and reference["perplexity_delta"] == 0.0
    for method in ("compressor", "random", "truncate"):
        row = rows[method, 0.5]
        assert abs(row["achieved_rate"] - 0.5) < 0.05, row
        assert math.isfinite(row["perplexity"]) and row["perplexity"] > 1
        assert math.isclose(row["perplexity_delta"], row["perplexity"] / reference["perplexity"] - 1, rel_tol=1e-9)
    assert rows["compressor", 0.5]["compressor_seconds_per_1k_tokens"] > 0
    assert doc["samples"] == 4 and result.with_suffix(".png").exists()
