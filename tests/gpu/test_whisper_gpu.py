"""Whisper on CUDA (skipped on CPU): the encoder step and the cross-attention K/V written on the device, the Triton
paged attention reading them (one-token sequences over the whole encoder output) and the decoder's self-attention,
eagerly (no CUDA graphs for Whisper), with the engine's async scheduling: float32 greedy identical to transformers'
`generate` with the same forced tokens (on the CPU), for clips of different lengths batched and chunked.

Run on the H200: `.venv/bin/python -m pytest -q tests/gpu/test_whisper_gpu.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

from kestrel import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from audio_checkpoints import write_whisper  # noqa: E402
from test_whisper import CASES, case, hf_greedy, kestrel_greedy  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_greedy_on_cuda_matches_transformers(tmp_path) -> None:
    checkpoint = write_whisper(tmp_path / "whisper", seed=3)
    model = transformers.WhisperForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    hf = (model, transformers.WhisperFeatureExtractor.from_pretrained(str(checkpoint)))
    llm = LLM(str(checkpoint), dtype="float32", max_num_seqs=8)
    assert llm.runner.device.type == "cuda" and llm.runner.graph_runner is None
    cases = [case(llm, i, through_file=False) for i in range(len(CASES))]  # the H200 host has no soundfile
    expected = [hf_greedy(hf, *c) for c in cases]
    assert kestrel_greedy(llm, cases) == expected
    chunked = LLM(str(checkpoint), dtype="float32", max_num_seqs=2, max_num_batched_tokens=3,
                  enable_prefix_caching=False)
    assert kestrel_greedy(chunked, cases) == expected
    bf16 = LLM(str(checkpoint), dtype="bfloat16", max_num_seqs=8)
    assert all(len(ids) == len(want) for ids, want in zip(kestrel_greedy(bf16, cases), expected))
