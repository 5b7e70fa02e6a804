"""`kestrel bench multimodal`'s CUDA path (checkpoints drawn on the device, CUDA-event encoder timing, BF16 engines) on
the tiny checkpoints of both architectures (skipped on CPU). Run on the H200: `.venv/bin/python -m pytest -q tests/gpu`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from kestrel.bench import multimodal, vl_checkpoints

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_multimodal_bench_on_cuda(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    multimodal.add_arguments(parser)
    args = parser.parse_args(["--weights-dir", str(tmp_path), "--result-file", str(tmp_path / "mm.json")])
    multimodal.apply_smoke(args, dtype="bfloat16")
    assert multimodal._run(args, torch.device("cuda")) == 0
    result = json.loads((tmp_path / "mm.json").read_text())
    assert result["environment"]["gpu"] != "cpu"
    assert [m["arch"] for m in result["models"]] == list(vl_checkpoints.SHAPES)
    for model in result["models"]:
        spec = json.loads((Path(model["model"]) / vl_checkpoints.SPEC_FILE).read_text())
        assert spec["dtype"] == "bfloat16"
        for row in model["rows"]:
            assert min(row["encoder_ms"], row["decoder_prefill_ms"], row["engine_ttft_ms"]) > 0
        assert model["throughput"]["output_tokens"] == args.num_requests * args.output_len
    assert (tmp_path / "mm.png").stat().st_size > 0
