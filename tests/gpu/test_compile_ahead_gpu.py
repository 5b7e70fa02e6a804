"""GPU-only: compiling Triton kernels ahead of the profile run and the graph capture (`compile_workers`,
kestrel.kernels.compile_ahead). Each engine is built in a fresh process with an empty Triton cache: with workers,
its dry forwards record kernels and the workers compile them; greedy tokens equal those of an engine built with
compile_workers=0, for a dense FP8 model and an MoE one (whose routing kernels run for real in the dry forwards).
The dry forwards run one decoder layer of each kind (`kestrel.worker.dry_layers`): they record as many kernel
specializations as dry forwards over every layer do. The profile's wave prefetches the capture's kernels, and the
capture's wave waits for those compiles instead of submitting them again.
Run on the H200: `.venv/bin/python -m pytest -q tests/gpu/test_compile_ahead_gpu.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kestrel.loader.model_init import write_tiny_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BUILD = """
import contextlib, json, sys
from kestrel import LLM, SamplingParams
path, workers, quantization, every_layer = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None, sys.argv[4] == "1"
if every_layer:
    import kestrel.worker.runner_setup as setup
    setup.one_layer_of_each_kind = lambda model: contextlib.nullcontext(0)
llm = LLM(path, dtype="bfloat16", max_model_len=128, max_num_seqs=8, device="cuda", quantization=quantization,
          compile_workers=workers)
prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 150 for j in range(5 + 9 * i)]} for i in range(6)]
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "stats": llm.runner.compile_ahead_stats}))
"""


def build(path: Path, workers: int, quantization: str, cache: Path, every_layer: bool = False) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", BUILD, str(path), str(workers), quantization,
                           "1" if every_layer else "0"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch,quantization", [("llama", "fp8"), ("qwen3_moe", "")], ids=["llama-fp8", "qwen3-moe"])
def test_compiled_ahead_engine_generates_what_the_plain_one_does(tmp_path: Path, arch: str,
                                                                 quantization: str) -> None:
    write_tiny_checkpoint(tmp_path / "model", arch=arch, seed=6, num_hidden_layers=4)
    ahead = build(tmp_path / "model", 4, quantization, tmp_path / "cache-ahead")
    plain = build(tmp_path / "model", 0, quantization, tmp_path / "cache-plain")
    every = build(tmp_path / "model", 4, quantization, tmp_path / "cache-every", every_layer=True)
    assert plain["stats"] == []
    assert len(ahead["stats"]) == 2  # the profile run and the capture
    assert sum(s["kernels"] for s in ahead["stats"]) > 0
    assert [s["layers_left_out"] for s in ahead["stats"]] == [2, 2]  # layers 0 and 1 run dry, 2 and 3 alike
    assert [s["kernels"] for s in ahead["stats"]] == [s["kernels"] for s in every["stats"]]
    # The profile's wave prefetched the capture's kernels, and the capture's wave took those compiles: it
    # submitted none of its own (no KV-scale calibration here, whose kernels only the capture's wave records).
    profile, capture = ahead["stats"]
    assert profile["prefetched"] > 0 and capture["reused"] == capture["kernels"], ahead["stats"]
    assert ahead["tokens"] == plain["tokens"] == every["tokens"]
