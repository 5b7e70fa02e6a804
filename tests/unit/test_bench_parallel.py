"""Issue 18's job on the CPU: the 70B bench shape, `kestrel bench allreduce --smoke` (gloo, two spawned ranks),
the greedy-parity script's smoke, and the table printer's ratios."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from kestrel.bench import allreduce, common

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llama3_70b_arch_is_the_shape_issue_18_states():
    cfg = common.ARCHS["llama3-70b"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (80, 8192, 28672)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (64, 8, 128)
    assert cfg["vocab_size"] == 128256
    assert cfg["rope_scaling"] == common.ARCHS["llama3-8b"]["rope_scaling"]
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    # 70.6e9 parameters: 80 x (8192 x (8192 + 2 x 1024) + 8192 x 8192 + 3 x 8192 x 28672) + 2 x 128256 x 8192.
    params = sum(common.math_prod(s) for s in common.checkpoint_shapes(cfg).values())
    assert params == 80 * (8192 * 10240 + 8192 * 8192 + 3 * 8192 * 28672 + 2 * 8192) + 8192 + 2 * 128256 * 8192


def test_allreduce_smoke_checks_sums_and_derives_per_layer_times(tmp_path):
    out = tmp_path / "allreduce.json"
    assert allreduce.main(["--smoke", "--result-file", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["backend"] == "gloo" and result["config"]["world_size"] == 2
    assert result["checks"] == [{"check": "all-reduce sums", "pass": True}]
    assert {(r["hidden"], r["tokens"]) for r in result["rows"]} == {(64, 1), (64, 8), (128, 1), (128, 8)}
    bw = result["bandwidth"]
    assert bw["bytes"] == 2**20
    assert abs(bw["busbw_GBps"] - bw["algbw_GBps"]) <= 1e-9 * bw["algbw_GBps"]  # 2 (n - 1) / n = 1 for n = 2
    for r in result["rows"]:
        assert r["bytes"] == r["tokens"] * r["hidden"] * 2
        assert r["us_per_layer"] == 2 * r["us_per_allreduce"]
        assert r["ms_per_decode_step"] is None  # only 4096 (32 layers) and 8192 (80) name a model
        bound = r["bytes"] / (bw["busbw_GBps"] * 1e3)
        assert abs(r["bandwidth_bound_us"] - bound) <= 1e-6 * bound
    assert out.with_suffix(".png").is_file() or common.pyplot() is None


def test_parity_script_smoke_matches_tp1(tmp_path):
    out = tmp_path / "parity.json"
    assert _script("parallel_parity").main(["--smoke", "--result-file", str(out)]) == 0
    result = json.loads(out.read_text())
    assert all(run["errors"] == [] for run in result["runs"].values())
    for name in ("tp2", "pp2"):
        assert [p["identical"] for p in result["runs"][name]["prompts"]] == [True, True, True]


def _latency(batch_ms: dict[int, float], roofline_ms: float) -> dict:
    return {"suite": "latency", "complete": True,
            "rows": [{"batch": b, "input_len": 128, "decode_ms_per_token": ms, "decode_roofline_ms": roofline_ms,
                      "decode_x_roofline": ms / roofline_ms, "ttft_ms": 10.0} for b, ms in batch_ms.items()]}


def test_table_reports_the_issue_ratios(tmp_path):
    (tmp_path / "8b-latency-tp1.json").write_text(json.dumps(_latency({1: 5.0, 32: 6.0}, 2.0)))
    (tmp_path / "8b-latency-tp2.json").write_text(json.dumps(_latency({1: 3.5, 32: 4.0}, 1.0)))
    (tmp_path / "70b-bf16-latency-tp2.json").write_text(json.dumps(_latency({1: 24.0}, 20.0)))
    (tmp_path / "70b-fp8-latency-tp1.json").write_text(json.dumps({**_latency({1: 9.0}, 8.0), "complete": False}))
    table = _script("h200x2_table")
    assert table.main([str(tmp_path)]) == 0
    found = {t["target"].split(":")[0]: t for t in json.loads((tmp_path / "summary.json").read_text())["targets"]}
    tp = found["8B FP8 batch-1 decode, TP=2 / TP=1"]
    assert tp["measured"] == 3.5 / 5.0 and tp["pass"] is False
    roof = found["70B BF16 TP=2 batch-1 decode / roofline"]
    assert roof["measured"] == 24.0 / 20.0 and roof["pass"] is True
    missing = next(t for t in found.values() if t["target"].startswith("runs without"))
    assert "70b-fp8-latency-tp1" in missing["target"] and "8b-latency-tp1" not in missing["target"]
    assert found["greedy parity with TP=1 (not run)"]["pass"] is None


def test_fp8_kv_scales_calibrated_through_the_executor_per_pipeline_stage(tmp_path):
    from kestrel.loader.model_init import write_tiny_checkpoint
    from kestrel.sampling_params import SamplingParams

    write_tiny_checkpoint(tmp_path, "llama", "tiny", **common.SMOKE_OVERRIDES)
    tokens, scales = {}, {}
    for pp in (1, 2):
        engine = common.build_engine(str(tmp_path), dtype="float32", device="cpu", kv_cache_dtype="fp8",
                                     enable_prefix_caching=False, max_num_seqs=1, max_model_len=64,
                                     pipeline_parallel_size=pp, distributed_executor_backend="mp" if pp > 1 else None)
        try:
            scales[pp] = engine.runner.calibrate_kv_scales()  # the reply rank's: the last stage's layers
            engine.core.add_request("r", list(range(5, 20)), SamplingParams(max_tokens=6, temperature=0.0,
                                                                            ignore_eos=True))
            while engine.core.has_unfinished_requests():
                for out in engine.core.step():
                    tokens[pp] = out.outputs[0].token_ids
        finally:
            if pp > 1:
                engine.runner.shutdown()
    num_layers = len(scales[1])
    assert scales[2] == scales[1][num_layers - len(scales[2]):] and len(scales[2]) == num_layers // 2
    assert all(k != 1.0 and v != 1.0 for k, v in scales[1])
    assert tokens[2] == tokens[1]
