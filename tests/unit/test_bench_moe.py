"""`kestrel bench moe`: the CPU smoke run (the reference path of kestrel.ops) writes its JSON with sane numbers and
its plot; bytes count each distinct expert once; routings are seeded, Zipf's skewed; FP8 is refused without the
kernel's FP8 keywords and runs through them when they exist."""

import argparse
import json
import math

import pytest
import torch

from kestrel import ops
from kestrel.bench import moe
from kestrel.config import ConfigError
from kestrel.kernels import fused_moe as fm


def test_smoke_writes_result(tmp_path, capsys):
    assert moe.main(["--smoke", "--routing", "uniform,zipf", "--result-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "moe-smoke.json").read_text())
    assert result["suite"] == "moe"
    for key in ("git_sha", "gpu", "torch", "triton"):
        assert result["environment"][key]
    assert {"bw", "bf16", "eight_bit"} <= set(result["ceilings"])
    cfg = result["config"]
    assert cfg["batches"] == list(moe.SMOKE_BATCHES) and cfg["routings"] == ["uniform", "zipf"]
    assert cfg["dtype"] == "bf16" and cfg["smoke"] and cfg["shapes"]["tiny"]["E"] == moe.SMOKE_SHAPES["tiny"][0]

    E, k, H, inter = moe.SMOKE_SHAPES["tiny"]
    rows = result["results"]
    assert [(r["routing"], r["T"]) for r in rows] == [(ro, T) for ro in ("uniform", "zipf") for T in moe.SMOKE_BATCHES]
    for r in rows:
        T = r["T"]
        assert r["status"] == "ok" and r["err"] == 0.0  # on the CPU the op is its reference
        assert r["flops"] == 2 * T * k * (2 * inter * H + inter * H)
        assert len(r["expert_load"]) == E and sum(r["expert_load"]) == T * k and r["load_max"] == max(r["expert_load"])
        per_layer = r["expert_load_per_layer"]  # every set's load, by the weight layer it ran on
        assert all(len(v) == E for v in per_layer.values())
        assert {int(i) for i in per_layer} <= set(range(r["weight_layers"]))
        assert sum(map(sum, per_layer.values())) == r["sets"] * T * k
        assert k <= r["distinct_experts"] <= min(E, T * k)
        assert len(r["distinct_experts_per_set"]) == r["sets"] >= 2  # rotated input sets
        assert r["weight_bytes"] == pytest.approx(r["distinct_experts"] * 3 * inter * H * 2)
        assert r["bytes"] == pytest.approx(r["weight_bytes"] + r["act_bytes"])
        assert math.isfinite(r["us"]) and 0 < r["us"] < 1e6 and len(r["us_rounds"]) == 2
        assert r["us"] == min(r["us_rounds"])
        assert r["GBps"] == pytest.approx(r["bytes"] / r["us"] * 1e-3)
        assert r["frac_copy"] == pytest.approx(r["GBps"] * 1e9 / result["ceilings"]["bw"])
        assert r["TFLOPs"] == pytest.approx(r["flops"] / r["us"] * 1e-6)
        assert r["roofline_us"] == pytest.approx(max(r["bytes"] / result["ceilings"]["bw"],
                                                     r["flops"] / result["ceilings"]["bf16"]) * 1e6)
        assert r["x_roofline"] == pytest.approx(r["us"] / r["roofline_us"]) and r["x_roofline"] > 1
        assert set(r["anchors"]) == {"torch_experts", "dense_mm"}  # bf16: no FP8 anchor
        for name, a in r["anchors"].items():
            assert a["status"] == "ok" and 0 <= a["err"] <= a["err_limit"] and a["us"] > 0
            assert r[f"speedup_vs_{name}"] == pytest.approx(a["us"] / r["us"])
        assert r["anchors"]["torch_experts"]["bytes"] == pytest.approx(r["bytes"])  # the same experts, once
    assert (tmp_path / "moe-smoke.png").stat().st_size > 0
    lines = out.strip().splitlines()
    assert "fused us" in lines[1] and lines[-1].startswith("(median us per call")
    assert len(lines) == 2 + len(rows) + 1  # the table is the last thing printed


def test_bytes_count_each_distinct_expert_once():
    shape = moe.Shape("hand", E=8, k=2, H=16, I=4)
    expert = 3 * 4 * 16 * 2  # gate + up [2I, H] and down [H, I], bf16
    ids = torch.tensor([[0, 3], [3, 5], [0, 5], [7, 0]], dtype=torch.int32)
    counted = moe.moe_bytes(ids, shape)
    assert counted["distinct_experts"] == 4
    assert counted["weight_bytes"] == 4 * expert
    assert counted["act_bytes"] == 2 * 4 * 16 * 2 + 4 * 2 * (4 + 4)  # x read, out written, weights + ids read
    assert counted["bytes"] == counted["weight_bytes"] + counted["act_bytes"]
    assert moe.expert_load(ids, 8) == [3, 0, 0, 2, 0, 2, 0, 1]

    same = torch.tensor([[2], [2], [2]], dtype=torch.int64)  # every token on one expert: its weights once
    assert moe.moe_bytes(same, moe.Shape("one", 8, 1, 16, 4))["weight_bytes"] == expert

    scales = moe.fp8_scale_bytes(shape, (4, 8))  # w13 [8, 16] in 2 x 2 blocks, w2 [16, 4] in 4 x 1
    assert scales == 4 * (2 * 2 + 4 * 1)
    assert moe.fp8_scale_bytes(shape, None) == 4 * (8 + 16)
    fp8 = moe.moe_bytes(ids, shape, weight_elt=1, scale_bytes_per_expert=scales)
    assert fp8["weight_bytes"] == 4 * (expert // 2 + scales)


def test_routing_is_seeded_and_zipf_is_skewed():
    E, k, T = 16, 4, 512

    def route(kind, seed, hot=None):
        return moe.make_routing(T, E, k, kind, torch.Generator().manual_seed(seed), 1.0, hot)

    w, ids = route("uniform", 3)
    w2, ids2 = route("uniform", 3)
    assert torch.equal(ids, ids2) and torch.equal(w, w2)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.allclose(w.sum(dim=1), torch.ones(T))
    assert all(len(set(row)) == k for row in ids.tolist())  # k distinct experts per token
    hot = torch.randperm(E, generator=torch.Generator().manual_seed(1))
    _, zids = route("zipf", 3, hot)
    assert all(len(set(row)) == k for row in zids.tolist())
    uniform_load, zipf_load = moe.expert_load(ids, E), moe.expert_load(zids, E)
    assert zipf_load.index(max(zipf_load)) == int(hot[0])  # the hottest expert is the one ranked first
    assert max(zipf_load) > 1.5 * max(uniform_load)
    with pytest.raises(ConfigError):
        route("round-robin", 0)


def test_shapes_and_registration():
    parser = argparse.ArgumentParser()
    moe.register(parser.add_subparsers(dest="suite"))
    args = parser.parse_args(["moe", "--smoke", "--shape", "16,2,64,32", "--shape", "tiny", "--batch", "1,2"])
    assert args.func is moe.run and args.result_dir.name == "results"
    assert moe.parse_shapes(args.shape, True) == [moe.Shape("E16-k2-H64-I32", 16, 2, 64, 32),
                                                  moe.Shape("tiny", *moe.SMOKE_SHAPES["tiny"])]
    assert [s.name for s in moe.parse_shapes(["qwen3-30b-a3b,mixtral-8x7b"], False)] == list(moe.SHAPES)
    assert moe.parse_shapes(None, False)[0] == moe.Shape("qwen3-30b-a3b", 128, 8, 2048, 768)
    for bad in ("8,9,64,32", "8,2,64", "llama"):
        with pytest.raises(ConfigError):
            moe.parse_shapes([bad], False)


def test_fp8_refused_without_the_kernels_keywords(monkeypatch, tmp_path, capsys):
    def bf16_only(x, w13, w2, topk_weights, topk_ids, activation="silu"):
        raise AssertionError("not called")

    monkeypatch.setattr(ops, "fused_moe", bf16_only)
    monkeypatch.setattr(fm, "fused_moe", bf16_only)
    monkeypatch.setattr(fm, "fused_moe_ref", bf16_only)
    assert moe.main(["--smoke", "--dtype", "fp8", "--result-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--dtype fp8" in err and "w13_scale" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())
    assert moe.fp8_missing(lambda x, *, w13_scale=None, w2_scale=None, block_shape=None: x) == []


def test_fp8_runs_through_the_keywords_when_present(monkeypatch, tmp_path):
    """A stand-in reference with the FP8 keywords (dequantized weights): the FP8 path of the bench end to end."""
    original = fm.fused_moe_ref

    def ref(x, w13, w2, topk_weights, topk_ids, activation="silu", *, w13_scale=None, w2_scale=None,
            block_shape=None, reduce_inter_amax=None):
        if w13_scale is None:
            return original(x, w13, w2, topk_weights, topk_ids, activation)
        layer = moe.Layer(w13.float(), w2.float(), torch.arange(w13.shape[0]), w13, w13_scale, w2, w2_scale)
        return moe.fp8_dequant_ref(x, layer, topk_weights, topk_ids, tuple(block_shape) if block_shape else None)

    monkeypatch.setattr(fm, "fused_moe_ref", ref)
    assert moe.main(["--smoke", "--dtype", "fp8", "--fp8-block", "16,16", "--batch", "4",
                     "--result-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "moe-smoke.json").read_text())
    assert result["config"]["dtype"] == "fp8" and result["config"]["fp8_block"] == [16, 16]
    (row,) = result["results"]
    E, k, H, inter = moe.SMOKE_SHAPES["tiny"]
    scales = 4 * ((2 * inter // 16) * (H // 16) + (H // 16) * (inter // 16))
    assert row["status"] == "ok" and row["err_limit"] == moe.ERR_LIMIT["fp8"]
    assert row["weight_bytes"] == pytest.approx(row["distinct_experts"] * (3 * inter * H + scales))
    assert row["roofline_us"] == pytest.approx(max(row["bytes"] / result["ceilings"]["bw"],
                                                   row["flops"] / result["ceilings"]["eight_bit"]) * 1e6)
    assert set(row["anchors"]) == set(moe.ANCHORS)  # the torch._scaled_mm anchor joins with --dtype fp8
    assert all(a["status"] == "ok" for a in row["anchors"].values())
    torch_loop = row["anchors"]["torch_experts"]  # bf16 weights: its bytes and roofline are bf16's
    assert torch_loop["bytes"] == pytest.approx(row["distinct_experts"] * 3 * inter * H * 2 + row["act_bytes"])


@pytest.mark.skipif(bool(moe.fp8_missing(fm.fused_moe_ref)), reason="this tree's fused MoE has no FP8 path")
@pytest.mark.parametrize("block", ["16,16", "channel"])
def test_fp8_smoke_through_the_kernels_reference(tmp_path, block):
    assert moe.main(["--smoke", "--dtype", "fp8", "--fp8-block", block, "--batch", "1,16", "--routing", "zipf",
                     "--result-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "moe-smoke.json").read_text())["results"]
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(r["err"] == 0.0 for r in rows)


def test_fp8_quantization_round_trip():
    w = (torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(0)) * 0.05).to(torch.bfloat16)
    for block in ((16, 16), None):
        q, s = moe.quantize_fp8(w, block)
        assert q.dtype == torch.float8_e4m3fn
        assert s.shape == ((3, 3, 2) if block else (3, 40))
        for e in range(3):
            back = moe.dequantize_fp8(q[e], s[e], block)
            assert moe.rel_err(back, w[e].float()) < 0.05
