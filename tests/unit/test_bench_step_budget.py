"""`kestrel bench step-budget`: kernel -> component assignment, the per-component floors, and a --smoke run."""

import json
from pathlib import Path

import pytest

from kestrel.bench import common, step_budget

CEILINGS = {"copy_TBps": 4.0, "bf16_TFLOPs": 800.0, "fp8_TFLOPs": 1600.0}


def fp8_layer() -> list[tuple[str, float]]:
    """One W8A8-FP8 decoder layer's kernels in launch order (names as the profiler shows them)."""
    return [("_rms_norm_quant_kernel", 1.0), ("_scaled_mm_kernel", 10.0), ("_rope_store_kv_kernel", 1.0),
            ("_paged_attn_kernel", 20.0), ("_merge_splits_kernel", 2.0), ("_act_quant_kernel", 1.5),
            ("_scaled_mm_kernel", 7.0), ("_rms_norm_quant_kernel", 1.0), ("_scaled_mm_kernel", 30.0),
            ("_silu_mul_quant_kernel", 1.0), ("_scaled_mm_kernel", 15.0)]


def test_gemms_are_labelled_by_their_place_in_the_step():
    layers, steps = 3, 2
    step = [("void at::native::index_elementwise_kernel", 2.0)] + fp8_layer() * layers + [
        ("_rms_norm_kernel", 1.0), ("nvjet_sm90_tst_256x8_64x6_2x1_v_bz_TNT", 50.0),
        ("cublasLt::splitKreduce_kernel<32, 16>", 4.0), ("at::native::reduce_kernel ArgMaxOps", 3.0)]
    per_step, ordered = step_budget.assign_components(step * steps, layers, steps)
    assert ordered
    assert per_step["qkv"] == (layers, 10.0 * layers)
    assert per_step["o"] == (layers, 7.0 * layers)
    assert per_step["gate_up"] == (layers, 30.0 * layers)
    assert per_step["down"] == (layers, 15.0 * layers)
    assert per_step["lm_head"] == (2, 54.0)  # the split-K reduction belongs to the GEMM before it
    assert per_step["attention"] == (2 * layers, 22.0 * layers)
    assert per_step["norm_rope_act_quant"] == (5 * layers + 1, 5.5 * layers + 1.0)
    assert per_step["embed_sampler_other"] == (2, 5.0)


def test_an_unexpected_gemm_count_is_not_labelled():
    per_step, ordered = step_budget.assign_components(fp8_layer() * 2, 3, 1)
    assert not ordered and per_step["gemm_unassigned"][0] == 8 and "qkv" not in per_step


def test_busy_time_is_the_union_of_kernel_intervals():
    events = [("a", 0.0, 10.0), ("b", 5.0, 10.0), ("c", 20.0, 5.0), ("d", 21.0, 1.0)]
    assert step_budget.busy_us(events) == 20.0
    # a kernel launched early (programmatic dependent launch) is charged only past its producer's end
    exclusive = step_budget.exclusive_durations(events)
    assert exclusive == [("a", 10.0), ("b", 5.0), ("c", 5.0), ("d", 0.0)]
    assert sum(d for _, d in exclusive) == step_budget.busy_us(events)


def test_decode_floors_at_llama3_8b_shape():
    hf = common.LLAMA3_8B
    batch, context = 512, 1500
    floors = step_budget.component_floors(hf, "fp8", 1, batch, batch, batch * context, batch * context, CEILINGS)
    # gate_up at M=512 is compute-bound: 2 * 512 * 28672 * 4096 FLOPs per layer at 1600 TFLOP/s.
    assert floors["gate_up"] == pytest.approx(32 * 1e6 * 2 * batch * 28672 * 4096 / 1.6e15)
    # attention reads every cached token's K and V once per layer: 8 heads x 128 x 2 x 1 byte.
    kv = 32 * batch * context * 8 * 128 * 2
    assert floors["attention"] == pytest.approx(1e6 * (kv + 32 * batch * 32 * 128 * 4) / 4e12)
    assert floors["host_gap"] == 0
    bf16 = step_budget.component_floors(hf, "bf16", 2, batch, batch, batch * context, batch * context, CEILINGS)
    assert bf16["attention"] > 1.9 * floors["attention"]
    # at one token the GEMMs are bound by their weight bytes
    one = step_budget.component_floors(hf, "bf16", 2, 1, 1, 1500, 1500, CEILINGS)
    assert one["qkv"] == pytest.approx(32 * 1e6 * (6144 * 4096 * 2 + 4096 * 2 + 6144 * 2) / 4e12)
    # norms with residual, RoPE + KV write, SiLU-mul: every activation read and written once per layer
    per_token = 2 * (3 * 4096 * 2 + 4096 * 2) + 6144 * 2 + 4096 * 2 + 2 * 8 * 128 * 2 + 2 * 14336 * 2 + 14336 * 2
    assert one["norm_rope_act_quant"] == pytest.approx(32 * 1e6 * per_token / 4e12)


def test_step_budget_smoke(tmp_path: Path):
    out = tmp_path / "step-budget.json"
    assert step_budget.main(["--smoke", "--result-file", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["suite"] == "step_budget" and result["config"]["smoke"]
    kinds = [(r["kind"], r["batch"]) for r in result["results"]]
    assert kinds == [("decode", 3), ("prefill", 2)]
    for row in result["results"]:
        assert row["step_us"] > 0 and set(step_budget.COMPONENTS) <= set(row["components"])
        assert row["components"]["host_gap"]["us"] >= 0
    assert out.with_suffix(".png").stat().st_size > 0
