"""Gemma 3 with images on CUDA (skipped on CPU): the Triton attention kernel's causal ends inside the model (an image's
placeholders attending to one another both ways, the sliding window cutting in), the encoder step on the device and
the decode CUDA graphs after it: float32 greedy identical to transformers' (on the CPU), whole and in 20-token steps.

Run on the H200: `.venv/bin/python -m pytest -q tests/gpu/test_gemma3_vl_gpu.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

from kestrel import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from multimodal_checkpoints import write_gemma3  # noqa: E402
from test_gemma3_vl import PROMPTS, case, hf_inputs, kestrel_greedy  # noqa: E402
from test_llava import hf_greedy_ids  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_greedy_on_cuda_matches_transformers(tmp_path) -> None:
    checkpoint = write_gemma3(tmp_path / "gemma3", seed=5)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    processor = transformers.AutoProcessor.from_pretrained(str(checkpoint))
    expected = [hf_greedy_ids(model, hf_inputs(processor, *case(i))) for i in range(len(PROMPTS))]
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=256)
    assert llm.runner.device.type == "cuda"
    assert kestrel_greedy(llm, [0, 1, 2]) == expected
    chunked = LLM(str(checkpoint), dtype="float32", max_model_len=256, max_num_batched_tokens=20, max_num_seqs=4,
                  enable_prefix_caching=False)
    assert kestrel_greedy(chunked, [0, 1, 2]) == expected
    bf16 = LLM(str(checkpoint), dtype="bfloat16", max_model_len=256)
    assert all(len(ids) == len(want) for ids, want in zip(kestrel_greedy(bf16, [0, 1, 2]), expected))
