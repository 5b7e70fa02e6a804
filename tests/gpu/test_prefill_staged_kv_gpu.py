"""GPU-only: prefill steps that stage their own K/V in token order for the prefill attention launch (read through
TMA, launch feature `prefill_new_kv`) give the logits of the launch that gathers every key from the cache's blocks:
fresh prompts, chunks over cached context, and mixed steps with decodes, BF16 and FP8 caches, the FP8 one also with
the staged keys' dots in FP8 (launch feature `prefill_fp8_dots`) (skipped on CPU).
Run on the H200: `.venv/bin/python -m pytest -q tests/gpu/test_prefill_staged_kv_gpu.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kestrel import LLM, ops
from kestrel.kernels import attention, common
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.attn_metadata import AttentionMetadata

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BLOCKS_PER_ROW = 32
# Norm-wise relative difference of the logits with the FP8 dots (about 2% at the attention output in the kernel
# tests)
FP8_DOTS_LOGITS = 0.1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prefill-staged-kv")
    write_tiny_checkpoint(path, arch="llama", size="small", seed=5, head_dim=64)  # FP8 dots need heads >= 32
    return path


def _step(counts: list[int], seq_lens: list[int], block_size: int):
    """Rows r own blocks 32r .. 32r + 31 (reversed, so a sequence's blocks are not in order); each computes its
    last counts[r] positions."""
    g = torch.Generator().manual_seed(sum(seq_lens) + len(counts))
    ids, positions, slots, starts = [], [], [], [0]
    tables = [[BLOCKS_PER_ROW * r + BLOCKS_PER_ROW - 1 - b for b in range(BLOCKS_PER_ROW)] for r in range(len(counts))]
    for row, (count, seq_len) in enumerate(zip(counts, seq_lens)):
        for p in range(seq_len - count, seq_len):
            positions.append(p)
            slots.append(tables[row][p // block_size] * block_size + p % block_size)
        ids += torch.randint(3, 200, (count,), generator=g).tolist()
        starts.append(starts[-1] + count)
    meta = AttentionMetadata(torch.tensor(slots, device="cuda"), torch.tensor(starts, dtype=torch.int32, device="cuda"),
                             torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                             torch.tensor(tables, dtype=torch.int32, device="cuda"), max(counts), max(seq_lens))
    return torch.tensor(ids, device="cuda"), torch.tensor(positions, device="cuda"), meta


@pytest.mark.parametrize("quantization,kv_cache_dtype,fp8_dots", [(None, "auto", False), ("fp8", "fp8", False),
                                                                   ("fp8", "fp8", True)],
                         ids=["bf16", "fp8", "fp8-fp8-dots"])
def test_staged_prefill_logits_match_the_gathered_launch(checkpoint: Path, quantization: str | None,
                                                         kv_cache_dtype: str, fp8_dots: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    if not common.is_hopper_or_newer(torch.device("cuda")):
        pytest.skip("the staged K/V are read through TMA (Hopper or newer)")
    llm = LLM(str(checkpoint), dtype="bfloat16", quantization=quantization, kv_cache_dtype=kv_cache_dtype,
              max_model_len=512, max_num_seqs=8, device="cuda", kv_cache_blocks=4 * BLOCKS_PER_ROW,
              enforce_eager=True)
    model, bs = llm.runner.model, llm.runner.block_size
    assert model.attention_layers()[0].head_size == 64
    feature = {"on": False}
    original = common.launch_feature
    def launch_feature(name: str, device: torch.device) -> bool:
        if name == "prefill_fp8_dots":
            return fp8_dots
        return feature["on"] if name == "prefill_new_kv" else original(name, device)

    monkeypatch.setattr(common, "launch_feature", launch_feature)
    monkeypatch.setattr(attention, "FP8_DOTS_MIN_TOKENS", 0)  # the test's steps are short
    staged_steps = []
    new_staged = ops.new_staged_kv
    monkeypatch.setattr(ops, "new_staged_kv", lambda *a: staged_steps.append(a[0]) or new_staged(*a))
    # bf16 logits; an FP8 cache's dots run in fp16 over e4m3 values, whose sums the two launches order differently
    tolerance = 2e-2 if kv_cache_dtype == "auto" else 5e-2
    seq_lens = [400, 300, 90, 200]
    steps = ([400], [120, 1, 64], [1, 200, 1, 70], [300, 90, 200])  # fresh, chunk over context + decode, mixed
    with torch.inference_mode():
        model(*_step(seq_lens, seq_lens, bs))  # every row's context in its blocks
        for counts in steps:
            lens = seq_lens[: len(counts)]
            feature["on"] = False
            gathered = model.compute_logits(model(*_step(counts, lens, bs)))
            before = len(staged_steps)
            feature["on"] = True
            staged = model.compute_logits(model(*_step(counts, lens, bs)))
            assert len(staged_steps) > before, "the step did not stage its K/V"
            if fp8_dots:  # e4m3 queries and P: a bounded difference, not elementwise closeness
                difference = ((staged.float() - gathered.float()).norm() / gathered.float().norm()).item()
                assert difference < FP8_DOTS_LOGITS, (counts, difference)
            else:
                torch.testing.assert_close(staged, gathered, rtol=tolerance, atol=tolerance)


def test_fp8_dots_stage_long_steps_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the FP8 dots take steps of FP8_DOTS_MIN_TOKENS and more; shorter ones stage fp16 for fp16 dots."""
    monkeypatch.setattr(common, "launch_feature", lambda name, device: True)
    k_cache = torch.zeros((1, 16, 2, 64), dtype=torch.float8_e4m3fn, device="cuda")
    long_step, short_step = attention.FP8_DOTS_MIN_TOKENS, attention.FP8_DOTS_MIN_TOKENS - 1
    assert attention.stages_fp8(k_cache, long_step) and not attention.stages_fp8(k_cache, short_step)
    assert [x.dtype for x in ops.new_staged_kv(long_step, k_cache)] == [torch.float8_e4m3fn] * 2
    assert [x.dtype for x in ops.new_staged_kv(short_step, k_cache)] == [torch.float16] * 2
