"""`kestrel bench whisper` in --smoke mode (a tiny Whisper on the CPU, 1 s windows): the rows' real-time factors
and their parts, the JSON and PNG; the whisper-large-v3-shaped config it writes for the GPU run is the published
model's size in transformers and in kestrel; argument refusals."""

import argparse
import json
from pathlib import Path

import pytest
import torch
import transformers

from kestrel.bench import whisper
from kestrel.config import ConfigError, text_decoder_config
from kestrel.model.registry import model_skeleton


def test_whisper_smoke(tmp_path: Path) -> None:
    out = tmp_path / "whisper.json"
    assert whisper.main(["--smoke", "--result-file", str(out), "--weights-dir", str(tmp_path / "model")]) == 0
    result = json.loads(out.read_text())
    cfg = result["config"]
    assert result["suite"] == "whisper" and cfg["smoke"] and result["targets"] == []
    assert [r["batch"] for r in result["rows"]] == cfg["batch_sizes"] == [1, 4]
    for row in result["rows"]:
        assert row["audio_s"] == row["batch"] * cfg["window_s"] == row["batch"]
        assert row["rtf"] == pytest.approx(row["wall_s"] / row["audio_s"])
        assert 0 < row["features_s"] < row["wall_s"] and 0 < row["engine_s"] < row["wall_s"]
        assert row["output_tok_per_s"] * row["wall_s"] == pytest.approx(row["batch"] * cfg["output_len"])
    assert out.with_suffix(".png").stat().st_size > 0


def test_large_v3_config_has_the_published_size(tmp_path: Path) -> None:
    path = whisper.write_config(tmp_path, whisper.LARGE_V3)
    with torch.device("meta"):
        hf_model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig.from_pretrained(str(path)))
    ours = model_skeleton(text_decoder_config(json.loads((path / "config.json").read_text())))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in hf_model.parameters()) and 1.5e9 < count < 1.6e9
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(str(path))
    assert extractor.feature_size == 128 and extractor.n_samples == 30 * 16000


@pytest.mark.parametrize("flags", [["--batch-sizes", "0"], ["--batch-sizes", "a"], ["--output-len", "0"],
                                   ["--output-len", "445"], ["--repeats", "0"]])
def test_bad_arguments_are_refused(flags: list[str]) -> None:
    parser = argparse.ArgumentParser()
    whisper.add_arguments(parser)
    with pytest.raises(ConfigError, match=flags[0]):
        whisper.check_arguments(parser.parse_args(flags), whisper.LARGE_V3)
    assert whisper.main([*flags]) == 2  # the same refusal from the command line, before any model is built
