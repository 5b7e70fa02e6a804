"""`kestrel bench multimodal` in --smoke mode (tiny LLaVA-1.5 and Qwen2.5-VL checkpoints, CPU), its random checkpoints
against transformers, and its target and argument checks."""

import json
from pathlib import Path

import pytest
import torch
import transformers

from kestrel.bench import multimodal, vl_checkpoints


def test_multimodal_smoke(tmp_path: Path) -> None:
    out = tmp_path / "multimodal.json"
    assert multimodal.main(["--smoke", "--result-file", str(out)]) == 0
    result = json.loads(out.read_text())
    cfg = result["config"]
    assert result["suite"] == "multimodal" and cfg["smoke"] and result["targets"] == []
    assert [m["arch"] for m in result["models"]] == list(vl_checkpoints.SHAPES)
    for model in result["models"]:
        rows = model["rows"]
        assert [r["image_size"] for r in rows] == cfg["image_sizes"]
        markers = 2 if model["arch"].startswith("qwen") else 0  # <|vision_start|>, <|vision_end|>
        for row in rows:
            assert row["prompt_tokens"] == row["image_tokens"] + cfg["text_tokens"] + markers
            assert row["ttft_ms"] >= row["engine_ttft_ms"] > 0 and row["preprocess_ms"] > 0
            assert row["decoder_prefill_ms"] > 0 and row["encoder_ms"] > 0
            assert row["encoder_by_difference_ms"] == pytest.approx(
                row["engine_ttft_ms"] - row["decoder_prefill_ms"])
        run = model["throughput"]
        assert run["output_tokens"] == cfg["num_requests"] * cfg["output_len"]
        assert run["requests_per_s"] * run["elapsed_s"] == pytest.approx(cfg["num_requests"])
        assert run["output_tok_per_s"] * run["elapsed_s"] == pytest.approx(run["output_tokens"])
    llava = result["models"][0]["rows"]
    tiny_clip = vl_checkpoints.shape_of("llava-1.5-7b", tiny=True)["vision"]
    assert all(r["image_tokens"] == (tiny_clip["image_size"] // tiny_clip["patch_size"]) ** 2 for r in llava)
    for qwen in result["models"][1:]:  # dynamic resolution: a larger image, more tokens
        assert qwen["rows"][0]["image_tokens"] < qwen["rows"][1]["image_tokens"]
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize("arch, model_class", [
    ("llava-1.5-7b", transformers.LlavaForConditionalGeneration),
    ("qwen2.5-vl-7b", transformers.Qwen2_5_VLForConditionalGeneration),
    ("qwen2-vl-7b", transformers.Qwen2VLForConditionalGeneration)])
def test_random_checkpoint_loads_in_transformers(tmp_path: Path, arch: str, model_class: type) -> None:
    path = vl_checkpoints.write_checkpoint(tmp_path, arch, torch.device("cpu"), torch.float32, tiny=True)
    stamp = next(tmp_path.glob("*.safetensors")).stat().st_mtime_ns
    vl_checkpoints.write_checkpoint(tmp_path, arch, torch.device("cpu"), torch.float32, tiny=True)
    assert next(tmp_path.glob("*.safetensors")).stat().st_mtime_ns == stamp  # reused
    model, info = model_class.from_pretrained(str(path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    shape = vl_checkpoints.shape_of(arch, tiny=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    assert len(tokenizer) == shape["vocab_size"] == model.config.text_config.vocab_size
    image_token = (vl_checkpoints.LLAVA_IMAGE_TOKEN if arch.startswith("llava")
                   else vl_checkpoints.QWEN_IMAGE_TOKEN)
    image_id = model.config.image_token_index if arch.startswith("llava") else model.config.image_token_id
    assert tokenizer.convert_tokens_to_ids(image_token) == image_id == shape["base_vocab"] + (
        0 if arch.startswith("llava") else vl_checkpoints.QWEN_SPECIAL_TOKENS.index(image_token))


def test_targets_and_arguments() -> None:
    row = {"image_size": 336, "text_tokens": 64, "ttft_ms": 41.0}
    models = [{"arch": "a", "rows": [row]}, {"arch": "b", "rows": [{**row, "ttft_ms": 75.0}]}]
    targets = multimodal.evaluate_targets(models, smoke=False)
    assert [(t["measured"], t["pass"]) for t in targets] == [(41.0, True), (75.0, False)]
    assert all(t["limit"] == 60.0 for t in targets)
    assert multimodal.evaluate_targets([{"arch": "a", "rows": [{**row, "image_size": 1024}]}], smoke=False) == []
    assert multimodal.main(["--arch", "llava-9b"]) == 2
    assert multimodal.main(["--image-sizes", "big"]) == 2
    assert multimodal.main(["--repeats", "0"]) == 2


def test_a_failed_model_is_recorded_and_the_next_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    measure = multimodal.measure_model

    def all_but_the_last_fail(arch, *args):
        if arch != "qwen2-vl-7b":
            raise RuntimeError("out of memory")
        return measure(arch, *args)

    monkeypatch.setattr(multimodal, "measure_model", all_but_the_last_fail)
    out = tmp_path / "multimodal.json"
    assert multimodal.main(["--smoke", "--result-file", str(out)]) == 1
    *failed, last = json.loads(out.read_text())["models"]
    assert failed == [{"arch": "llava-1.5-7b", "error": "RuntimeError: out of memory"},
                      {"arch": "qwen2.5-vl-7b", "error": "RuntimeError: out of memory"}]
    assert last["arch"] == "qwen2-vl-7b" and last["throughput"]["output_tokens"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
