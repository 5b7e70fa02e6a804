"""`kestrel bench latency`, `throughput` and `structured` end to end in --smoke mode (tiny model, CPU)."""

import json
from pathlib import Path

from kestrel.bench import latency, throughput


def test_latency_smoke(tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    assert latency.main(["--smoke", "--result-file", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["suite"] == "latency" and result["config"]["smoke"]
    assert {"git_sha", "torch", "gpu"} <= set(result["environment"])
    assert result["ceilings"]["copy_TBps"] > 0 and result["startup_s"] > 0
    phases = result["startup_phases_s"]  # the runner's start-up by phase, in order, within the whole start-up
    assert list(phases) == ["weights", "model_setup", "memory_profile", "kv_cache", "compile_ahead", "graphs"]
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= result["startup_s"]
    rows = [r for r in result["rows"] if "skipped" not in r]
    assert len(rows) == len(result["config"]["batches"]) * len(result["config"]["input_lens"])
    output_len = result["config"]["output_len"]
    for row in rows:
        assert row["ttft_ms"] > 0 and row["first_request_ttft_ms"] <= row["ttft_ms"]
        assert row["decode_ms_per_token"] > 0 and row["decode_steps_timed"] == row["repeats"] * (output_len - 1)
        assert row["decode_p10_ms"] <= row["decode_ms_per_token"] <= row["decode_p90_ms"]
        # prompts prefilled in one step: every decode step but the last (which finishes them) is full-batch; a
        # batch prefilled over several steps finishes over several, and has fewer
        full_batch_most = row["repeats"] * (output_len - 2)
        if row["batch"] == 1:
            assert row["full_batch_steps_timed"] == full_batch_most
        assert 1 <= row["full_batch_steps_timed"] <= full_batch_most
        assert row["decode_full_batch_ms"] > 0 and row["decode_full_batch_mean_ms"] > 0
        assert row["decode_roofline_ms"] > 0 and row["ttft_roofline_ms"] > 0
        assert abs(row["decode_x_roofline"] * row["decode_roofline_ms"] - row["decode_ms_per_token"]) < 1e-6
    weights = result["weight_bytes"]
    assert weights["total"] == weights["embedding"] + weights["per_step"] and weights["embedding"] > 0
    peer = result["hf_peer"]["rows"]
    assert [p["input_len"] for p in peer] == result["config"]["input_lens"]
    assert all(p["decode_ms_per_token"] > 0 and p["ttft_ms"] > 0 for p in peer)
    batch1 = [r for r in rows if r["batch"] == 1]
    assert all(r["speedup_vs_hf_eager"] > 0 for r in batch1)
    assert result["targets"] and isinstance(result["targets"][0]["pass"], bool)
    assert out.with_suffix(".png").stat().st_size > 0


def test_throughput_smoke(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    assert throughput.main(["--smoke", "--result-file", str(out)]) == 0
    result = json.loads(out.read_text())
    cfg, ours, hf = result["config"], result["kestrel"], result["hf_peer"]
    assert result["suite"] == "throughput" and cfg["smoke"]
    assert ours["output_tokens"] == cfg["num_prompts"] * cfg["output_len"]
    assert ours["prompt_tokens"] == cfg["num_prompts"] * cfg["input_len"]
    assert ours["output_tok_per_s"] > 0 and ours["total_tok_per_s"] > ours["output_tok_per_s"]
    assert abs(ours["requests_per_s"] * ours["elapsed_s"] - cfg["num_prompts"]) < 1e-6
    assert result["startup_to_first_token_s"] >= result["engine_build_s"] > 0
    assert hf["output_tokens"] == hf["num_prompts"] * cfg["output_len"] and hf["output_tok_per_s"] > 0
    assert result["speedup_vs_hf"] == ours["output_tok_per_s"] / hf["output_tok_per_s"]
    assert result["targets"][0]["target"].startswith("output tok/s")
    assert out.with_suffix(".png").stat().st_size > 0


def test_throughput_reuses_peer_and_truncates(tmp_path: Path) -> None:
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    assert throughput.main(["--smoke", "--result-file", str(first)]) == 0
    assert throughput.main(["--smoke", "--max-seconds", "0", "--hf-result", str(first),
                            "--result-file", str(second)]) == 0
    result = json.loads(second.read_text())
    assert result["hf_peer"]["from_file"] == str(first)
    assert result["kestrel"]["truncated"] and result["kestrel"]["output_tokens"] == 0
    assert throughput.main(["--smoke", "--input-len", "7", "--hf-result", str(first)]) == 0  # smoke fixes the lens
    mismatched = json.loads(first.read_text())
    mismatched["config"]["output_len"] += 1
    (tmp_path / "bad.json").write_text(json.dumps(mismatched))
    assert throughput.main(["--smoke", "--hf-result", str(tmp_path / "bad.json")]) == 2


def test_random_checkpoint_is_shared_and_reused(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from kestrel.bench import common

    config = {**common.LLAMA3_8B, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
              "max_position_embeddings": 256, "torch_dtype": "float32"}
    common.write_random_checkpoint(tmp_path, config, torch.device("cpu"))
    assert common.has_checkpoint(tmp_path, config)
    stamp = next(tmp_path.glob("*.safetensors")).stat().st_mtime_ns
    common.write_random_checkpoint(tmp_path, config, torch.device("cpu"))  # reused, not rewritten
    assert next(tmp_path.glob("*.safetensors")).stat().st_mtime_ns == stamp
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    engine = common.build_engine(str(tmp_path), dtype="float32", device="cpu", max_model_len=64)
    assert isinstance(engine.core.tokenizer, common.NullTokenizer)
    hf_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    assert common.weight_bytes(engine.runner.model)["total"] == hf_bytes
    embed = hf.model.embed_tokens.weight
    assert torch.equal(engine.runner.model.model.embed_tokens.weight, embed)


def test_parity_check_agrees_with_hf_on_cpu() -> None:
    """The benchmark's correctness check itself: kestrel-tiny vs transformers in float32 agree exactly, and a
    corrupted output is reported with its first divergence."""
    from kestrel.bench import checks
    from kestrel.tiny import default_model_path

    batch = checks.prompts(count=3, vocab=8000)
    row = checks.parity_check(str(default_model_path()), "kestrel-tiny", "cpu", batch, dtype="float32", max_new=6)
    assert row["pass"] and row["identical_sequences"] == 3 and row["token_agreement"] == 1.0
    bad = checks.agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert bad["first_divergence"] == [None, 1] and bad["identical_sequences"] == 1


def test_structured_smoke(tmp_path: Path) -> None:
    from kestrel.bench import structured

    out = tmp_path / "structured.json"
    assert structured.main(["--smoke", "--result-file", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["complete"] and set(result["config"]["schemas"]) == {"record", "digit-array"}
    for row in result["rows"]:
        for name in ("record", "digit-array"):
            assert row[f"{name}_ms_per_step"] > 0 and row[f"{name}_mask_fill_ms_per_step"] > 0


def test_random_weight_only_checkpoint_loads_on_the_weight_only_kernel(tmp_path: Path) -> None:
    """`--weight-only`: random pack-quantized codes whose dequantized weights have about the dense std (0.02)."""
    import torch

    from kestrel.bench import common
    from kestrel.config import ModelConfig
    from kestrel.loader import load_model
    from kestrel.loader.model_init import write_tiny_checkpoint
    from kestrel.quant import WNA16LinearMethod

    config = write_tiny_checkpoint(tmp_path / "dense", "llama", "tiny")
    for bits, group in ((4, 32), (8, -1)):
        out = tmp_path / f"w{bits}"
        saved = common.write_random_weight_only_checkpoint(out, config, bits, group, torch.device("cpu"))
        weights = saved["quantization_config"]["config_groups"]["group_0"]["weights"]
        assert weights["num_bits"] == bits and weights["group_size"] == (group if group > 0 else None)
        model = load_model(ModelConfig(str(out), dtype="float32"))
        layers = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), WNA16LinearMethod)]
        assert layers, "the random checkpoint should load onto the weight-only method"
        eye = torch.eye(layers[0].input_size)
        dense = layers[0](eye)
        assert 0.01 < float(dense.std()) < 0.04, float(dense.std())


def test_moe_step_bytes_count_the_experts_a_batch_chooses(tmp_path: Path) -> None:
    from kestrel.bench import common
    from kestrel.config import ModelConfig
    from kestrel.loader import load_model
    from kestrel.loader.model_init import write_tiny_checkpoint

    config = write_tiny_checkpoint(tmp_path, "qwen3_moe", "tiny")
    model = load_model(ModelConfig(str(tmp_path), dtype="float32"))
    weights = common.weight_bytes(model)
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    assert weights["experts"] == experts > 0
    assert (weights["num_experts"], weights["top_k"]) == (config["num_experts"], config["num_experts_per_tok"])
    dense = weights["per_step"] - experts
    k_over_e = config["num_experts_per_tok"] / config["num_experts"]
    assert abs(common.step_weight_bytes(weights, 1) - (dense + experts * k_over_e)) < 1e-6 * experts
    assert common.step_weight_bytes(weights, 1) < common.step_weight_bytes(weights, 8) < weights["per_step"]
    assert abs(common.step_weight_bytes(weights, 10_000) - weights["per_step"]) < 1e-6 * experts


def test_long_prompt_ttft_is_judged_against_its_floor() -> None:
    """A batch-1 prompt of 8k tokens or more gets the TTFT <= 1.3x floor target (the longest such row); a 128-token
    one the 10 ms target; shorter long prompts, other batches and smoke runs none of the long-prompt kind."""
    def row(batch: int, input_len: int, ttft: float, floor: float) -> dict:
        return {"batch": batch, "input_len": input_len, "ttft_ms": ttft, "ttft_roofline_ms": floor,
                "decode_ms_per_token": 5.0, "decode_roofline_ms": 4.0}

    rows = [row(1, 128, 6.0, 1.0), row(1, 8192, 250.0, 200.0), row(1, 16384, 700.0, 500.0), row(8, 8192, 1.0, 1.0),
            row(1, 4096, 1.0, 1.0)]
    targets = {t["target"]: t for t in latency.evaluate_targets(rows, "bf16", smoke=False)}
    long = targets["TTFT <= 1.3x its floor (bf16, batch 1, prompt 16384)"]
    assert long["limit_ms"] == 650.0 and long["measured_ms"] == 700.0 and not long["pass"]
    assert targets["TTFT <= 10 ms (bf16, batch 1, prompt 128)"]["pass"]
    assert sum("its floor" in name for name in targets) == 1
    assert not any("its floor" in t["target"] for t in latency.evaluate_targets(rows, "bf16", smoke=True))
    passing = latency.evaluate_targets([row(1, 8192, 250.0, 200.0)], "fp8", smoke=False)
    assert [t["pass"] for t in passing if "its floor" in t["target"]] == [True]


def test_throughput_engine_carries_the_engines_grammar_backend(tmp_path: Path, capsys) -> None:
    """The bench's engine has the structured-outputs backend LLM builds (its grammar workers too) where there is a
    tokenizer, and records it; grammar workers without a tokenizer are refused by name."""
    out = tmp_path / "workers.json"
    assert throughput.main(["--smoke", "--grammar-workers", "1", "--result-file", str(out)]) == 0
    cfg = json.loads(out.read_text())["config"]
    assert cfg["grammar_workers"] == 1 and cfg["tokenizer"]
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    assert throughput.main(["--smoke", "--tokenizer", str(empty), "--grammar-workers", "1",
                            "--result-file", str(tmp_path / "refused.json")]) == 2
    assert "grammar_workers=1" in capsys.readouterr().err


def test_gguf_mix_follows_llama_cpp_q4_k_m_rule() -> None:
    """Q4_K_M: Q6_K for the LM head and, in the first and last eighth of the layers and every third between, for
    V and down; Q4_K elsewhere. The other mixes keep one type (the LM head in Q6_K / Q8_0)."""
    from kestrel.bench.common import gguf_mix_type

    more_bits = [i for i in range(32) if gguf_mix_type("gguf-q4_k_m", f"blk.{i}.attn_v.weight", 32) == "Q6_K"]
    assert more_bits == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [gguf_mix_type("gguf-q4_k_m", f"blk.{i}.ffn_down.weight", 32) for i in (5, 6)] == ["Q4_K", "Q6_K"]
    assert {gguf_mix_type("gguf-q4_k_m", n, 32) for n in ("blk.6.attn_q.weight", "blk.6.ffn_up.weight",
                                                           "token_embd.weight")} == {"Q4_K"}
    assert gguf_mix_type("gguf-q4_k_m", "output.weight", 32) == "Q6_K"
    assert [gguf_mix_type("gguf-q4_0", n, 32) for n in ("blk.0.attn_v.weight", "output.weight")] == ["Q4_0", "Q6_K"]
    assert [gguf_mix_type("gguf-q8_0", n, 32) for n in ("blk.0.attn_v.weight", "output.weight")] == ["Q8_0", "Q8_0"]


def test_random_gguf_loads_every_linear_on_the_weight_only_kernel(tmp_path: Path) -> None:
    """`--weight-only gguf-*`: a random GGUF file of the architecture's shapes (written once, reused for the same
    config and mix) serves greedy tokens with every projection on the kernel; flags that do not apply to it are
    refused by name."""
    import pytest
    import torch

    from kestrel import LLM, SamplingParams
    from kestrel.bench import common
    from kestrel.config import ConfigError
    from kestrel.loader.model_init import write_tiny_checkpoint
    from kestrel.quant.schemes.gguf import GGUFLinearMethod

    config = write_tiny_checkpoint(tmp_path / "dense", "llama", "tiny", hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=8, vocab_size=8192, rope_scaling=None)
    path = tmp_path / "gguf" / "model.gguf"
    common.write_random_gguf(path, config, "gguf-q4_k_m")
    written = path.stat().st_mtime_ns
    common.write_random_gguf(path, config, "gguf-q4_k_m")
    assert path.stat().st_mtime_ns == written
    llm = LLM(str(path), dtype="float32", max_model_len=64)
    model = llm.engine.runner.model
    methods = [m.quant_method for m in model.modules() if isinstance(getattr(m, "quant_method", None),
                                                                     GGUFLinearMethod)]
    assert len(methods) == 4 * 8 and {t for m in methods for t in m.ggml_types} == {"Q4_K", "Q6_K"}
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy)
    assert len(out[0].outputs[0].token_ids) == 4
    assert common.prompt_vocab(str(path)) == config["vocab_size"]
    engine = common.build_engine(str(path), dtype="float32", max_model_len=64, max_num_seqs=2)
    assert engine.core.tokenizer.decode([5, 6]) == llm.get_tokenizer().decode([5, 6])
    with pytest.raises(ConfigError, match="--group-size=64.*gguf-q4_k_m's groups"):
        common.prepare_model(None, "llama3-8b", False, tmp_path, False, torch.device("cpu"), "gguf-q4_k_m", 64)
    with pytest.raises(ConfigError, match="HF peer"):
        common.prepare_model(None, "llama3-8b", False, tmp_path, True, torch.device("cpu"), "gguf-q4_k_m")


def test_suites_without_weight_only_checkpoints_refuse_the_flags() -> None:
    """structured, spec-decode and step-budget build --arch's float model: --weight-only and --group-size are
    refused by name there, not dropped; a GGUF mix of an architecture GGUF files do not hold is refused too."""
    import argparse

    import pytest
    import torch

    from kestrel.bench import common, step_budget
    from kestrel.config import ConfigError

    parser = argparse.ArgumentParser()
    step_budget.add_arguments(parser)
    for flags, named in ((["--weight-only", "gguf-q4_0"], "--weight-only"), (["--group-size", "64"], "--group-size")):
        with pytest.raises(ConfigError, match=f"{named} for kestrel bench step-budget"):
            step_budget.run(parser.parse_args(["--smoke", *flags]))
    with pytest.raises(ConfigError, match="--arch qwen3-30b-a3b"):
        common.prepare_model(None, "qwen3-30b-a3b", False, None, False, torch.device("cpu"), "gguf-q4_k_m")
