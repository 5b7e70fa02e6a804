"""Paged attention with per-row causal ends (an image's placeholders attending to their whole image, Gemma 3):
the reference, the CPU fast path and the Triton kernel (interpreted on the CPU, compiled on CUDA) against a float64
dense oracle, with and without a sliding window, over prefill chunks, a short query in the decode launch (split
KV) and plain decodes in one batch."""

from __future__ import annotations

import pytest
import torch
from test_attention_triton import FP8_DOTS_PREFILL, FP8_DOTS_ROUNDING, SMALL_DECODE, SMALL_PREFILL, Case, rel_err

from kestrel.kernels.attention import paged_attention_ref
from kestrel.kernels.cpu.attention import paged_attention_cpu

# (context after the step, query tokens), and the image runs (start, length) inside each step's query rows
SEQS = [(40, 40), (60, 25), (30, 1), (24, 3), (45, 12)]
RUNS = [[(5, 18), (30, 4)], [(38, 12)], [], [(21, 3)], [(33, 12)]]


def causal_ends(seqs: list[tuple[int, int]], runs: list[list[tuple[int, int]]]) -> torch.Tensor:
    """Each query row's end of visible keys: its position + 1, or its image run's end."""
    ends: list[int] = []
    for (ctx, query_len), seq_runs in zip(seqs, runs):
        for pos in range(ctx - query_len, ctx):
            inside = [start + length for start, length in seq_runs if start <= pos < start + length]
            ends.append(inside[0] if inside else pos + 1)
    return torch.tensor(ends, dtype=torch.int32)


def dense_oracle(q, k, v, scale, window, ends) -> torch.Tensor:
    """One sequence in float64: row i (position ctx - Lq + i) sees keys p < ends[i] and, with a window,
    p > its position - window."""
    query_len, num_heads, _ = q.shape
    context = k.shape[0]
    group = num_heads // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    q_pos = torch.arange(context - query_len, context).unsqueeze(1)
    k_pos = torch.arange(context).unsqueeze(0)
    allowed = k_pos < ends.long().unsqueeze(1)
    if window is not None:
        allowed &= k_pos > q_pos - window
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vv)


def expected(case: Case, window: int | None, ends: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    starts = case.query_start_loc.tolist()
    for s in range(len(case.seqs)):
        rows = slice(starts[s], starts[s + 1])
        if rows.stop > rows.start:
            out[rows] = dense_oracle(case.q[rows].cpu(), case.keys[s], case.values[s], case.scale, window,
                                     ends[rows])
    return out


@pytest.mark.parametrize("window", [None, 7])
def test_reference_and_cpu_path_match_the_oracle(window: int | None) -> None:
    case = Case(SEQS, 8, 2, 32, torch.device("cpu"), seed=11)
    ends = causal_ends(SEQS, RUNS)
    oracle = expected(case, window, ends)
    assert rel_err(case.run(paged_attention_ref, sliding_window=window, causal_ends=ends), oracle) < 1e-5
    # the fast path reads whole blocks and masks the unwritten slots' scores: they must be finite, as a served
    # cache's are (the case fills them with NaN for the kernels, which never read them)
    case.k_cache.nan_to_num_(0.0)
    case.v_cache.nan_to_num_(0.0)
    assert rel_err(case.run(paged_attention_cpu, sliding_window=window, causal_ends=ends), oracle) < 1e-5
    # the ends change the answer: rows inside a run see keys after them
    plain = case.run(paged_attention_ref, sliding_window=window)
    assert rel_err(plain, oracle) > 1e-2


@pytest.mark.parametrize("staged", ["gathered", "staged", "staged-fp8-dots"])
@pytest.mark.parametrize("window", [None, 7])
def test_triton_kernel_matches_the_oracle(device: torch.device, window: int | None, staged: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged: the prefill launch reads each sequence's own keys (past a row's position inside its image too) from
    the staged rows (`new_kv`); the prefilled rows' cache slots are poisoned after staging, so a read shows. With
    FP8 dots (an FP8 cache, bf16 queries on a GPU) within their rounding (test_attention_triton)."""
    from kestrel.kernels import attention, common

    fp8_dots = staged == "staged-fp8-dots"
    fp8 = dict(dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, cache_dtype=torch.float8_e4m3fn,
               k_scale=0.011, v_scale=0.0073)
    case = Case(SEQS, 8, 2, 32, device, seed=12, **(fp8 if fp8_dots else {}))
    ends = causal_ends(SEQS, RUNS)
    oracle = expected(case, window, ends)
    new_kv = None
    if staged != "gathered":
        monkeypatch.setattr(common, "launch_feature", lambda name, device: name != "prefill_fp8_dots" or fp8_dots)
        monkeypatch.setattr(attention, "FP8_DOTS_MIN_TOKENS", 0)  # on a GPU too: the cases' steps are short
        if not attention.reads_staged_kv(case.q, case.k_cache, case.v_cache):
            pytest.skip("no TMA here, or float32 activations on a GPU: the prefill launch gathers every key")
        assert attention.stages_fp8(case.k_cache, case.q.shape[0]) == fp8_dots
        new_kv = case.staged_then_poisoned(SMALL_DECODE.block_m // 4)
    out = case.run(sliding_window=window, causal_ends=ends.to(device), decode_cfg=SMALL_DECODE,
                   prefill_cfg=FP8_DOTS_PREFILL if fp8_dots else SMALL_PREFILL, num_splits=2, new_kv=new_kv,
                   **(dict(k_scale=fp8["k_scale"], v_scale=fp8["v_scale"]) if fp8_dots else {}))
    assert rel_err(out, oracle) < (FP8_DOTS_ROUNDING if fp8_dots else 1e-5)


def test_ends_at_the_rows_own_positions_are_causal_attention(device: torch.device) -> None:
    case = Case(SEQS, 4, 2, 32, device, seed=13)
    ends = causal_ends(SEQS, [[] for _ in SEQS])
    out = case.run(causal_ends=ends.to(device), decode_cfg=SMALL_DECODE, prefill_cfg=SMALL_PREFILL, num_splits=1)
    assert rel_err(out, case.expected()) < 1e-5
